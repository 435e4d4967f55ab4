#!/usr/bin/env python
"""Device check: one-token step time against memory bandwidth, w(1..17) and exactness on a GPU.

Runs with the machine's own torch and transformers and no install of exactspec: it puts this
checkout on sys.path and imports only `exactspec.sampling` (pure torch; `exactspec/__init__.py`
imports its names lazily, so nothing heavier is loaded; the JSON lists the exactspec modules
that were imported, and tests/test_device_check.py checks that list).

What it measures, on random-init Llama models (no downloads) in bfloat16:
- peak bandwidth: the fastest device-to-device copy of a large buffer (read + write bytes / s);
- plain one-token step: median time of a transformers forward of 1 token after `context`
  cached tokens; its bandwidth share = weight bytes / step time / peak bandwidth, where weight
  bytes = every nn.Linear weight (q, k, v, o, gate, up, down, the LM head, which is the tied
  embedding) in bytes: what one step must read; norms and the one embedding row are left out;
- the step's matrix products alone (every nn.Linear on one token, one CUDA graph on cuda):
  what the weight reads can reach without Python and launch gaps;
- w(N) for N = 1..17: a forward over N new tokens / a forward over 1, both after `context`
  cached tokens (each on a fresh prefill, which is not timed);
- p at a position scored alone vs inside a width-5 forward: how many logits are bit-equal;
- exactness: speculative sampling (a random draft model proposing K tokens, exactspec's
  `verify`) of the first L tokens after a prompt, N sequences, against the exact law of those
  L tokens computed from full target forwards; a chi-square test with false-alarm rate 1e-6
  (cells with expected count < 5 pooled), for the token and block rules, and the same test on a
  deliberately wrong variant (q passed to verify at another temperature than the one the draft
  tokens were drawn from: Hugging Face's bug), which must fail.

    python scripts/device_check.py                         # cuda, 135M and 1B, < 8 minutes
    python scripts/device_check.py --device cpu --small --threads 1 --out /tmp/dc  # tiny

Writes device_check.json and device_check.md to --out (default $OUT, else out/device_check).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
ALPHA = 1e-6  # false-alarm rate of every chi-square test

# random-init Llama configs: SmolLM2-135M's and Llama-3.2-1B's shapes, and two tiny ones
CONFIGS = {
    "llama-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                       tie_word_embeddings=True, max_position_embeddings=2048),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                     tie_word_embeddings=True, max_position_embeddings=4096),
    "tiny-a": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                   tie_word_embeddings=True, max_position_embeddings=512),
    "tiny-b": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                   num_attention_heads=6, num_key_value_heads=2, vocab_size=1024,
                   tie_word_embeddings=False, max_position_embeddings=512),
}
# the exactness models: a small vocabulary, so the law of L tokens has V^L cells
EXACT_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                    max_position_embeddings=64)


def load_sampling():
    """exactspec.sampling from this checkout (no install); see the module docstring."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import exactspec.sampling as sampling

    return sampling


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Wall seconds of fn(), the device synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def copy_bandwidth(device: torch.device, megabytes: int, repeats: int) -> float:
    """Bytes / s of the fastest copy of a `megabytes` buffer (read + write counted)."""
    src = torch.ones(megabytes << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(lambda: dst.copy_(src), device) for _ in range(repeats))
    return 2 * src.numel() / best


def build(name: str, dtype: torch.dtype, device: torch.device, seed: int,
          **overrides) -> nn.Module:
    """A random-init LlamaForCausalLM of CONFIGS[name] (or EXACT_CONFIG) on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(CONFIGS.get(name, EXACT_CONFIG))
    kwargs.update(overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    return model.to(dtype).eval()


def weight_bytes(model: nn.Module) -> int:
    """Bytes one decode step reads: every nn.Linear weight (the LM head included, tied or not)."""
    return sum(m.weight.numel() * m.weight.element_size()
               for m in model.modules() if isinstance(m, nn.Linear))


def _cache_kw(model: nn.Module) -> str:
    """The forward's cache argument: `cache` in transformers >= 5.2x, else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def forward(model: nn.Module, ids: torch.Tensor, cache=None):  # ids [B, T]
    """(logits [B, T, V], the cache after the call) with either transformers cache API."""
    kw = {} if cache is None else {_cache_kw(model): cache}
    out = model(input_ids=ids, use_cache=True, **kw)
    new = getattr(out, "cache", None)
    if new is None:
        new = getattr(out, "past_key_values", None)
    return out.logits, new


