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
