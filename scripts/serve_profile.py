"""Where a serving step's time goes: the server's engine loop driven in-process, no HTTP.

`streams` clients each send `requests` chat requests one after another (the bench-serve load:
a finished row's client sends its next request, admitted before the next step), through the
engine's one boundary (`Decoder.admit / step / drop`). One plain and one speculative engine,
each kept across the loads as a server keeps its engine (and its draft-length policy), take
turns at every load. Per run: tokens/s, steps, tokens gained per row-step, the policy's
pooled acceptance and costs, and seconds in each part (target prefill, target forward, draft
propose, llama.cpp decode and the tokens fed to it, drafter admission and begin, the policy's
choice), by wrapping those calls with perf_counter accumulators.

    python scripts/serve_profile.py --streams 1,4,16 --requests 2 --max-tokens 64 --threads 2

Rough figures for decisions only: other processes share the cores.
"""

from __future__ import annotations

import argparse
import collections
import logging
import time

import torch

import exactspec as es
from exactspec.engine.decoder import DecodeConfig, Decoder
from exactspec.sampling import RowStreams, SamplingParams
from exactspec.serve.bench import bench_prompts

TIMES: dict[str, float] = collections.defaultdict(float)
COUNTS: dict[str, int] = collections.defaultdict(int)


def timed(obj, name: str, label: str):
    """Wrap obj.name so its seconds add up under `label`."""
    fn = getattr(obj, name)
    if getattr(fn, "_timed", False):  # wrapped by an earlier run (a shared drafter)
        return

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            TIMES[label] += time.perf_counter() - t0
            COUNTS[label] += 1

    wrapper._timed = True
    setattr(obj, name, wrapper)


def decoder(model, drafter, k) -> Decoder:
    """One server's engine: kept across loads, as the server keeps it (and its policy)."""
    cfg = DecodeConfig(params=SamplingParams(), max_new_tokens=1, num_draft_tokens=k,
                       verify="token", return_logprobs=True, eos_token_ids=model.eos_token_ids,
                       stop=[], tokenizer=model.tokenizer)
    dec = Decoder(model, drafter, cfg, on_fault="plain")
    timed(dec.target, "extend", "target forward (extend)")
    timed(dec.target, "prefill", "target prefill")
    timed(dec.target, "select", "target select (rows left)")
    if drafter is not None:
        timed(dec.draft.drafter, "propose", "draft propose")
        timed(dec.draft.drafter, "admit", "draft admit")
        timed(dec.draft.drafter, "begin", "draft begin")
        timed(dec.policy, "choose", "policy choose")
        timed(dec.draft.drafter, "select", "draft select (rows left)")
    return dec


def instrument_gguf(drafter) -> None:
    inner = getattr(drafter, "_gguf", None)
    if inner is None:
        return
    timed(inner, "_decode", "llama.cpp decode")
    chunk = inner._decode_chunk
    if getattr(chunk, "_counted", False):
        return

    def counted(c, items, out):
        COUNTS["llama.cpp tokens fed"] += len(items)
        return chunk(c, items, out)

    counted._counted = True
    inner._decode_chunk = counted


def instrument_torch_draft(drafter) -> None:
    """Count the tokens (rows x width, padding included) the torch draft's forwards run."""
    ad = getattr(drafter, "_adapter", None)
    if ad is None or getattr(ad.extend, "_counted", False):
        return
    extend = ad.extend

    def counted(tokens, **kw):
        COUNTS["torch draft tokens run"] += int(tokens.numel())
        t0 = time.perf_counter()
        try:
            return extend(tokens, **kw)
        finally:
            TIMES["torch draft forward"] += time.perf_counter() - t0

    counted._counted = True
    ad.extend = counted


def run(dec, prompts, streams, requests, max_tokens, temperature):
    params = SamplingParams(temperature=temperature)
    left = [requests] * streams
    ids = iter(range(10**9))
    pending = []
    for s in range(streams):
        pending.append(s)
    stream_of = {}
    tokens = steps = 0
    ks = collections.Counter()
    t0 = time.perf_counter()
    step_s = 0.0
    while pending or dec.rows:
        instrument_gguf(dec.draft.drafter)
        instrument_torch_draft(dec.draft.drafter)
        rows = []
        for s in pending:
            i = requests * s + (requests - left[s])
            left[s] -= 1
            rid = next(ids)
            seed = int(RowStreams.from_seed(i, 1).seeds[0])
            rows.append(dec.make_row(rid, prompts[i % len(prompts)], params, seed,
                                     max_new_tokens=max_tokens, top_logprobs=0))
            stream_of[rid] = s
        pending = []
        t1 = time.perf_counter()
        dec.admit(rows)
        TIMES["admit (all)"] += time.perf_counter() - t1
        t1 = time.perf_counter()
        gained = dec.step()
        step_s += time.perf_counter() - t1
        steps += 1
        for row, new in gained:
            tokens += len(new)
            ks[len(new)] += 1
            if row.output.finish_reason is not None and left[stream_of[row.id]] > 0:
                pending.append(stream_of[row.id])
    wall = time.perf_counter() - t0
    return tokens, wall, steps, step_s, ks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--streams", default="1,4,16", help="loads, in order, on the same engines")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--k", default="auto")
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--only", default="", help="plain | spec: run one server only")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(a.threads)
    model = es.load(a.model)
    prompts = [model.encode(p, chat=True) for p in bench_prompts()]
    drafter = es.QuantizedDraft(a.bits, backend=a.backend)
    k = a.k if a.k == "auto" else int(a.k)
    torch.set_grad_enabled(False)
    servers = [("plain", None, 0), ("spec", drafter, k)]
    if a.only:
        servers = [s for s in servers if s[0] == a.only]
    decs = {name: decoder(model, d, kk) for name, d, kk in servers}
    for name in decs:  # warm-up: first-call costs (the bench-serve's one 4-token request)
        run(decs[name], prompts, 1, 1, 4, a.temperature)
    for _ in range(a.rounds):
        for c in [int(x) for x in a.streams.split(",")]:
            for name, d, _ in servers:
                TIMES.clear()
                COUNTS.clear()
                tokens, wall, steps, step_s, ks = run(decs[name], prompts, c, a.requests,
                                                      a.max_tokens, a.temperature)
                pol = decs[name].policy
                print(f"== {c} streams, {name} ({getattr(d, 'backend', '')}): {tokens} tokens "
                      f"in {wall:.2f} s = {tokens / wall:.1f} tok/s, {steps} steps, step() "
                      f"{step_s:.2f} s, row-steps by tokens gained {sorted(ks.items())}; "
                      f"pool {[round(x) for x in pol.pool]}, draft cost "
                      f"{ {r: round(v * 1e3, 1) for r, v in pol.draft_cost.items()} } ms, "
                      f"catch-up {pol.catch_up_cost}", flush=True)
                for label, s in sorted(TIMES.items(), key=lambda kv: -kv[1]):
                    print(f"   {label:28s} {s:7.3f} s  ({COUNTS.get(label, 0)} calls)")
                for label, n in COUNTS.items():
                    if label not in TIMES:
                        print(f"   {label:28s} {n}")


if __name__ == "__main__":
    main()
