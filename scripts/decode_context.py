"""Decode speed against the context: plain greedy decoding after prompts of several lengths
(the bench's long document, cut), the target's seconds per step from GenerationStats.

    python scripts/decode_context.py --threads 2 --lengths 64,2048,4096 --tokens 48
    EXACTSPEC_KERNEL_ISA=avx512vnni python scripts/decode_context.py --dtype bfloat16

Prints, per prompt length, the prefill tok/s and the decode step in ms (target forward time
over steps, the second of two identical calls), and each step's ratio to the shortest prompt's.
"""

from __future__ import annotations

import argparse
import time

import torch

import exactspec as es
from exactspec.bench.harness import long_document


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", default="64,2048,4096", help="prompt lengths in tokens")
    p.add_argument("--tokens", type=int, default=48, help="new tokens per call")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = es.load(args.model, dtype=args.dtype)
    ids = model.encode(long_document())
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
