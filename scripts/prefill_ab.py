"""Prefill on our kernels against torch's own operators (`EXACTSPEC_KERNELS=0`) in one process:
the model loaded twice, one prompt of N tokens (the bench's long document, cut) prefilled on
each in turn, 6 rounds (the first dropped), medians in tok/s and their ratio.

    python scripts/prefill_ab.py --tokens 1025
    python scripts/prefill_ab.py --tokens 441 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import exactspec as es
from exactspec.bench.harness import long_document
from exactspec.models.adapter import TargetAdapter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1025)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    models = {}
    for name, flag in (("ours", "1"), ("torch", "0")):  # the lean forward picks at load
        os.environ["EXACTSPEC_KERNELS"] = flag
        models[name] = es.load(a.model, dtype=a.dtype)
    ids = models["ours"].encode(long_document())[:a.tokens]
    if len(ids) < a.tokens:
        raise SystemExit(f"the long document has {len(ids)} tokens, fewer than --tokens")
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    for r in range(a.rounds):
        for name, model in models.items():
            os.environ["EXACTSPEC_KERNELS"] = "1" if name == "ours" else "0"
            adapter = TargetAdapter(model.model)
            t0 = time.perf_counter()
            adapter.prefill([ids], capacity=len(ids) + 8)
            if r:
                times[name].append(time.perf_counter() - t0)
    os.environ.pop("EXACTSPEC_KERNELS", None)
    ours, theirs = (statistics.median(times[n]) for n in ("ours", "torch"))
    n = len(ids)
    print(f"{a.dtype} prefill of {n} tokens, {a.threads} threads: ours {n / ours:.0f} tok/s, "
          f"torch's operators {n / theirs:.0f} tok/s, ours / theirs {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
