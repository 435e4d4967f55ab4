"""One matrix product on our kernels against its width, on each instruction-set unit: the time of
`kernels.linear` at a few row counts (1 row: a decode step; 7-8: a verify; 1024: a prefill),
its GFLOP/s and each width's time over one row's (w), for float32 and bf16 weights. The
matrices repeat in a loop, so they are read from the caches (this Xeon's L3 holds 480 MiB):
the arithmetic's side of a forward, not its bytes' (scripts/forward_widths.py has both).

    python scripts/product_widths.py --threads 1 --units amx,avx512vnni,avx2
    python scripts/product_widths.py --rows 1024 --shapes 1536x576,576x1536 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch

from exactspec import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--units", default="", help="units to run (default: every one this CPU has)")
    ap.add_argument("--rows", default="1,7,8", help="row counts of x")
    ap.add_argument("--shapes", default="1536x576,24576x576,3072x576", help="N x K of W")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    a = ap.parse_args()
    if not kernels.enabled():
        raise SystemExit("the exactspec kernels are not built here: python -m exactspec.kernels")
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    units = a.units.split(",") if a.units else kernels.available_isas()
    rows = [int(r) for r in a.rows.split(",")]
    for unit in units:
        kernels.set_isa(unit)
        for name in a.dtypes.split(","):
            for shape in a.shapes.split(","):
                n, k = (int(v) for v in shape.split("x"))
                w = torch.randn(n, k).to(getattr(torch, name))
                out = []
                for m in rows:
                    x = torch.randn(m, k)
                    for _ in range(3):
                        kernels.linear(x, [w])
                    reps = max(5, int(2e9 / (2 * m * n * k) / 20))
                    t = time.perf_counter()
                    for _ in range(reps):
                        kernels.linear(x, [w])
                    out.append((m, (time.perf_counter() - t) / reps))
                print(f"{unit:10s} {name:8s} {n}x{k}: " + ", ".join(
                    f"{m} rows {s * 1e6:.0f} us ({2 * m * n * k / s / 1e9:.0f} GFLOP/s, "
                    f"w {s / out[0][1]:.2f})" for m, s in out), flush=True)
    kernels.set_isa("auto")


if __name__ == "__main__":
    main()
