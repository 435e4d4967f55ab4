"""How long the int4 self-draft's quantization of a target's decoder layers takes: the native
call (`kernels.int4_quantize`, csrc/ops_quant.cpp) against the same arithmetic on torch's
operators (`quantize_int4_kernel` with the kernels off), each the best of `--repeat`, and
whether the two give the same q, d and m (they should, bit for bit).

    python scripts/int4_quantize_time.py
    python scripts/int4_quantize_time.py --model gemma3-270m --threads 1
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import exactspec as es
from exactspec import kernels
from exactspec.models.quantize import quantize_int4_kernel


def layer_weights(model) -> list[torch.Tensor]:
    """The matrices the lean forward quantizes, as it fuses them (qkv, o, gate_up, down)."""
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        out += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
                torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight]
    return [w.detach().float() for w in out]


def timed(weights: list[torch.Tensor], repeat: int) -> tuple[float, list[tuple]]:
    best, results = float("inf"), []
    for _ in range(repeat):
        t0 = time.perf_counter()
        results = [quantize_int4_kernel(w, 32, "search") for w in weights]
        best = min(best, time.perf_counter() - t0)
    return best, results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.enabled():
        raise SystemExit("the kernels are not built here: `python -m exactspec.kernels`")
    weights = layer_weights(es.load(args.model).model)
    n = sum(w.numel() for w in weights)
    native, a = timed(weights, args.repeat)
    os.environ["EXACTSPEC_KERNELS"] = "0"
    try:
        on_torch, b = timed(weights, args.repeat)
    finally:
        del os.environ["EXACTSPEC_KERNELS"]
    same = all(torch.equal(x, y) for ra, rb in zip(a, b, strict=True)
               for x, y in zip(ra, rb, strict=True))
    threads = f"{args.threads} thread" + ("s" if args.threads > 1 else "")
    print(f"{args.model}: {n / 1e6:.1f}M layer weights, {threads}: native "
          f"{native:.2f} s, torch's operators {on_torch:.2f} s ({on_torch / native:.1f}x); "
          f"the same q, d and m: {same}")


if __name__ == "__main__":
    main()
