"""The formulas behind bench figures: alpha fitted to acceptance length, Leviathan's bound,
and what machine the figures were measured on."""

from __future__ import annotations

import platform

import torch


def fit_alpha(mean_len: float, k: float) -> float:
    """Per-token acceptance rate a with (1 - a^(k+1)) / (1 - a) == mean_len (i.i.d. model)."""
    if k <= 0 or mean_len <= 1.0:
        return 0.0
    if mean_len >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if (1 - a ** (k + 1)) / (1 - a) < mean_len:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def analytic_bound(alpha: float, k: float, c: float) -> float:
    """Leviathan et al. Thm 3.8: expected speedup (1 - a^(K+1)) / ((1 - a)(K c + 1))."""
    tokens = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + 1)


CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "amx_bf16", "amx_int8")  # the flags that pick kernels (formats.py, llama.cpp)


def cpu_flags() -> list[str]:
    """Which of CPU_FLAGS this CPU reports (/proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return []
    have = set(line.split(":", 1)[-1].split())
    return [f for f in CPU_FLAGS if f in have]


def cpu_model() -> str:
    """The CPU's model name with its CPUID family and model, as /proc/cpuinfo gives them (a VM
    often names only the vendor: the numbers tell the generation); "" elsewhere."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if not ln.strip():
                    break  # the first processor's block
                key, _, value = ln.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return ""
    name = fields.get("model name", "")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name.strip()


def kernel_unit() -> str | None:
    """The instruction-set unit our kernels run on here (amx, avx512bf16, avx512vnni, ...; the
    bits of a bf16 target depend on it), or None where they are off or not built."""
    from exactspec import kernels

    return kernels.current_isa() if kernels.enabled() else None


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 7) -> float:
    """Memory read bandwidth torch reaches here (GB/s): the fastest sum over a buffer far
    larger than the caches, with torch's current threads."""
    import time

    x = torch.ones(megabytes * (1 << 20) // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def machine_info() -> dict:
    """What the figures were measured on: the CPU's torch capability and kernel flags too."""
    import os

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": cpu_flags(),
        "kernel_unit": kernel_unit(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if hasattr(os, "getloadavg"):
        info["load_average"] = os.getloadavg()
    return info


def linear_weight_bytes(model) -> int:
    """Bytes a one-token step of a transformers model reads: every nn.Linear weight (q, k, v,
    o, gate, up, down, the LM head, tied to the embedding or not); norms and the one embedding
    row it looks up are left out."""
    from torch import nn

    return sum(m.weight.numel() * m.weight.element_size()
               for m in model.modules() if isinstance(m, nn.Linear))


def bandwidth_summary(model, runs: dict) -> dict:
    """One-token steps as a share of the memory-bandwidth limit: weight bytes a target step
    reads / its time, against the read bandwidth measured here (`read_bandwidth_gbs`).

    `runs`: the bench's (engine, mode, workload) -> rounds of Runs; exactspec plain's step is
    its target-forward time per step, transformers plain's its wall time per token, and the
    quantized self-draft's its drafting time per draft position (one row; chains only, as a
    tree's draft forward covers several nodes)."""
    from exactspec.models.lean import lean_forward_for

    lean = lean_forward_for(model)
    out: dict = {"read_gbs": read_bandwidth_gbs()}
    if lean is None:
        return out
    out["target_weight_bytes"] = lean.weight_bytes
    steps: dict[str, list[float]] = {}
    for (engine, _, _), rounds in runs.items():
        for r in (r for rs in rounds for r in rs):
            if engine == "exactspec plain" and r.steps:
                steps.setdefault(engine, []).append(r.target_seconds / r.steps)
            elif engine == "transformers plain" and r.tokens:
                steps.setdefault(engine, []).append(r.seconds / r.tokens)
            elif engine.startswith("exactspec qdraft") and " tree " not in engine and r.drafted:
                steps.setdefault("qdraft draft token", []).append(
                    r.draft_seconds / r.drafted * len(r.texts))
    for name, xs in steps.items():
        ms = sorted(xs)[len(xs) // 2] * 1e3
        row = {"step_ms": ms}
        if name != "qdraft draft token":
            row["share_of_limit"] = out["target_weight_bytes"] / 1e9 / (ms / 1e3) / out["read_gbs"]
        out[name] = row
    return out