@torch.inference_mode()
def step_times(model: nn.Module, device: torch.device, context: int, widths: list[int],
               repeats: int, steps: int) -> dict:
    """Plain one-token step time (median over `steps` consecutive steps) and the median time
    of a forward over N tokens after `context` cached ones, each N on fresh prefills."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=gen).to(device)
    _, cache = forward(model, prompt)
    tok = prompt[:, -1:]
    times = []
    for i in range(steps + 3):  # 3 warm-up steps
        t = timed(lambda: forward(model, tok, cache), device)
        if i >= 3:
            times.append(t)
    out = {"step_s": statistics.median(times), "width_s": {}}
    for n in widths:
        extra = torch.randint(0, vocab, (1, n), generator=gen).to(device)
        ts = []
        for r in range(repeats + 1):
            _, cache = forward(model, prompt)
            t = timed(lambda e=extra, c=cache: forward(model, e, c), device)
            if r:  # the first is a warm-up for this shape
                ts.append(t)
        out["width_s"][n] = statistics.median(ts)
    out["w"] = {n: s / out["width_s"][1] for n, s in out["width_s"].items()}
    return out


@torch.inference_mode()
def matmul_floor(model: nn.Module, device: torch.device, repeats: int) -> float:
    """Median seconds of a step's matrix products alone: every nn.Linear applied to one
    token's activation, in order; on cuda captured in one CUDA graph (no Python, no launch
    gaps), so weight bytes / this time is what the step's weight reads can reach here."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    xs = [torch.randn(1, m.in_features, dtype=m.weight.dtype, device=device) for m in linears]

    def body() -> None:
        for m, x in zip(linears, xs, strict=True):
            torch.nn.functional.linear(x, m.weight)

    fn = body
    if device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch asks
            body()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        fn = graph.replay
    fn()
    return statistics.median(timed(fn, device) for _ in range(repeats))


