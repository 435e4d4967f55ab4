"""One decoder matrix shape's products on weights that come from memory: 30 copies of an
N x K matrix (more bytes than the L3 holds, and a 100 MB buffer written between rounds), each
multiplied in turn against 1, 2, 4, 5 and 8 rows of x, medians of 8 rounds: what a verify
width costs a product when the weights stream, per unit (the forward's other operations left
out; scripts/forward_widths.py has the whole forward).

    python scripts/cold_products.py --units avx2 --shape 576x1536
    python scripts/cold_products.py --units avx2,avx512vnni --shape 3072x576 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from exactspec import kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--units", default="avx2", help="units to run, comma-separated")
    p.add_argument("--shape", default="576x1536", help="N x K of each matrix (down_proj's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--rows", default="1,2,4,5,8")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if not kernels.enabled():
        raise SystemExit("the kernels are not built here: `python -m exactspec.kernels`")
    torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.split("x"))
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    mats = [(torch.randn(n, k, generator=g) * 0.02).to(dtype) for _ in range(30)]
    flush = torch.empty(100_000_000, dtype=torch.uint8)
    for unit in args.units.split(","):
        kernels.set_isa(unit)
        out = []
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            times = []
            for _ in range(10):
                flush.add_(1)  # the weights out of the caches
                t0 = time.perf_counter()
                for w in mats:
                    kernels.linear(x, [w])
                times.append(time.perf_counter() - t0)
            out.append((rows, 1e3 * statistics.median(times[2:])))
        one = out[0][1]
        print(f"{unit} {args.dtype} 30 x {args.shape}: " + ", ".join(
            f"{r} rows {t:.2f} ms ({t / one:.2f})" for r, t in out))
    kernels.set_isa("auto")


if __name__ == "__main__":
    main()
