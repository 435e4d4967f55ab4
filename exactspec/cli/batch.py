"""`exactspec batch IN.jsonl OUT.jsonl`: a resumable batch job, in this process or on Ray.

Only parsing here; the job is `exactspec.batch.run_batch`, imported inside `run`.
"""

from __future__ import annotations

import argparse

from exactspec.cli.common import (
    add_dtype_flag,
    add_kv_cache_flag,
    at_least,
    draft_tokens,
    refuse_without,
    value_or,
)
from exactspec.cli.drafter_flags import add_drafter_flags, drafter_spec
from exactspec.drafters.registry import drafter_flags


def add(sub) -> None:
    p = sub.add_parser(
        "batch", help="generate samples for a JSONL of prompts, resumable, locally or on Ray",
        description="Reads IN.jsonl ({\"id\": ..., \"prompt\": \"...\"} or {\"id\": ..., "
        "\"messages\": [...]} per line, with optional per-row temperature, top_p, ..., "
        "max_new_tokens, n, seed) and appends one line per sample to OUT.jsonl ({\"id\", "
        "\"index\", \"text\", \"token_ids\", \"logprobs\", \"finish_reason\", \"stats\"}) as "
        "samples finish. Rerun the same command to resume: samples already in OUT are "
        "skipped, a partly written last line is redone. Sample `index` of row `id` draws from "
        "a seed derived from (--seed, id, index), so a resumed or re-sharded job writes the "
        "same samples. Example: exactspec batch prompts.jsonl out.jsonl --n 4 "
        "--max-new-tokens 64 --seed 0 --logprobs --prompt-lookup")
    p.add_argument("input", metavar="IN.jsonl", help="input rows, one JSON object per line")
    p.add_argument("output", metavar="OUT.jsonl", help="output rows (appended; resumed)")
    p.add_argument("--model", default="smollm2-135m",
                   help="target: embedded name, transformers directory or .gguf file")
    add_dtype_flag(p, "; each Ray actor too")
    add_kv_cache_flag(p, "; each Ray actor too")
    add_drafter_flags(p)  # the same drafter flags as generate and serve
    p.add_argument("--n", type=at_least(1), default=1, help="samples per row (default 1)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="0 = off")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="0 = off")
    p.add_argument("--seed", type=int, default=None,
                   help="job seed (default: the resumed job's, or a fresh one, recorded in "
                   "OUT.job.json)")
    p.add_argument("--logprobs", action="store_true",
                   help="write log p of each token under the target's standardized distribution")
    p.add_argument("--batch-size", type=at_least(1), default=64,
                   help="samples per forward pass and per unit of work (default 64)")
    p.add_argument("--num-draft-tokens", type=draft_tokens, default=None, metavar="N|auto",
                   help="draft tokens per step (default 4; 'auto' is lossless too, but a "
                   "seed's text then depends on timings, so a resumed job is not reproducible); "
                   "needs a drafter")
    p.add_argument("--verify", choices=["token", "block", "greedy"], default=None,
                   help="verification method (default token); needs a drafter")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end a sample before this text (repeatable)")
    p.add_argument("--no-chat", action="store_true",
                   help="encode \"prompt\" rows as they are, not as a chat turn")
    p.add_argument("--batch-invariant", action="store_true",
                   help="decode under es.batch_invariant(): the logprobs are then bit-equal to "
                   "es.token_logprobs in a trainer's forward (float32 Llama target)")
    p.add_argument("--errors", metavar="FILE", default=None,
                   help="write bad input rows (with their line numbers) to FILE and run the "
                   "rest (default: refuse the job, listing them); FILE must be neither IN, OUT "
                   "nor OUT.job.json, through any spelling or link")
    p.add_argument("--ray", metavar="ADDRESS", nargs="?", const="", default=None,
                   help="run on Ray actors: a local cluster, or the cluster at ADDRESS")
    p.add_argument("--workers", type=at_least(1), default=None,
                   help="Ray actors, each loading the model once (default 2); needs --ray")
    p.add_argument("--threads", type=at_least(1), default=None,
                   help="torch threads in this process, or per Ray actor (default: torch's "
                   "choice; on Ray, the cluster's CPUs / --workers)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    refuse_without(args, {"workers": "--workers"}, args.ray is not None, "--ray")
    spec = drafter_spec(args)  # refuses ignored drafter flags
    refuse_without(args, {"num_draft_tokens": "--num-draft-tokens", "verify": "--verify"},
                   spec is not None, f"a drafter ({drafter_flags()}); without one, decoding "
                   "is plain")
    workers = value_or(args, "workers", 2)
    from exactspec.batch import BatchConfig, EngineSpec, run_batch
    from exactspec.batch.work import job_drafter
    from exactspec.sampling import SamplingParams

    if args.threads is not None and args.ray is None:
        import torch

        torch.set_num_threads(args.threads)
    engine = EngineSpec(model=args.model, dtype=args.dtype, kv_cache=args.kv_cache,
                      drafter=job_drafter(spec),
                      num_draft_tokens=value_or(args, "num_draft_tokens", 4),
                      verify=value_or(args, "verify", "token"), stop=tuple(args.stop or ()),
                      batch_size=args.batch_size,
                      threads=args.threads if args.ray is not None else None,
                      chat=not args.no_chat, batch_invariant=args.batch_invariant)
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty)
    cfg = BatchConfig(input=args.input, output=args.output, engine=engine, n=args.n,
                      max_new_tokens=args.max_new_tokens, params=params, seed=args.seed,
                      logprobs=args.logprobs, errors=args.errors, ray=args.ray is not None,
                      address=args.ray or None, workers=workers)
    res = run_batch(cfg)
    where = f"on Ray, {workers} workers" if args.ray is not None else "locally"
    bad = ""
    if res.bad_rows:
        bad = f"; {len(res.bad_rows)} bad input rows skipped into {args.errors}"
    print(f"wrote {res.written} samples to {args.output} ({res.already_done} already there{bad}) "
          f"{where} in {res.seconds:.1f} s: {res.written / res.seconds if res.seconds else 0:.2f} "
          f"samples/s, {res.tokens_per_second:.1f} tokens/s; seed {res.seed}")
    return 0
