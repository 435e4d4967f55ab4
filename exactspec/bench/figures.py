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


def machine_info() -> dict:
    """What the figures were measured on."""
    import os

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if hasattr(os, "getloadavg"):
        info["load_average"] = os.getloadavg()
    return info
