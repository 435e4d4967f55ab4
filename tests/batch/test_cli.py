"""`exactspec batch` flags reach BatchConfig as documented (the job itself is run_batch's)."""

from __future__ import annotations

import pytest

import exactspec.batch as batch
from exactspec.batch import BatchResult
from exactspec.cli import main


@pytest.fixture
def captured(monkeypatch):
    seen = []

    def fake(cfg):
        seen.append(cfg)
        return BatchResult(3, 1, [], 30, 2.0, 0, 0, 5)

    monkeypatch.setattr(batch, "run_batch", fake)
    return seen


def test_flags_become_the_job(captured, capsys):
    assert main(["batch", "in.jsonl", "out.jsonl", "--model", "m", "--quantized-draft", "--n",
                 "4", "--max-new-tokens", "64", "--temperature", "0.5", "--top-p", "0.9",
                 "--seed", "9", "--logprobs", "--batch-size", "16", "--ray", "--workers", "3",
                 "--threads", "1", "--stop", "\n\n", "--no-chat", "--errors", "e.jsonl"]) == 0
    cfg = captured[0]
    assert (cfg.n, cfg.max_new_tokens, cfg.seed, cfg.logprobs, cfg.errors) == (
        4, 64, 9, True, "e.jsonl")
    assert (cfg.params.temperature, cfg.params.top_p, cfg.params.seed) == (0.5, 0.9, None)
    assert (cfg.ray, cfg.address, cfg.workers) == (True, None, 3)
    spec = cfg.engine
    assert (spec.model, spec.drafter, spec.batch_size, spec.threads, spec.stop, spec.chat) == (
        "m", ("quantized", "8"), 16, 1, ("\n\n",), False)
    assert "wrote 3 samples to out.jsonl (1 already there) on Ray, 3 workers" in (
        capsys.readouterr().out)


def test_ray_address_and_local_defaults(captured):
    assert main(["batch", "in.jsonl", "out.jsonl", "--ray", "10.0.0.1:6379"]) == 0
    assert (captured[0].ray, captured[0].address) == (True, "10.0.0.1:6379")
    assert main(["batch", "in.jsonl", "out.jsonl", "--prompt-lookup"]) == 0
    cfg = captured[1]
    assert (cfg.ray, cfg.engine.drafter, cfg.engine.chat, cfg.n) == (
        False, ("prompt-lookup", ""), True, 1)


@pytest.mark.parametrize(("argv", "message"), [
    (["--workers", "3"], "--workers only applies with --ray"),
    (["--quantized-draft", "5"], "--quantized-draft takes 8"),
    (["--n", "0"], "--n"),
])
def test_bad_flags_exit_2(captured, capsys, argv, message):
    assert main(["batch", "in.jsonl", "out.jsonl", *argv]) == 2
    assert message in capsys.readouterr().err and not captured
