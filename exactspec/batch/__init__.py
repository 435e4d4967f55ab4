"""Resumable batch jobs: a JSONL of prompts in, a JSONL of exact samples out, local or on Ray."""

from exactspec.batch.job import BatchConfig, BatchResult, run_batch
from exactspec.batch.rows import BadRow, InputRow, read_rows, row_seed
from exactspec.batch.work import DRAFTERS, EngineSpec

__all__ = ["DRAFTERS", "BadRow", "BatchConfig", "BatchResult", "EngineSpec", "InputRow",
           "read_rows", "row_seed", "run_batch"]
