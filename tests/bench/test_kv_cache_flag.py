"""`exactspec bench --kv-cache bfloat16`: the bench's target carries the bf16 KV cache (its
exactspec engines decode on it), the JSON and the report say so; misspelled, it is refused."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from exactspec import kernels
from exactspec.bench import Bench
from exactspec.cli import main
from exactspec.models.cache import kv_cache_dtype
from tests.batch.tiny_dir import save_tiny


def test_the_flags_names_are_es_loads():
    from exactspec.cli.common import DTYPES as DTYPE_FLAG
    from exactspec.cli.common import KV_CACHES as FLAG
    from exactspec.models.cache import KV_CACHES
    from exactspec.models.loading import DTYPES

    assert set(FLAG) == set(KV_CACHES)
    assert set(DTYPE_FLAG) == set(DTYPES)  # --dtype of generate, serve, batch and bench


def test_a_misspelled_kv_cache_is_refused(capsys):
    assert main(["bench", "--kv-cache", "fp8"]) == 2
    assert "--kv-cache" in capsys.readouterr().err


@pytest.mark.skipif(not kernels.enabled(), reason="the bf16 cache runs on our kernels only")
@pytest.mark.parametrize("kv", ["bfloat16", "float32"])
def test_the_benchs_target_carries_the_cache(kv, tmp_path, monkeypatch):
    seen, real = [], Bench.run

    def run(self):
        seen.append(kv_cache_dtype(self.target.model))
        return real(self)

    monkeypatch.setattr(Bench, "run", run)
    out = tmp_path / "out"
    try:
        code = main(["bench", "--model", str(save_tiny(tmp_path / "m")), "--kv-cache", kv,
                     "--engines", "exactspec plain", "--modes", "greedy", "--workloads",
                     "chat", "--rounds", "1", "--max-new-tokens", "4", "--no-eagle",
                     "--draft-layers", "1", "--threads", "1", "--out", str(out)])
    finally:
        gc.unfreeze()  # the command settled this worker's objects (exactspec/_collector.py)
    assert code == 0
    assert seen == [torch.bfloat16 if kv == "bfloat16" else None]
    result = json.loads((out / "bench.json").read_text())
    assert result["kv_cache"] == kv and result["target_dtype"] == "float32"
    assert [r["engine"] for r in result["results"]] == ["exactspec plain"]
    said = "on a bf16 KV cache" in (out / "bench.md").read_text()
    assert said == (kv == "bfloat16")
