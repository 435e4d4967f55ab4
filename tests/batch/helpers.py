"""Input files and output readers shared by the batch tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from exactspec.batch import BatchConfig, EngineSpec
from exactspec.sampling import SamplingParams
from tests.engine.tiny import tiny_llama

V = 8  # vocabulary of the statistical tests' models (sequences of 3 tokens: 512 outcomes)
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so prompt lookup finds something to copy
PARAMS = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)


def policy(seed: int):
    """A tiny Llama over V tokens with a spread of probabilities (no EOS: every row runs to
    its budget)."""
    model = tiny_llama(seed, vocab=V, eos=None, max_pos=64)
    with torch.no_grad():
        model.lm_head.weight.div_(4.0)  # tiny_llama sharpens by 20; 5 as in the audit's tests
    return model


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompts(count: int) -> list[dict]:
    """`count` rows with different prompts over the tiny tokenizer's alphabet."""
    words = ["tea", "a cat", "hello there", "seven", "blue sky", "x", "quiet", "go on"]
    return [{"id": f"r{i}", "prompt": f"{words[i % len(words)]} {i}"} for i in range(count)]


def read_output(path: Path) -> dict[tuple[str, int], dict]:
    """Output rows by (id, index); asserts that no pair appears twice."""
    out: dict[tuple[str, int], dict] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        key = (json.dumps(rec["id"]), rec["index"])
        assert key not in out, f"{key} written twice"
        out[key] = rec
    return out


def config(model_dir: Path, inp: Path, out: Path, **kw) -> BatchConfig:
    spec = kw.pop("spec", {})
    kw.setdefault("progress", False)
    return BatchConfig(input=inp, output=out, engine=EngineSpec(model=str(model_dir), **spec),
                       **kw)
