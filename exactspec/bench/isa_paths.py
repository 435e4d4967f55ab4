"""`python -m exactspec.bench.isa_paths`: time a decode step on every instruction-set path this
CPU offers and name any path far off the fastest.

Every FMA path computes the same bits (the amx and avx512bf16 paths: other bits for bf16
weights, the same for the float32 model timed here); their speeds should not differ by much on
one CPU (a path 50% slower than the fastest is a defect to look at: a register tile that
spills, a missing prefetch). The step is a one-token forward of a random Llama (smollm2-135m's
widths by default: hidden 576, MLP 1536, 9 / 3 heads, vocabulary 49152; `layers` of them) after
a `context`-token prompt, on our kernels, at torch's thread count; the median of `repeats`. It
reports; it asserts nothing about speed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

FAR_OFF = 1.5  # a path slower than this times the fastest is named
WARM_UP, WARM_UP_S = 3, 0.3  # untimed steps a path: at least this many, and seconds


@dataclass
class PathTime:
    """One instruction-set path's step."""

    isa: str  # "amx", "avx512bf16", "avx512vnni", "avx512", "avx2", "portable"
    ms: float  # median milliseconds of a one-token step
    ratio: float  # over the fastest path's


def _model(hidden: int, layers: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 192), max_position_embeddings=4096,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def time_paths(*, hidden: int = 576, layers: int = 30, vocab: int = 49152, context: int = 64,
               repeats: int = 9) -> list[PathTime]:
    """The one-token step's median time on each path (module docstring)."""
    from exactspec import kernels

    if not kernels.enabled():
        raise RuntimeError("the exactspec kernels are not built here: `python -m "
                           "exactspec.kernels` builds them")
    model = _model(hidden, layers, vocab)
    prompt = [(7 * i + 1) % vocab for i in range(context)]
    token = torch.tensor([[3]])
    before = kernels.current_isa()
    with torch.inference_mode():  # the model built outside it (the lean forward reads versions)
        try:
            ms = _time_each(model, prompt, token, context, repeats)
        finally:
            kernels.set_isa(before)
    fastest = min(ms.values())
    return [PathTime(isa, t, t / fastest) for isa, t in ms.items()]


def _time_each(model, prompt: list[int], token: torch.Tensor, context: int,
               repeats: int) -> dict[str, float]:
    from exactspec import kernels
    from exactspec.models.adapter import TargetAdapter

    ms = {}
    for isa in kernels.available_isas():
        kernels.set_isa(isa)
        adapter = TargetAdapter(model)
        adapter.prefill([prompt], capacity=context + 2)
        # untimed steps first, at least WARM_UP of them and WARM_UP_S seconds (threads.py tries
        # its thread counts in the first; a short model's first path ran 1.3x slow without)
        start, n = time.perf_counter(), 0
        while n < WARM_UP or time.perf_counter() - start < WARM_UP_S:
            adapter.extend(token)
            n += 1
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            adapter.extend(token)
            times.append(time.perf_counter() - t0)
        ms[isa] = 1e3 * statistics.median(times)
    return ms


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m exactspec.bench.isa_paths", description=__doc__.split("\n\n")[0],
        epilog="Example: python -m exactspec.bench.isa_paths --threads 2 --layers 30")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: "
                        "torch's choice)")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (default 30)")
    parser.add_argument("--repeats", type=int, default=9, help="timed steps per path (median)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"one-token step, {torch.get_num_threads()} threads, {args.layers} layers of hidden "
          f"576, vocabulary 49152:")
    print(report(time_paths(layers=args.layers, repeats=args.repeats)))
    return 0


def report(paths: list[PathTime]) -> str:
    """One line per path, then the verdict."""
    lines = [f"{p.isa:<11} {p.ms:8.2f} ms  {p.ratio:5.2f}x the fastest" for p in paths]
    far = [p.isa for p in paths if p.ratio > FAR_OFF]
    lines.append(f"far off (over {FAR_OFF}x the fastest): {', '.join(far)}" if far else
                 f"every path within {FAR_OFF}x of the fastest")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
