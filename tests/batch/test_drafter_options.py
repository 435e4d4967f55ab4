"""A batch job's drafter as it travels to its workers: (kind, argument[, options]) from the
registry's flags, JSON-ready (the job file records it), and rebuilt into the same spec."""

from __future__ import annotations

import json

import pytest

import exactspec.batch as batch
from exactspec.batch import BatchResult
from exactspec.batch.work import DRAFTERS, KINDS, drafter_spec, job_drafter
from exactspec.cli import main
from exactspec.drafters import Branching, DynamicTree
from exactspec.drafters.registry import DRAFTERS as REGISTRY
from exactspec.drafters.registry import DrafterSpec
from exactspec.errors import InvalidValue


@pytest.mark.parametrize("spec", [
    DrafterSpec("quantized-draft", 8),
    DrafterSpec("prompt-lookup", tree=Branching((3, 1))),
    DrafterSpec("quantized-draft", 4, tree=DynamicTree(8, 2, 3), siblings="iid",
                backend="torch", layers=(0, 1)),
    DrafterSpec("eagle", "smollm2-135m", tree=Branching((2, 2)), siblings="deterministic"),
    DrafterSpec("cross-vocab-draft", "some/dir"),
    DrafterSpec("draft", "smollm2-135m", dtype="bfloat16"),
])
def test_a_spec_survives_the_job_file(spec):
    recorded = json.loads(json.dumps(job_drafter(spec)))  # what OUT.job.json holds
    assert drafter_spec(*recorded) == spec


def test_kinds_are_the_registrys_drafters():
    assert set(KINDS.values()) <= set(REGISTRY) and set(DRAFTERS) == set(KINDS)
    assert job_drafter(DrafterSpec("quantized-draft", 8)) == ("quantized", "8")
    with pytest.raises(InvalidValue, match="drafter kind 'lookup' is not one of"):
        drafter_spec("lookup", "")


def test_tree_flags_reach_the_job(monkeypatch):
    seen = []
    monkeypatch.setattr(batch, "run_batch",
                        lambda cfg: seen.append(cfg) or BatchResult(0, 0, [], 0, 1.0, 0, 0, 1))
    assert main(["batch", "in.jsonl", "out.jsonl", "--quantized-draft", "4", "--tree", "2,2",
                 "--siblings", "iid", "--draft-backend", "torch"]) == 0
    assert seen[0].engine.drafter == ("quantized", "4", (("tree", "2,2"), ("siblings", "iid"),
                                                         ("backend", "torch")))


def test_the_dtype_and_kv_cache_flags_reach_the_job(monkeypatch, tmp_path):
    """--dtype and --kv-cache load the target so in every worker (and a --draft model by name
    in --dtype); float32, the default, is not written into the drafter or the job's settings,
    so jobs recorded before these flags resume."""
    from exactspec.batch.job import _settings, run_batch

    seen = []
    monkeypatch.setattr(batch, "run_batch",
                        lambda cfg: seen.append(cfg) or BatchResult(0, 0, [], 0, 1.0, 0, 0, 1))
    assert main(["batch", "in.jsonl", "out.jsonl", "--dtype", "bfloat16", "--kv-cache",
                 "bfloat16", "--draft", "smollm2-135m"]) == 0
    assert main(["batch", "in.jsonl", "out.jsonl", "--draft", "smollm2-135m"]) == 0
    bf16, f32 = seen[0], seen[1]
    assert (bf16.engine.dtype, bf16.engine.kv_cache) == ("bfloat16", "bfloat16")
    assert bf16.engine.drafter == ("draft", "smollm2-135m", (("dtype", "bfloat16"),))
    assert (f32.engine.dtype, f32.engine.kv_cache) == ("float32", "float32")
    assert f32.engine.drafter == ("draft", "smollm2-135m")
    assert {"dtype", "kv_cache"} <= set(_settings(bf16, 1, "m"))
    assert not {"dtype", "kv_cache"} & set(_settings(f32, 1, "m"))
    assert main(["batch", "in.jsonl", "out.jsonl", "--dtype", "float16"]) == 2
    cfg = batch.BatchConfig(input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "o.jsonl"),
                            engine=batch.EngineSpec(model="smollm2-135m", kv_cache="fp8"))
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    with pytest.raises(InvalidValue, match="kv_cache='fp8' must be one of"):
        run_batch(cfg)


def test_a_worker_loads_the_target_in_its_dtype_and_cache(tiny_dir):
    import torch

    from exactspec.batch.work import EngineSpec
    from exactspec.models.cache import kv_cache_dtype

    engine = EngineSpec(model=str(tiny_dir), dtype="bfloat16", kv_cache="bfloat16").build()
    assert next(engine.model.model.parameters()).dtype == torch.bfloat16
    assert kv_cache_dtype(engine.model.model) == torch.bfloat16
    plain = EngineSpec(model=str(tiny_dir)).build()
    assert next(plain.model.model.parameters()).dtype == torch.float32
    assert kv_cache_dtype(plain.model.model) is None
