"""Time `verify` per method on a batch shaped like real decoding (not a test).

    python -m exactspec.bench.verify_speed --batch 64 --draft 8 --vocab 49152
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from exactspec.sampling import RowStreams, probs_from_logits, verify
from exactspec.sampling.params import SamplingParams


def time_verify(batch: int, draft: int, vocab: int, repeats: int = 20) -> dict[str, float]:
    """Median ms of one verify call per method, with and without the O(B K V) input check."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams()
    p = probs_from_logits(torch.randn(batch, draft + 1, vocab, generator=gen), params)
    q = probs_from_logits(torch.randn(batch, draft, vocab, generator=gen), params)
    x = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, draft)
    out = {}
    for method in ("token", "block", "greedy"):
        for check in (True, False):
            streams = RowStreams.from_seed(0, batch)
            verify(p, x, q, method=method, generator=streams, check=check)  # warm-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                verify(p, x, q, method=method, generator=streams, check=check)
                times.append(time.perf_counter() - start)
            out[f"{method} (check={check})"] = 1000 * statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--draft", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    res = time_verify(a.batch, a.draft, a.vocab, a.repeats)
    print(f"verify B={a.batch} K={a.draft} V={a.vocab}, torch threads={torch.get_num_threads()}")
    for method, ms in res.items():
        print(f"  {method:20s} {ms:8.2f} ms (median of {a.repeats})")


if __name__ == "__main__":
    main()