@torch.inference_mode()
def position_invariance(model: nn.Module, device: torch.device, context: int, n: int) -> dict:
    """Logits of n tokens scored one step at a time vs in one width-n forward: how many of
    the n * V values are bit-equal, and the largest difference."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (1, context), generator=gen).to(device)
    extra = torch.randint(0, vocab, (1, n), generator=gen).to(device)
    _, cache = forward(model, prompt)
    one = torch.cat([forward(model, extra[:, i:i + 1], cache)[0] for i in range(n)], 1)
    _, cache = forward(model, prompt)
    wide, _ = forward(model, extra, cache)  # [1, n, V]
    equal = (one == wide).sum().item()
    return {"positions": n, "values": n * vocab, "bit_equal": int(equal),
            "max_abs_diff": (one.float() - wide.float()).abs().max().item()}


# --- exactness ------------------------------------------------------------------------------

def exact_law(target: nn.Module, prompt: list[int], length: int, params, sampling,
              device: torch.device) -> torch.Tensor:
    """P(x_1..x_L | prompt) for every sequence, from full target forwards: [V^L] float64."""
    vocab = target.config.vocab_size
    prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=length - 1)),
                            dtype=torch.long).reshape(-1, length - 1)  # [R, L-1], R = V^(L-1)
    rows = prefixes.shape[0]
    ids = torch.cat([torch.tensor(prompt).expand(rows, -1), prefixes], 1)
    with torch.inference_mode():
        logits = target(input_ids=ids.to(device)).logits[:, len(prompt) - 1:]  # [R, L, V]
    probs = sampling.probs_from_logits(logits.float(), params).double().cpu()  # [R, L, V]
    # P(seq) = prod_t p(x_t | prompt, x_<t); row r holds prefix r = (x_1, ..., x_{L-1})
    seq_prob = torch.ones(rows, dtype=torch.float64)
    for t in range(length - 1):
        seq_prob = seq_prob * probs[torch.arange(rows), t, prefixes[:, t]]
    law = seq_prob[:, None] * probs[:, length - 1]  # [R, V]: (prefix, last token)
    return law.reshape(-1)


@torch.inference_mode()
def speculative_samples(target: nn.Module, draft: nn.Module, prompt: list[int], length: int,
                        k: int, n: int, params, sampling, device: torch.device, seed: int,
                        method: str = "token", wrong_q_temperature: float | None = None
                        ) -> torch.Tensor:
    """n sequences of the first `length` tokens, decoded speculatively ([n, L] long).

    Rows sharing a prefix share each step's forwards (one draft forward per draft position,
    one target verify forward over the K + 1 positions, no KV cache). With
    `wrong_q_temperature`, verify is told a q at that temperature instead of the q the drafts
    were drawn from: a deliberately wrong variant."""
    gen = torch.Generator(device).manual_seed(seed)
    out = torch.full((n, length), -1, dtype=torch.long)
    have = torch.zeros(n, dtype=torch.long)
    wrong = None if wrong_q_temperature is None else \
        sampling.SamplingParams(temperature=wrong_q_temperature)
    while bool((have < length).any()):
        groups: dict[tuple[int, ...], list[int]] = {}
        rows_left = (have < length).nonzero().squeeze(-1).tolist()
        for r, pre in zip(rows_left, out[rows_left].tolist(), strict=True):
            groups.setdefault(tuple(pre[:have[r]]), []).append(r)
        for prefix, rows in groups.items():
            m = len(rows)
            ctx = torch.tensor([*prompt, *prefix], device=device).expand(m, -1)  # [m, c]
            x, qs, q_wrong = ctx, [], []
            for _ in range(k):
                logits = draft(input_ids=x).logits[:, -1].float()  # [m, V]
                q = sampling.probs_from_logits(logits, params)  # [m, V]
                u = torch.rand(m, dtype=torch.float64, generator=gen, device=device)
                tok = sampling.sample_from_weights(q, u)  # [m]
                qs.append(q)
                if wrong is not None:
                    q_wrong.append(sampling.probs_from_logits(logits, wrong))
                x = torch.cat([x, tok[:, None]], 1)
            c = ctx.shape[1]
            p = sampling.probs_from_logits(target(input_ids=x).logits[:, c - 1:].float(),
                                           params)  # [m, K+1, V]
            q_all = torch.stack(q_wrong if wrong is not None else qs, 1)  # [m, K, V]
            verdict = sampling.verify(p, x[:, c:], q_all, method=method, generator=gen)
            tokens = verdict.tokens.cpu()  # [m, K+1], -1 padded
            emitted = verdict.num_accepted.cpu() + 1  # [m]
            idx = torch.tensor(rows)  # [m]
            start = have[idx]  # [m]
            for t in range(k + 1):  # the emitted tokens, up to `length` per row
                ok = (t < emitted) & (start + t < length)
                out[idx[ok], (start + t)[ok]] = tokens[ok, t]
            have[idx] = torch.clamp(start + emitted, max=length)
    return out


def chi_square(samples: torch.Tensor, law: torch.Tensor, vocab: int) -> dict:
    """Pearson's test of sequences [n, L] against the law [V^L]: cells with expected count < 5
    pooled into one; p-value from the chi-square distribution (regularised gamma)."""
    n, length = samples.shape
    idx = torch.zeros(n, dtype=torch.long)
    for t in range(length):
        idx = idx * vocab + samples[:, t]
    counts = torch.bincount(idx, minlength=law.numel()).double()
    expected = law / law.sum() * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.numel() - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                           torch.tensor(stat / 2, dtype=torch.float64)))
    return {"samples": n, "cells": int(obs.numel()), "df": df, "statistic": stat,
            "threshold": chi_square_threshold(df, ALPHA), "p_value": pvalue,
            "passed": pvalue >= ALPHA}


def chi_square_threshold(df: int, alpha: float) -> float:
    """The statistic whose upper tail under chi-square(df) is alpha (bisection)."""
    lo, hi = 0.0, float(df) + 100.0 * math.sqrt(2 * df) + 100.0
    a = torch.tensor(df / 2, dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        if float(torch.special.gammaincc(a, torch.tensor(mid / 2, dtype=torch.float64))) > alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def exactness(device: torch.device, small: bool, sampling) -> dict:
    """The sequence-level chi-square tests (token, block, and the wrong variant) on `device`."""
    vocab, length, k = (4, 3, 3) if small else (8, 3, 3)
    n = 8_000 if small else 200_000
    prompt = [1, 2, 3]
    # float32: the test is of the algorithm on this device; logits scaled up (x 30 at the
    # head) so p and q are far from uniform and from each other, giving the test power
    target = build("exact", torch.float32, device, seed=11, vocab_size=vocab)
    draft = build("exact", torch.float32, device, seed=12, vocab_size=vocab)
    with torch.no_grad():
        target.lm_head.weight.mul_(30.0)
        draft.lm_head.weight.mul_(30.0)
    params = sampling.SamplingParams(temperature=1.0)
    law = exact_law(target, prompt, length, params, sampling, device)
    out = {"vocab": vocab, "length": length, "k": k, "alpha": ALPHA, "tests": {}}
    cases = {"token": ("token", None), "block": ("block", None),
             "wrong q (T=2 passed, T=1 drawn)": ("token", 2.0)}
    for i, (name, (method, wrong_t)) in enumerate(cases.items()):
        t0 = time.perf_counter()
        samples = speculative_samples(target, draft, prompt, length, k, n, params, sampling,
                                      device, seed=100 + i, method=method,
                                      wrong_q_temperature=wrong_t)
        res = chi_square(samples, law, vocab)
        res["must_pass"] = wrong_t is None
        res["seconds"] = time.perf_counter() - t0
        out["tests"][name] = res
    out["ok"] = all(r["passed"] == r["must_pass"] for r in out["tests"].values())
    return out


# --- driver ---------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    device = torch.device(args.device)
    sampling = load_sampling()
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    small = args.small
    names = ["tiny-a", "tiny-b"] if small else ["llama-135m", "llama-1b"]
    context, repeats, steps = (16, 2, 5) if small else (256, 7, 30)
    result: dict = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        platform.processor() or platform.machine(),
        "torch": torch.__version__, "transformers": _transformers_version(),
        "dtype": args.dtype, "small": small, "context": context,
        "weight_bytes_counted": "every nn.Linear weight (q, k, v, o, gate, up, down, LM head)",
    }
    result["copy_bandwidth_gbs"] = copy_bandwidth(device, 64 if small else 2048, 5 if small
                                                  else 20) / 1e9
    widths = list(range(1, 18))
    result["models"] = {}
    for name in names:
        t0 = time.perf_counter()
        model = build(name, dtype, device, seed=0)
        wb = weight_bytes(model)
        st = step_times(model, device, context, widths, repeats, steps)
        floor = matmul_floor(model, device, steps)
        row = {
            "params": sum(p.numel() for p in model.parameters()),
            "weight_bytes": wb,
            "step_ms": 1e3 * st["step_s"],
            "tokens_per_second": 1.0 / st["step_s"],
            "achieved_gbs": wb / st["step_s"] / 1e9,
            "share_of_copy_bandwidth": wb / st["step_s"] / 1e9 / result["copy_bandwidth_gbs"],
            "matmul_floor_ms": 1e3 * floor,
            "matmul_floor_share": wb / floor / 1e9 / result["copy_bandwidth_gbs"],
            "width_ms": {n: 1e3 * s for n, s in st["width_s"].items()},
            "w": st["w"],
            "invariance": position_invariance(model, device, context, 5),
        }
        row["seconds"] = time.perf_counter() - t0
        result["models"][name] = row
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["exactness"] = exactness(device, small, sampling)
    result["exactspec_modules"] = sorted(m for m in sys.modules
                                         if m == "exactspec" or m.startswith("exactspec."))
    result["seconds"] = time.perf_counter() - start
    return result


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def markdown(r: dict) -> str:
    """A short summary of the JSON."""
    lines = [f"# device check, {r['date_utc']}",
             f"{r['device']}, torch {r['torch']}, transformers {r['transformers']}, "
             f"{r['dtype']}, {r['context']} cached tokens; copy bandwidth "
             f"{r['copy_bandwidth_gbs']:.0f} GB/s (read + write bytes of the fastest copy); "
             f"weight bytes: {r['weight_bytes_counted']}; took {r['seconds']:.0f} s",
             "", "| model | params | weight MB | step ms | tok/s | GB/s | share of copy bw | "
             "matmuls only: ms, share | w(2) | w(5) | w(9) | w(17) | bit-equal width 1 vs 5 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in r["models"].items():
        w = m["w"]
        inv = m["invariance"]
        lines.append(
            f"| {name} | {m['params'] / 1e6:.0f}M | {m['weight_bytes'] / 1e6:.0f} | "
            f"{m['step_ms']:.2f} | {m['tokens_per_second']:.0f} | {m['achieved_gbs']:.0f} | "
            f"{100 * m['share_of_copy_bandwidth']:.1f}% | {m['matmul_floor_ms']:.3f}, "
            f"{100 * m['matmul_floor_share']:.0f}% | {w[2]:.2f} | {w[5]:.2f} | "
            f"{w[9]:.2f} | {w[17]:.2f} | {inv['bit_equal']}/{inv['values']} "
            f"(max diff {inv['max_abs_diff']:.2g}) |")
    e = r["exactness"]
    lines += ["", f"exactness (float32 models, V={e['vocab']}, first {e['length']} tokens, "
              f"K={e['k']}, chi-square at false-alarm rate {e['alpha']:g}): "
              + ("all as expected" if e["ok"] else "FAILED"), "",
              "| test | samples | cells | statistic | threshold | p-value | result |",
              "|---|---|---|---|---|---|---|"]
    for name, t in e["tests"].items():
        verdict = "pass" if t["passed"] else "fail"
        want = "(must pass)" if t["must_pass"] else "(must fail)"
        lines.append(f"| {name} | {t['samples']} | {t['cells']} | {t['statistic']:.1f} | "
                     f"{t['threshold']:.1f} | {t['p_value']:.3g} | {verdict} {want} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:1, cpu")
    ap.add_argument("--small", action="store_true",
                    help="tiny configs and samples (the CPU smoke run the tests use)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the timed models' weights (the exactness models are float32)")
    ap.add_argument("--out", default=None,
                    help="output directory (default $OUT, else out/device_check)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no GPU; use --device cpu --small")
    out = Path(args.out or os.environ.get("OUT") or "out/device_check")
    out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (out / "device_check.json").write_text(json.dumps(result, indent=1))
    (out / "device_check.md").write_text(markdown(result))
    sys.stdout.write(markdown(result))
    return 0 if result["exactness"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
