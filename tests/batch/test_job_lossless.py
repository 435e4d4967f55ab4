"""Statistical: the samples of a batch job follow the target's exact law (alpha = 1e-6).

One row asks for ROWS samples; each sample draws from the seed derived from (seed, id, index),
decoded speculatively (prompt lookup: the prompt repeats) in shards of the job. The first N tokens of the
samples are tested against the exact law from full forward passes of the target (as in
tests/audit/test_engine_lossless.py). The same test rejects a job whose seed derivation
ignores the index (every sample of a row would repeat one stream), so it has power.
"""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from exactspec.audit import target_law
from exactspec.audit.samplers import sequence_ids
from exactspec.audit.stats import bincount, chi_square
from exactspec.audit.world import logits_table, model_world
from exactspec.batch import job as job_module
from exactspec.batch import run_batch
from exactspec.drafters import PromptLookup
from exactspec.engine.engine import Engine
from exactspec.models import Model
from tests.batch.helpers import PARAMS, PROMPT, V, config, policy, write_rows

N, K = 3, 2  # tokens compared (512 outcomes), drafts per step
ROWS = 2000  # samples of the one row
LETTERS = "abcdefgh"  # one character per token id, so a text prompt is PROMPT exactly


def _tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(LETTERS)}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def law():
    model = policy(0)
    table = logits_table(lambda ids: model(ids).logits, PROMPT, V, N + K)
    return target_law(model_world(table, table, V, N + K, PARAMS, PROMPT), N)


def _counts(tmp_path) -> tuple[torch.Tensor, int]:
    engine = Engine(Model(policy(0), _tokenizer(), "tiny-8"), PromptLookup(),
                    num_draft_tokens=K)
    text = "".join(LETTERS[t] for t in PROMPT)
    inp = write_rows(tmp_path / "in.jsonl", [{"id": "only", "prompt": text}])
    out = tmp_path / "out.jsonl"
    cfg = config("tiny-8", inp, out, n=ROWS, max_new_tokens=N + K, params=PARAMS, seed=11,
                 shard_size=500, spec={"chat": False, "num_draft_tokens": K})
    res = run_batch(cfg, engine=engine)
    assert res.written == ROWS
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    seqs = torch.tensor([r["token_ids"][:N] for r in rows])  # [ROWS, N]
    return bincount(sequence_ids(seqs, V), V**N), sum(r["stats"]["accepted"] for r in rows)


def test_a_job_s_samples_follow_the_target_law(law, tmp_path):
    counts, accepted = _counts(tmp_path)
    assert accepted > ROWS // 10  # drafts were used, not only bonus tokens
    result = chi_square(counts, law)
    assert result.dof > 30 and not result.rejected, result


def test_a_seed_that_ignores_the_index_is_caught(law, tmp_path, monkeypatch):
    monkeypatch.setattr(job_module, "row_seed", lambda seed, row_id, index: seed)
    assert chi_square(_counts(tmp_path)[0], law).rejected
