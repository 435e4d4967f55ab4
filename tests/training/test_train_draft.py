"""train_draft end to end on a tiny random Llama: data, training, checkpoint, resume, outputs."""

from __future__ import annotations

import itertools
import json

import pytest

from exactspec.drafters.eagle import load_drafter
from exactspec.models.loading import Model
from exactspec.training.train import CHECKPOINT, TrainConfig, load_checkpoint, train_draft
from tests.engine.tiny import char_tokenizer, tiny_llama


def tiny_model() -> Model:
    return Model(model=tiny_llama(7, eos=0), tokenizer=char_tokenizer(), name="tiny")


def config(steps: int) -> TrainConfig:
    return TrainConfig(model="tiny", minutes=0.0, max_steps=steps, hidden_layers=(1, -1),
                       draft_vocab_size=24, depth=2, max_new_tokens=6, data_batch=3,
                       tokens_per_batch=40, eval_new_tokens=6, eval_depth=3, warmup=2,
                       prompts=["hello there", "a cat sat", "why not", "ok go now", "one two"],
                       heldout=["the end", "good day"])


def test_train_draft_runs_resumes_and_loads(tmp_path):
    model = tiny_model()
    first = train_draft(config(3), tmp_path, model=model)
    assert first.steps == 3
    for name in ("head/config.json", "head/head.safetensors", "loss.png", "eval.json",
                 CHECKPOINT):
        assert (tmp_path / name).is_file(), name
    ev = json.loads((tmp_path / "eval.json").read_text())
    for mode in ("t1", "greedy"):
        got = ev[mode]
        assert got["positions"] > 0
        assert len(got["alpha_by_depth"]) == 3
        assert all(0.0 <= a <= 1.0 for a in got["alpha_by_depth"])
        first_k = got["accept_first_k"]
        assert all(a >= b for a, b in itertools.pairwise(first_k))
        assert got["mean_acceptance_length"] == pytest.approx(1 + sum(first_k), abs=1e-3)
    with pytest.raises(ValueError, match="--resume"):
        train_draft(config(5), tmp_path, model=model)
    data_parts = sorted(p.name for p in (tmp_path / "data" / "train").glob("part-*.safetensors"))
    assert data_parts and not any((tmp_path / "data").rglob("*.pt"))  # no pickles written
    second = train_draft(config(5), tmp_path, resume=True, model=model)
    assert second.steps == 5  # continued from step 3, not restarted
    ck = load_checkpoint(tmp_path / CHECKPOINT)
    assert [h["step"] for h in ck["state"]["history"]] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (tmp_path / "data" / "train").glob("part-*.safetensors")) == data_parts
    drafter = load_drafter(tmp_path / "head", target=model)
    assert drafter.hidden_layers == (1, -1)
    assert drafter.head.config.meta["steps"] == 5
    assert drafter.head.vocab_ids.numel() == 24


@pytest.mark.parametrize("args", [["--replies", "0"], ["--minutes", "0"], ["--minutes", "-1"]])
def test_cli_rejects_bad_budgets_before_loading_anything(tmp_path, capsys, args):
    from exactspec import cli

    assert cli.main(["train-draft", "--out", str(tmp_path / "out"), *args]) == 2
    assert "train-draft" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
