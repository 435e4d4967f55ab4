"""Ray is optional (`pip install 'exactspec[ray]'`; `make run` does not install it): the two
commands that run on it say so in one line, exit 2, where it is missing."""

from __future__ import annotations

import importlib.util

import pytest

from exactspec.batch import ray_pool
from exactspec.cli import main


@pytest.fixture
def no_ray(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))


def test_require_ray_names_the_install(no_ray):
    with pytest.raises(ValueError, match=r"pip install 'exactspec\[ray\]'"):
        ray_pool.require_ray("exactspec batch --ray")


def test_serve_replicas_without_ray_is_one_line_exit_2(no_ray, capsys):
    assert main(["serve", "--replicas", "2", "--port", "0"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "exactspec serve --replicas runs on Ray" in err[0], err
