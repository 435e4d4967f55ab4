"""The matrix products of one decode step on our kernels, by weight format and rows.

    python -m exactspec.bench.products --threads 2 --rows 1,2,4,7,8
    python -m exactspec.bench.products --formats int4,int8 --rows 1 --threads 1

A step's products (every decoder layer's q/k/v, output, gate/up and down projections, then the
LM head) of a model's shapes (default smollm2-135m's: hidden 576, intermediate 1536, 9 heads of
64, 3 key/value heads, 30 layers, 49152 tokens), random weights, for each weight format
(float32, bfloat16, int8 as the int8 self-draft packs it, int4 as the int4 self-draft packs
it) and each row count: the median milliseconds of `--repeats` passes, the weight bytes over
that time, and the time over the one-row time (w). The weights of one format are read once a
pass, so a pass streams them from memory unless the CPU's last-level cache holds them all
(smollm2's int4 and int8 products fit some server caches: say so beside a figure).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from exactspec import kernels

FORMATS = ("float32", "bfloat16", "int8", "int4")


def shapes(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, layers: int,
           vocab: int) -> list[tuple[int, int]]:
    """(out, in) of every product of one step, in order."""
    qkv = (heads + 2 * kv_heads) * head_dim
    layer = [(qkv, hidden), (hidden, heads * head_dim), (2 * inter, hidden), (hidden, inter)]
    return layer * layers + [(vocab, hidden)]


def weights(fmt: str, out_f: int, in_f: int, gen: torch.Generator):
    """(product, bytes) of one random [out_f, in_f] matrix in `fmt`: product(x) -> y."""
    w = torch.randn(out_f, in_f, generator=gen) * 0.02
    if fmt in ("float32", "bfloat16"):
        w = w.to(torch.float32 if fmt == "float32" else torch.bfloat16)
        return (lambda x: kernels.linear(x, [w])), w.numel() * w.element_size()
    if fmt == "int8":
        q = torch.randint(-127, 128, (out_f, in_f), generator=gen, dtype=torch.int8)
        packed, s = kernels.pack_int8(q), torch.rand(out_f, generator=gen) * 1e-3
        return (lambda x: kernels.linear_w8a16(x, packed, s)), packed.numel() + 4 * out_f
    g = -(-in_f // 32)
    q = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    d = (torch.rand(out_f, g, generator=gen) * 1e-3).to(torch.bfloat16)
    m = (-torch.rand(out_f, g, generator=gen) * 1e-2).to(torch.bfloat16)
    packed, s = kernels.pack_int4(q, d, m), torch.ones(out_f)
    return (lambda x: kernels.linear_w4a8(x, packed, s)), packed.numel() + 4 * out_f


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rows", default="1,2,4,7,8", help="rows of x per product")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"among {','.join(FORMATS)}")
    p.add_argument("--repeats", type=int, default=7, help="passes per measurement (median)")
    p.add_argument("--shape", default="576,1536,9,3,64,30,49152",
                   help="hidden,intermediate,heads,kv_heads,head_dim,layers,vocab")
    a = p.parse_args(argv)
    fmts = [f for f in a.formats.split(",") if f]
    bad = [f for f in fmts if f not in FORMATS]
    if bad:
        p.error(f"--formats: {bad} not among {list(FORMATS)}")
    try:
        rows = [int(r) for r in a.rows.split(",")]
        dims = [int(v) for v in a.shape.split(",")]
    except ValueError:
        p.error("--rows and --shape take comma-separated integers")
    if len(dims) != 7 or min(dims) < 1 or min(rows) < 1:
        p.error("--shape takes 7 positive integers and --rows positive counts")
    if not kernels.enabled():
        raise SystemExit("the exactspec kernels are not built here: python -m exactspec.kernels")
    if a.threads:
        torch.set_num_threads(a.threads)
    plan = shapes(*dims)
    gen = torch.Generator().manual_seed(0)
    print(f"{len(plan)} products of shape {a.shape}, {torch.get_num_threads()} threads, ISA "
          f"{kernels.current_isa()}")
    for fmt in fmts:
        mats = [weights(fmt, o, i, gen) for o, i in plan]
        total = sum(b for _, b in mats)
        one = None
        for m in rows:
            xs = {i: torch.randn(m, i, generator=gen) for i in {i for _, i in plan}}
            passes = []
            for _ in range(a.repeats + 1):
                start = time.perf_counter()
                for (fn, _), (_, i) in zip(mats, plan, strict=True):
                    fn(xs[i])
                passes.append(time.perf_counter() - start)
            t = statistics.median(passes[1:])  # the first pass warms up
            one = one or t
            print(f"{fmt:9s} rows {m:3d}: {1e3 * t:7.2f} ms  {total / t / 1e9:5.1f} GB/s of "
                  f"{total / 1e6:.0f} MB  w {t / one:.2f}", flush=True)


if __name__ == "__main__":
    main()
