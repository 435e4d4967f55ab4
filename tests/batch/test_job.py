"""`exactspec batch` in this process: resume after SIGKILL or a torn last line, bad rows,
per-row settings and seeds, the output format. Exact and end-to-end, on a tiny random model."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from exactspec.batch import run_batch
from exactspec.batch.output import OutputFile
from exactspec.cli import main
from exactspec.engine import generate
from exactspec.errors import InvalidValue
from exactspec.models import load
from exactspec.sampling import SamplingParams, probs_from_logits
from tests.batch.helpers import config, prompts, read_output, write_rows

SEED = 7


def test_resume_after_sigkill_writes_each_sample_once_as_an_uninterrupted_run(tiny_dir, tmp_path):
    inp = write_rows(tmp_path / "in.jsonl", prompts(40))
    total = 40 * 2
    ref = run_batch(config(tiny_dir, inp, tmp_path / "ref.jsonl", n=2, max_new_tokens=16,
                           seed=SEED))
    assert ref.written == total
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "exactspec.cli", "batch", str(inp), str(out), "--model",
           str(tiny_dir), "--n", "2", "--max-new-tokens", "16", "--seed", str(SEED),
           "--batch-size", "2", "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while (not out.exists() or out.read_bytes().count(b"\n") < 10) and proc.poll() is None:
        assert time.monotonic() < deadline, "the job wrote nothing in 120 s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    written_before = out.read_bytes().count(b"\n")
    assert 10 <= written_before < total  # killed mid-run
    res = run_batch(config(tiny_dir, inp, out, n=2, max_new_tokens=16, seed=SEED))
    assert res.already_done == written_before and res.written == total - written_before
    assert read_output(out) == read_output(tmp_path / "ref.jsonl")  # each pair once, same rows


def test_a_torn_last_line_is_cut_off_and_redone(tiny_dir, tmp_path):
    inp = write_rows(tmp_path / "in.jsonl", prompts(5))
    out = tmp_path / "out.jsonl"
    cfg = config(tiny_dir, inp, out, n=2, max_new_tokens=12, seed=SEED)
    run_batch(cfg)
    ref = read_output(out)
    data = out.read_bytes()
    out.write_bytes(data[:-15])  # a crash in the middle of writing the last line
    res = run_batch(cfg)
    last_line = len(data) - data[:-1].rfind(b"\n") - 1
    assert res.repaired_bytes == last_line - 15 and res.written == 1 and res.already_done == 9
    assert read_output(out) == ref
    again = run_batch(cfg)  # nothing left to do
    assert again.written == 0 and again.already_done == 10 and read_output(out) == ref


BAD_INPUT = [
    '{"id": "a", "prompt": "fine"}',
    "not json",
    '{"id": "a", "prompt": "the same id again"}',
    '{"prompt": "no id"}',
    '{"id": "b"}',
    '{"id": "c", "prompt": "x", "temperature": -1}',
    '{"id": "d", "prompt": "too long for its budget", "max_new_tokens": 600}',
    "",
    '{"id": "e", "messages": [{"role": "user", "content": "hi"}], "top_k": 3}',
]
BAD_LINES = {2: "not JSON", 3: 'duplicate id "a" (first on line 1)', 4: 'no "id"',
             5: 'exactly one of "prompt"', 6: "temperature=-1", 7: "exceeds"}


def test_bad_rows_are_refused_up_front_with_their_line_numbers(tiny_dir, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(BAD_INPUT) + "\n")
    out = tmp_path / "out.jsonl"
    code = main(["batch", str(inp), str(out), "--model", str(tiny_dir), "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "6 bad rows, nothing was run" in err and "--errors FILE" in err
    assert "line 2: not JSON" in err and "line 3: duplicate" in err
    assert not out.exists()


def test_bad_rows_are_skipped_into_an_errors_file(tiny_dir, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(BAD_INPUT) + "\n")
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    code = main(["batch", str(inp), str(out), "--model", str(tiny_dir), "--max-new-tokens", "4",
                 "--seed", "1", "--errors", str(errors)])
    assert code == 0, capsys.readouterr().err
    bad = [json.loads(line) for line in errors.read_text().splitlines()]
    assert [b["line"] for b in bad] == sorted(BAD_LINES)
    for b in bad:
        assert BAD_LINES[b["line"]] in b["error"], b
    assert bad[0]["text"] == "not json" and bad[1]["id"] == "a"
    assert sorted(read_output(out)) == [('"a"', 0), ('"e"', 0)]


def test_samples_do_not_depend_on_position_batch_or_order(tiny_dir, tmp_path):
    rows = prompts(12)
    a = run_batch(config(tiny_dir, write_rows(tmp_path / "a.jsonl", rows), tmp_path / "a.out",
                         n=3, max_new_tokens=16, seed=SEED, spec={"batch_size": 64}))
    b = run_batch(config(tiny_dir, write_rows(tmp_path / "b.jsonl", rows[::-1][:7]),
                         tmp_path / "b.out", n=3, max_new_tokens=16, seed=SEED,
                         spec={"batch_size": 2}))
    assert a.written == 36 and b.written == 21
    ref, got = read_output(tmp_path / "a.out"), read_output(tmp_path / "b.out")
    assert all(got[k] == ref[k] for k in got)
    texts = [ref[('"r0"', i)]["token_ids"] for i in range(3)]
    assert len({tuple(t) for t in texts}) == 3  # the samples of a row differ from each other
    c = run_batch(config(tiny_dir, tmp_path / "a.jsonl", tmp_path / "c.out", n=3,
                         max_new_tokens=16, seed=SEED + 1))
    assert c.written == 36
    assert read_output(tmp_path / "c.out")[('"r0"', 0)] != ref[('"r0"', 0)]  # another seed


def test_per_row_settings_override_the_job(tiny_dir, tmp_path):
    rows = [{"id": 1, "prompt": "tea", "temperature": 0, "max_new_tokens": 9},
            {"id": 2, "prompt": "tea", "n": 3, "max_new_tokens": 5},
            {"id": 3, "prompt": "tea", "seed": 11, "max_new_tokens": 5},
            {"id": 4, "prompt": "tea", "seed": 11, "max_new_tokens": 5, "top_k": 1}]
    inp = write_rows(tmp_path / "in.jsonl", rows)
    run_batch(config(tiny_dir, inp, tmp_path / "out.jsonl", n=1, max_new_tokens=20, seed=SEED))
    got = read_output(tmp_path / "out.jsonl")
    assert sorted(got) == [("1", 0), ("2", 0), ("2", 1), ("2", 2), ("3", 0), ("4", 0)]
    model = load(str(tiny_dir))
    ids = model.encode("tea", chat=True)
    greedy = generate(model, [ids], params=SamplingParams(temperature=0), max_new_tokens=9)[0]
    assert got[("1", 0)]["token_ids"] == greedy.token_ids
    assert all(len(got[("2", i)]["token_ids"]) == 5 for i in range(3))
    top1 = generate(model, [ids], params=SamplingParams(top_k=1), max_new_tokens=5)[0]
    assert got[("4", 0)]["token_ids"] == top1.token_ids  # top_k=1 is greedy too
    assert got[("3", 0)]["token_ids"] != top1.token_ids


def test_output_rows_carry_the_target_logprobs(tiny_dir, tmp_path):
    inp = write_rows(tmp_path / "in.jsonl", [{"id": "m", "messages": [
        {"role": "user", "content": "hi"}]}, {"id": "p", "prompt": "hello"}])
    run_batch(config(tiny_dir, inp, tmp_path / "out.jsonl", n=2, max_new_tokens=10, seed=SEED,
                     logprobs=True, params=SamplingParams(temperature=0.7),
                     spec={"drafter": ("prompt-lookup", "")}))
    model = load(str(tiny_dir))
    tok = model.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    prompt_ids = {"m": tok(chat, add_special_tokens=False)["input_ids"],
                  "p": model.encode("hello", chat=True)}
    for (key, _index), rec in read_output(tmp_path / "out.jsonl").items():
        assert set(rec) == {"id", "index", "text", "token_ids", "logprobs", "finish_reason",
                            "stats"}
        assert rec["finish_reason"] in ("eos", "length") and rec["stats"]["emitted"] == len(
            rec["token_ids"])
        assert rec["text"] == tok.decode(rec["token_ids"], skip_special_tokens=True)
        prompt = prompt_ids[json.loads(key)]
        with torch.no_grad():
            logits = model.model(torch.tensor([prompt + rec["token_ids"]])).logits[0]
        p = probs_from_logits(logits[len(prompt) - 1:-1], SamplingParams(temperature=0.7))
        want = p.gather(1, torch.tensor(rec["token_ids"])[:, None])[:, 0].log()
        assert (torch.tensor(rec["logprobs"]) - want).abs().max() < 1e-4  # float32 rounding


def test_greedy_speculative_job_equals_greedy_plain_job(tiny_dir, tmp_path):
    inp = write_rows(tmp_path / "in.jsonl", prompts(6))
    greedy = SamplingParams(temperature=0)
    run_batch(config(tiny_dir, inp, tmp_path / "plain.jsonl", max_new_tokens=24, params=greedy,
                     seed=0))
    run_batch(config(tiny_dir, inp, tmp_path / "spec.jsonl", max_new_tokens=24, params=greedy,
                     seed=0, spec={"drafter": ("prompt-lookup", "")}))
    plain, spec = read_output(tmp_path / "plain.jsonl"), read_output(tmp_path / "spec.jsonl")
    assert {k: r["token_ids"] for k, r in spec.items()} == {
        k: r["token_ids"] for k, r in plain.items()}
    assert sum(r["stats"]["drafted"] for r in spec.values()) > 0


def test_resuming_with_other_settings_is_refused(tiny_dir, tmp_path):
    inp = write_rows(tmp_path / "in.jsonl", prompts(2))
    cfg = config(tiny_dir, inp, tmp_path / "out.jsonl", max_new_tokens=4)
    first = run_batch(cfg)  # no seed given: a fresh one, recorded and reused on resume
    assert run_batch(cfg).already_done == 2 and run_batch(cfg).seed == first.seed
    with pytest.raises(InvalidValue, match="seed"):
        run_batch(replace(cfg, seed=first.seed + 1))
    with pytest.raises(InvalidValue, match="max_new_tokens"):
        run_batch(replace(cfg, max_new_tokens=5))
    (tmp_path / "out.jsonl.job.json").unlink()  # the record is gone: the seed is unknown
    with pytest.raises(InvalidValue, match="does not say their seed"):
        run_batch(cfg)
    assert run_batch(replace(cfg, seed=first.seed)).already_done == 2


def test_two_jobs_cannot_append_to_one_output(tmp_path):
    with OutputFile(tmp_path / "out.jsonl", {"seed": 1}), pytest.raises(
            InvalidValue, match="another exactspec batch job"):
        OutputFile(tmp_path / "out.jsonl", {"seed": 1})
