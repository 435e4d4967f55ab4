"""Input files and output readers shared by the batch tests."""

from __future__ import annotations

import json
from pathlib import Path

from exactspec.batch import BatchConfig, EngineSpec


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
