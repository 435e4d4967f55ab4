"""What a verify forward costs: target forward time against the number of tokens fed (not a test).

Speculative decoding's analytic bound assumes a forward over K+1 tokens costs the same as one
over 1 token. This measures the real ratio w(K+1) = t(K+1) / t(1) for exactspec's forward and
transformers' own forward on the same model object, at batch 1 and 8, and profiles one step
at width 1 and width K+1 to show where the time goes (matrix products against the rest).

    python -m exactspec.bench.width_cost --threads 2
    python -m exactspec.bench.width_cost --widths 1 2 3 5 9 --batch 1 8 --context 300
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from exactspec.models.adapter import TargetAdapter


def time_widths(adapter: TargetAdapter, widths: list[int], batch: int, context: int,
                repeats: int) -> dict[int, float]:
    """Median ms of `adapter.extend` over `w` new tokens per row after `context` cached ones."""
    gen = torch.Generator().manual_seed(0)
    vocab = adapter.vocab_size
    prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
    adapter.prefill([prompt] * batch, capacity=context + max(widths) + 1)
    out = {}
    for w in widths:
        tokens = torch.randint(0, vocab, (batch, w), generator=gen).to(adapter.device)
        adapter.extend(tokens)  # warm-up; nothing is committed, the cache stays at `context`
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            adapter.extend(tokens)
            if adapter.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[w] = 1000 * statistics.median(times)
    return out


def profile_step(adapter: TargetAdapter, width: int, context: int,
                 ops: tuple[str, ...] | None = None) -> tuple[float, float]:
    """(total ms, share of it in `ops`, default MATMUL_OPS) of one forward of `width` tokens,
    profiled."""
    from torch.profiler import ProfilerActivity, profile

    prompt = [i % adapter.vocab_size for i in range(context)]
    adapter.prefill([prompt], capacity=context + width + 1)
    tokens = (torch.arange(width, device=adapter.device)[None] * 7) % adapter.vocab_size
    adapter.extend(tokens)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        adapter.extend(tokens)
    return matmul_share(prof.key_averages(), MATMUL_OPS if ops is None else ops)


# the profiler's matrix-product keys: torch's, and our kernels' linear (exactspec/kernels/)
MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "exactspec::linear")
# our kernels' decoder layers in one call: every layer's products, norms and attention inside
LAYER_OPS = ("exactspec::decoder_stack",)


def matmul_share(events, ops: tuple[str, ...] = MATMUL_OPS) -> tuple[float, float]:
    """(total ms, share in `ops`) of profiler events (`key`, `self_cpu_time_total` in us)."""
    total = sum(e.self_cpu_time_total for e in events)
    mm = sum(e.self_cpu_time_total for e in events if e.key in ops)
    return total / 1000, mm / max(total, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 9, 12, 16])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=300, help="cached tokens before the step")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--profile-width", type=int, default=5, help="profile width 1 and this")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from exactspec.models.loading import load

    model = load(a.model, device="cuda" if torch.cuda.is_available() else None)
    engines = {"exactspec": TargetAdapter(model),
               "transformers": TargetAdapter(model, lean=False)}
    print(f"{a.model}, torch threads={torch.get_num_threads()}, {a.context} cached tokens; "
          f"ms per forward (median of {a.repeats}) and w = t(width) / t(1)")
    print("| engine | batch | " + " | ".join(f"w={w}" for w in a.widths) + " |")
    print("|---|---|" + "---|" * len(a.widths))
    for b in a.batch:
        for name, adapter in engines.items():
            ms = time_widths(adapter, a.widths, b, a.context, a.repeats)
            base = ms[a.widths[0]] if a.widths[0] == 1 else float("nan")
            cells = " | ".join(f"{ms[w]:.1f} ({ms[w] / base:.2f})" for w in a.widths)
            print(f"| {name} | {b} | {cells} |", flush=True)
    if not torch.cuda.is_available():
        for w in (1, a.profile_width):
            total, share = profile_step(engines["exactspec"], w, a.context)
            _, layers = profile_step(engines["exactspec"], w, a.context, LAYER_OPS)
            print(f"profiled exactspec forward, width {w}: {total:.1f} ms of operator time, "
                  f"{100 * share:.0f}% in matrix products ({' / '.join(MATMUL_OPS)}), "
                  f"{100 * layers:.0f}% in {LAYER_OPS[0]} (the decoder layers in one call, "
                  "their products inside)")


if __name__ == "__main__":
    main()
