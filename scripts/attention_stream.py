"""How fast attention reads a long context: one decode query group (9 query heads over 3 key /
value heads, smollm2-135m's shape) against the float32 keys and values of 30 layers, after an
800 MB buffer has pushed them out of the caches, as a decode step after that many tokens meets
them; beside it torch's own sum over the same bytes (a plain read). The best of 8 passes.

    python scripts/attention_stream.py --threads 2 --keys 2048
    python scripts/attention_stream.py --threads 1 --keys 2048
    python scripts/attention_stream.py --threads 2 --keys 2048 --positions 8   # a verify of K = 7
    python scripts/attention_stream.py --keys 2048 --positions 8 --layers 1 --warm  # arithmetic

Prints each one's ms for the 30 layers and the GB/s of keys and values it read; with
`--positions P` (a verify's P new tokens, causal among themselves) also attention's GFLOP/s.
`--warm` leaves the keys and values in the caches between passes (the best of 200): with
`--layers 1` (3 MB at 2048 keys) the arithmetic's rate instead of memory's.
"""

from __future__ import annotations

import argparse
import time

import torch

from exactspec import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keys", type=int, default=2048, help="tokens of context")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--positions", type=int, default=1,
                    help="query positions, the last of the keys (a verify: K + 1)")
    ap.add_argument("--warm", action="store_true",
                    help="no eviction between passes (best of 200): the arithmetic's rate")
    a = ap.parse_args()
    if not kernels.enabled():
        raise SystemExit("the exactspec kernels are not built here: python -m exactspec.kernels")
    if not 1 <= a.positions <= a.keys:
        raise SystemExit(f"--positions {a.positions}: give 1 to --keys ({a.keys})")
    torch.set_num_threads(a.threads)
    kv, d = 3, 64
    ks = [torch.randn(1, kv, a.keys, d) for _ in range(a.layers)]
    vs = [torch.randn(1, kv, a.keys, d) for _ in range(a.layers)]
    p = a.positions
    q = torch.randn(1, p, 9, d)
    # position t sees the keys up to its own (the last p keys are the positions')
    mask = None if p == 1 else (torch.arange(a.keys)[None, :]
                                <= torch.arange(a.keys - p, a.keys)[:, None])[None]
    seen = a.keys if mask is None else int(mask.sum())  # (query position, key) pairs
    flops = 4 * a.layers * 9 * d * seen
    junk = None if a.warm else torch.ones(200_000_000)
    gb = 2 * a.layers * kv * a.keys * d * 4 / 1e9
    layers = list(zip(ks, vs, strict=True))
    runs = {
        "attention": lambda: [kernels.attention(q, k, v, mask, d ** -0.5) for k, v in layers],
        "torch sum": lambda: [k.sum() + v.sum() for k, v in layers],
    }
    for name, fn in runs.items():
        best = float("inf")
        for _ in range(200 if a.warm else 8):
            if not a.warm:
                junk.add_(1.0)  # the keys and values out of the caches
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        print(f"{name:10s} {a.keys} keys x {a.layers} layers, {a.threads} threads: "
              f"{best * 1e3:.2f} ms, {gb / best:.1f} GB/s"
              + (f", {flops / best / 1e9:.1f} GFLOP/s" if name == "attention" else ""))


if __name__ == "__main__":
    main()
