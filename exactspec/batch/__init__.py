"""Resumable batch jobs: a JSONL of prompts in, a JSONL of exact samples out, local or on Ray.

job.py       `run_batch(BatchConfig)`: the job, resumable    rows.py    input rows, per-row seeds
output.py    the append-only output file                     paths.py   the job's files checked
work.py      a worker: build the engine once, rows -> records  ray_pool.py  the Ray actors
(docs/batch_and_rl.md)
"""

from exactspec.batch.job import BatchConfig, BatchResult, run_batch
from exactspec.batch.rows import BadRow, InputRow, read_rows, row_seed
from exactspec.batch.work import DRAFTERS, EngineSpec

__all__ = ["DRAFTERS", "BadRow", "BatchConfig", "BatchResult", "EngineSpec", "InputRow",
           "read_rows", "row_seed", "run_batch"]
