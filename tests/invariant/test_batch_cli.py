"""`exactspec batch --batch-invariant`: the job's logprobs equal es.token_logprobs of its
samples bit for bit (tiny model saved as a directory, int8 self-draft, local run)."""

from __future__ import annotations

import torch

import exactspec as es
from exactspec.cli import main
from tests.batch.helpers import prompts, read_output, write_rows
from tests.batch.tiny_dir import save_tiny


def test_batch_job_logprobs_equal_the_trainer(tmp_path, capsys):
    model_dir = save_tiny(tmp_path / "model", eos=None)
    inp = write_rows(tmp_path / "in.jsonl", prompts(3))
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(inp), str(out), "--model", str(model_dir), "--quantized-draft",
                 "--n", "2", "--max-new-tokens", "10", "--top-p", "0.9", "--logprobs",
                 "--no-chat", "--seed", "1", "--batch-invariant"]) == 0
    model = es.load(str(model_dir))
    params = es.SamplingParams(top_p=0.9)
    rows = {r["id"]: r["prompt"] for r in prompts(3)}
    recs = list(read_output(out).values())
    assert len(recs) == 6
    seqs, plens = [], []
    for rec in recs:
        ids = model.encode(rows[rec["id"]])
        seqs.append(ids + rec["token_ids"])
        plens.append(len(ids))
    with es.batch_invariant():
        lp = es.token_logprobs(model, seqs, plens, params).detach()
    for i, rec in enumerate(recs):
        ref = torch.tensor(rec["logprobs"], dtype=torch.float32)
        assert torch.equal(lp[i, : len(ref)], ref)
    capsys.readouterr()
