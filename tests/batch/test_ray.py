"""`exactspec batch --ray` on a local Ray cluster (2 CPUs, loopback, no dashboard): the same
samples as the local run, with a SIGKILLed actor's shard redone elsewhere. One job, since each
job's actors pay for importing torch and loading the model."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import ray

from exactspec.batch import run_batch
from exactspec.errors import InvalidValue
from tests.batch.helpers import config, prompts, read_output, write_rows

SEED = 3


@pytest.fixture(scope="module")
def cluster():
    from exactspec.batch.ray_pool import start_local_ray

    start_local_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def job(tiny_dir, tmp_path_factory):
    """An input of 16 rows x 2 samples and its local run (the reference)."""
    root = tmp_path_factory.mktemp("ray")
    inp = write_rows(root / "in.jsonl", prompts(16))
    run_batch(config(tiny_dir, inp, root / "local.jsonl", n=2, max_new_tokens=12, seed=SEED))
    return inp, read_output(root / "local.jsonl")


def _worker_pids() -> list[int]:
    """This cluster's actor processes: children of its raylet titled ray::_WorkerActor."""
    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == raylet and cmdline.startswith(b"ray::_WorkerActor"):
                pids.append(int(entry.name))
    return pids


def test_a_ray_run_writes_the_local_samples_even_when_an_actor_is_killed(
        cluster, tiny_dir, job, tmp_path):
    """One job on 2 actors; after its first shard one actor is SIGKILLed. Its shard is redone
    by the other actor (a replacement starts), and the file equals the local run's."""
    inp, local = job
    killed: list[int] = []

    def kill_one(records):
        if not killed:
            pids = _worker_pids()
            assert len(pids) == 2, pids
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    cfg = config(tiny_dir, inp, tmp_path / "ray.jsonl", n=2, max_new_tokens=12, seed=SEED,
                 ray=True, workers=2, shard_size=2, spec={"threads": 1})
    res = run_batch(cfg, on_records=kill_one)
    assert killed and res.redone_shards >= 1 and res.written == 32
    assert read_output(tmp_path / "ray.jsonl") == local  # nothing lost, nothing twice


def test_workers_that_cannot_load_the_model_are_a_user_error(cluster, tmp_path):
    inp = write_rows(tmp_path / "in.jsonl", prompts(1))
    cfg = config(tmp_path / "no-such-model", inp, tmp_path / "out.jsonl", ray=True, workers=1)
    with pytest.raises(InvalidValue, match=r"could not build the engine .* no such file"):
        run_batch(cfg)
    assert not (tmp_path / "out.jsonl").exists()
