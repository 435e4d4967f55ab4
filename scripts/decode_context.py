"""Decode speed against the context: plain greedy decoding after prompts of several lengths
(the bench's long document, cut), the target's seconds per step from GenerationStats.

    python scripts/decode_context.py --threads 2 --lengths 64,2048,4096 --tokens 48
    python scripts/decode_context.py --lengths 64,2048 --alternate --tokens 60
    EXACTSPEC_KERNEL_ISA=avx512vnni python scripts/decode_context.py --dtype bfloat16
    python scripts/decode_context.py --lengths 64,2048 --alternate --kv-cache bfloat16

Prints, per prompt length, the prefill tok/s and the decode step in ms (target forward time
over steps, the second of two identical calls), and each step's ratio to the shortest prompt's.
`--alternate` instead prefills one sequence per length and has their one-token forwards take
turns (minima and medians): a busy host's slow spells then fall on every length alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import exactspec as es
from exactspec.bench.harness import long_document
from exactspec.models.adapter import TargetAdapter


def alternate(model, ids: list[int], lengths: list[int], tokens: int) -> None:
    """One sequence per prompt length, their one-token forwards taking turns `tokens` times."""
    adapters = {}
    for n in lengths:
        adapters[n] = TargetAdapter(model.model if hasattr(model, "model") else model)
        adapters[n].prefill([ids[:n]], capacity=n + tokens + 16)
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(tokens):
        for n in lengths:
            t0 = time.perf_counter()
            adapters[n].extend(torch.tensor([[ids[n % len(ids)]]]))
            times[n].append(time.perf_counter() - t0)
            adapters[n].commit(torch.tensor([1]))
    for name, pick in (("minimum", min), ("median", statistics.median)):
        base = pick(times[lengths[0]])
        print(f"{name:8s} " + ", ".join(
            f"{n} tokens {1e3 * pick(times[n]):.1f} ms ({base / pick(times[n]):.2f}x)"
            for n in lengths))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", default="64,2048,4096", help="prompt lengths in tokens")
    p.add_argument("--tokens", type=int, default=48, help="new tokens per call")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--kv-cache", choices=("float32", "bfloat16"), default="float32",
                   help="the target's KV cache (es.load's kv_cache)")
    p.add_argument("--alternate", action="store_true",
                   help="one sequence per length, their forwards taking turns (ratios in one run)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = es.load(args.model, dtype=args.dtype, kv_cache=args.kv_cache)
    ids = model.encode(long_document())
    if args.alternate:
        lengths = [int(n) for n in args.lengths.split(",")]
        if max(lengths) > len(ids):
            raise SystemExit(f"--lengths {max(lengths)}: the document has {len(ids)} tokens")
        alternate(model, ids, lengths, args.tokens)
        return
    greedy = es.SamplingParams(temperature=0)
    first = None
    for n in map(int, args.lengths.split(",")):
        if n > len(ids):
            raise SystemExit(f"--lengths {n}: the document has {len(ids)} tokens")
        es.generate(model, [ids[:n]], max_new_tokens=args.tokens, params=greedy)  # warm
        start = time.perf_counter()
        stats = es.generate(model, [ids[:n]], max_new_tokens=args.tokens, params=greedy)[0].stats
        wall = time.perf_counter() - start
        step = stats.target_seconds / stats.steps
        first = first or step
        print(f"prompt {n:5d} tokens: prefill {n / stats.prefill_seconds:6.0f} tok/s, decode step "
              f"{1e3 * step:5.1f} ms ({first / step:.2f}x the {args.lengths.split(',')[0]}-token "
              f"speed), call {wall:.2f} s")


if __name__ == "__main__":
    main()
