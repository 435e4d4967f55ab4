"""What a target forward costs against its width: one sequence after a prompt, forwards of 1, 7
and 8 tokens (a decode step, the verifies of K = 6 and 7), the median of each, and w = its time
over one token's. `--ab` interleaves the rows stack (csrc/ops_layer.cpp's rows_stack, the
default) with the operator path (EXACTSPEC_ROWS_STACK=0) in this process.

    python scripts/forward_widths.py --dtype bfloat16 --threads 2 --ab
    python scripts/forward_widths.py --dtype float32 --context 1000
    python scripts/forward_widths.py --alternate --widths 1,8 --forwards 40
    python scripts/forward_widths.py --alternate --widths 1,8 --units avx512bf16,avx512vnni
    python scripts/forward_widths.py --alternate --widths 1,8 --random-llama 2048,16,8192,32,8

Rough figures for decisions only when other processes share the cores; `--alternate` (one
sequence, the widths' forwards taking turns, minima and medians) keeps a busy host's slow
spells from landing on one width only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import exactspec as es
from exactspec import kernels
from exactspec.models.adapter import TargetAdapter
from exactspec.models.loading import Model


def prefilled(model, context: int, capacity: int) -> TargetAdapter:
    """A sequence of `context` prompt tokens, prefilled, with room for `capacity` slots."""
    adapter = TargetAdapter(model.model if isinstance(model, Model) else model)
    adapter.prefill([list(range(100, 100 + context))], capacity=capacity)
    return adapter


def line(name: str, ms: dict[int, float], widths: list[int]) -> str:
    """One printed row: each width's ms and its w against the first width's."""
    return f"{name:22s} " + ", ".join(
        f"{w} rows {ms[w]:.2f} ms (w {ms[w] / ms[widths[0]]:.2f})" for w in widths)


def forward_ms(model, width: int, context: int, n: int) -> float:
    """Median ms of `n` forwards of `width` tokens after a `context`-token prompt."""
    adapter = prefilled(model, context, context + n + 16)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        adapter.extend(torch.randint(100, 5000, (1, width)))
        times.append(time.perf_counter() - t0)
        adapter.commit(torch.tensor([1]))
    return 1e3 * statistics.median(times)


def alternate_ms(model, widths: list[int], context: int, n: int,
                 units: list[str] | None = None) -> tuple[dict, dict]:
    """Minimum and median ms of `n` forwards of each width after a `context`-token prompt, the
    widths (and the kernel units, `units`) taking turns on one sequence (each forward commits
    one token); keyed by (unit, width), the unit None without `units`."""
    adapter = prefilled(model, context, context + n * len(widths) * len(units or [0])
                        + max(widths) + 16)
    keys = [(u, w) for u in (units or [None]) for w in widths]
    times: dict = {key: [] for key in keys}
    for _ in range(n):
        for unit, w in keys:
            if unit:
                kernels.set_isa(unit)
            t0 = time.perf_counter()
            adapter.extend(torch.randint(100, 5000, (1, w)))
            times[(unit, w)].append(time.perf_counter() - t0)
            adapter.commit(torch.tensor([1]))
    if units:
        kernels.set_isa("auto")
    return ({k: 1e3 * min(t) for k, t in times.items()},
            {k: 1e3 * statistics.median(t) for k, t in times.items()})


def random_llama(shape: str, dtype: str):
    """A LlamaForCausalLM of random weights (seeded) of `shape` "H,L,I,HEADS,KV"."""
    from transformers import LlamaConfig, LlamaForCausalLM

    try:
        h, layers, inter, heads, kv = (int(v) for v in shape.split(","))
    except ValueError:
        raise SystemExit(f"--random-llama {shape!r}: give H,L,I,HEADS,KV, e.g. "
                         "2048,16,8192,32,8") from None
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, intermediate_size=inter,
                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=49152,
                      max_position_embeddings=8192, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--random-llama", metavar="H,L,I,HEADS,KV", default=None,
                    help="instead of --model, a Llama of random weights of that hidden size, "
                         "layers, MLP size and heads (e.g. 2048,16,8192,32,8: Llama 3.2 1B's "
                         "body), smollm2's vocabulary")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--kv-cache", choices=("float32", "bfloat16"), default="float32",
                    help="the target's KV cache (es.load's kv_cache)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=300, help="prompt tokens before the forwards")
    ap.add_argument("--forwards", type=int, default=30, help="forwards per width")
    ap.add_argument("--widths", default="1,7,8")
    ap.add_argument("--ab", action="store_true",
                    help="the operator path too (EXACTSPEC_ROWS_STACK=0), interleaved, twice")
    ap.add_argument("--alternate", action="store_true",
                    help="the widths take turns on one sequence; minima and medians")
    ap.add_argument("--units", default=None,
                    help="with --alternate: kernel units that take turns too, e.g. "
                         "avx512bf16,avx512vnni (a ratio between units within one run)")
    a = ap.parse_args()
    if a.alternate and a.ab:
        raise SystemExit("--alternate and --ab: choose one")
    torch.set_num_threads(a.threads)
    model = (random_llama(a.random_llama, a.dtype) if a.random_llama
             else es.load(a.model, dtype=a.dtype, kv_cache=a.kv_cache))
    widths = [int(w) for w in a.widths.split(",")]
    if a.units and not a.alternate:
        raise SystemExit("--units needs --alternate")
    if a.alternate:
        units = a.units.split(",") if a.units else None
        lo, mid = alternate_ms(model, widths, a.context, a.forwards, units)
        for unit in units or [None]:
            for name, ms in (("minimum", lo), ("median", mid)):
                print(line(f"{name} {unit or ''}", {w: ms[(unit, w)] for w in widths}, widths))
        return
    flags = ("1", "0") if a.ab else ("1",)
    for _ in range(2 if a.ab else 1):
        for flag in flags:
            os.environ["EXACTSPEC_ROWS_STACK"] = flag
            ms = {w: forward_ms(model, w, a.context, a.forwards) for w in widths}
            print(line("rows stack" if flag == "1" else "operator path", ms, widths))
    os.environ.pop("EXACTSPEC_ROWS_STACK", None)


if __name__ == "__main__":
    main()
