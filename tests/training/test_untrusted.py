"""Run directories may come from anyone: their files are read without unpickling objects.

A crafted pickle (one that creates a marker file when unpickled) is refused as a checkpoint and
ignored as a data part; each test first shows that plain pickle loading *would* run it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exactspec.errors import InvalidValue
from exactspec.models.loading import Model
from exactspec.training.data import build_corpus, read_part, write_part
from exactspec.training.train import (
    CHECKPOINT,
    CONFIG,
    TrainConfig,
    check_same_run,
    load_checkpoint,
    train_draft,
)
from tests.engine.tiny import char_tokenizer, tiny_llama


class Payload:
    """Unpickling this calls Path.touch(marker): arbitrary code, as an attacker would ship."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _crafted(path: Path, marker: Path, *, shown_on: Path) -> Path:
    """Write the payload with torch.save to `path`; prove on a copy that it runs when loaded."""
    torch.save({"head": {}, "state": Payload(marker)}, path)
    shown_on.write_bytes(path.read_bytes())
    torch.load(shown_on, weights_only=False)  # what the old code did
    assert marker.exists(), "the crafted file does not run code; the test would prove nothing"
    marker.unlink()
    return path


def tiny_model() -> Model:
    return Model(model=tiny_llama(7, eos=0), tokenizer=char_tokenizer(), name="tiny")


def config(steps: int = 2, **kw) -> TrainConfig:
    base = dict(model="tiny", minutes=0.0, max_steps=steps, hidden_layers=(1, -1),
                draft_vocab_size=24, depth=2, max_new_tokens=4, data_batch=3,
                tokens_per_batch=40, eval_new_tokens=4, eval_depth=2, warmup=1,
                prompts=["hello there", "a cat sat", "why not"], heldout=["the end"])
    return TrainConfig(**{**base, **kw})


def test_crafted_checkpoint_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt = _crafted(tmp_path / CHECKPOINT, marker, shown_on=tmp_path / "copy.pt")
    with pytest.raises(InvalidValue, match="could run code"):
        load_checkpoint(ckpt)
    assert not marker.exists()


def test_resume_from_a_crafted_checkpoint_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _crafted(tmp_path / CHECKPOINT, marker, shown_on=tmp_path / "copy.pt")
    with pytest.raises(InvalidValue, match="could run code"):
        train_draft(config(3), tmp_path, resume=True, model=tiny_model())
    assert not marker.exists()


def test_pickle_data_parts_are_ignored_and_rebuilt(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = tmp_path / "data"
    data.mkdir()
    _crafted(data / "part-0000.pt", marker, shown_on=tmp_path / "copy.pt")
    model = tiny_model()
    seqs = build_corpus(model, ["hello there", "a cat sat"], data, hidden_layers=(1, -1),
                        max_new_tokens=4, batch_size=2)
    assert not marker.exists()
    assert len(seqs) == 2 and (data / "part-0000.safetensors").is_file()


def test_a_data_part_that_is_not_safetensors_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _crafted(tmp_path / "part-0000.safetensors", marker, shown_on=tmp_path / "copy.pt")
    with pytest.raises(InvalidValue, match="not a readable safetensors file"):
        read_part(tmp_path / "part-0000.safetensors")
    assert not marker.exists()


def test_data_parts_round_trip_exactly(tmp_path: Path) -> None:
    model = tiny_model()
    seqs = build_corpus(model, ["hello there", "a cat sat", "why not"], tmp_path,
                        hidden_layers=(1, -1), max_new_tokens=4, replies=2, batch_size=6)
    write_part(tmp_path / "again.safetensors", seqs)
    back = read_part(tmp_path / "again.safetensors")
    assert len(back) == len(seqs) == 6
    for a, b in zip(seqs, back, strict=True):
        for name in ("tokens", "feats", "final"):
            assert torch.equal(getattr(a, name), getattr(b, name)) and \
                getattr(a, name).dtype == getattr(b, name).dtype
        assert torch.equal(a.lse.isnan(), b.lse.isnan())
        assert torch.equal(a.lse.nan_to_num(), b.lse.nan_to_num())
        assert (a.prompt_len, a.greedy) == (b.prompt_len, b.greedy)
    assert {s.greedy for s in back} == {True, False}


def test_resume_with_other_settings_or_nothing_to_resume_is_refused(tmp_path: Path) -> None:
    model = tiny_model()
    with pytest.raises(InvalidValue, match=r"no checkpoint\.pt to continue"):
        train_draft(config(2), tmp_path / "empty", resume=True, model=model)
    assert not (tmp_path / "empty").exists()
    (tmp_path / "data").mkdir()  # an earlier run's data, made with replies=2
    saved = json.dumps(config(2).to_json())
    (tmp_path / CONFIG).write_text(saved)
    for other in (config(3, replies=1), config(3, replies=1, minutes=5.0)):
        with pytest.raises(InvalidValue, match=r"\(replies=2 there, 1 now\)"):
            train_draft(other, tmp_path, model=model)  # reusing its data, resumed or not
    assert (tmp_path / CONFIG).read_text() == saved  # the refused runs changed nothing
    check_same_run(config(7, minutes=3.0, extra={"note": "x"}), tmp_path)  # budgets may change
