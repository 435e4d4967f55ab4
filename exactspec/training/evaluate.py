"""Standalone evaluation of a draft head on held-out target generations, and the loss plot.

Teacher-forced along each held-out reply: from every start s in the reply the head is rolled
forward `depth` steps on its own outputs (as in decoding), reading the reply's real tokens.
At depth d, a_d(s) = sum_x min(p_{s+d}(x), q_d(s)(x)) with p and q both from
`probs_from_logits` (q over the full vocabulary, exactly as `EagleDrafter` builds it).
Greedy (temperature 0): one-hot p and q, so a_d is 1 when the argmaxes agree; along greedy
replies this is exactly what the engine's greedy verification accepts.
  P(first k drafts accepted) ~= mean_s prod_{d<=k} a_d(s)   (exact for greedy)
  mean acceptance length (K drafts, counts the bonus / recovered token) = 1 + sum_k P(first k)
At T=1 the chain in decoding reads the drafted tokens, not the target's sampled ones, so the
T=1 numbers are an estimate; the engine's stats measure the real thing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from exactspec.drafters.eagle import full_logits
from exactspec.drafters.eagle_head import EagleHead
from exactspec.sampling import SamplingParams, probs_from_logits
from exactspec.training.data import Sequence, collate


@torch.inference_mode()
def evaluate_head(head: EagleHead, held: list[Sequence], *, depth: int = 4,
                  batch_size: int = 8) -> dict:
    """alpha by depth and acceptance by position at T=1 (sampled replies) and greedy."""
    head.eval()
    out = {}
    for mode, greedy in (("t1", False), ("greedy", True)):
        rows = [s for s in held if s.greedy == greedy]
        params = SamplingParams(temperature=0.0 if greedy else 1.0)
        a_all = []  # [M, depth] per start
        for i in range(0, len(rows), batch_size):
            a_all.append(_accept(head, rows[i : i + batch_size], depth, params))
        a = torch.cat(a_all) if a_all else torch.zeros(0, depth)
        first = a.cumprod(1).mean(0) if a.numel() else torch.zeros(depth)  # P(first k)
        out[mode] = {
            "positions": int(a.shape[0]),
            "alpha_by_depth": [round(float(x), 4) for x in a.mean(0)] if a.numel() else [],
            "accept_first_k": [round(float(x), 4) for x in first],
            "mean_acceptance_length": round(1.0 + float(first.sum()), 4),
        }
    return out


def _accept(head: EagleHead, rows: list[Sequence], depth: int,
            params: SamplingParams) -> torch.Tensor:  # [M, depth]
    (tokens, feats, final, _, n), plen = collate(rows), torch.tensor([r.prompt_len for r in rows])
    b, t = tokens.shape
    outs = head.unroll(feats, tokens, depth)
    s = torch.arange(t)[None, :]
    # starts in the reply whose whole chain has labels: prompt_len - 2 <= s <= n - 1 - depth
    starts = (s >= plen[:, None] - 2) & (s + depth <= n[:, None] - 1)  # [B, T]
    bi = torch.arange(b)[:, None].expand(b, t)[starts]
    si = s.expand(b, t)[starts]
    # the target's p at every position a chain reads a label from: s+1 .. s+depth
    need = torch.zeros(b, t, dtype=torch.bool)
    for d in range(1, depth + 1):
        need[bi, si + d] = True
    where = torch.full((b, t), -1, dtype=torch.long)
    where[need] = torch.arange(int(need.sum()))
    p_all = probs_from_logits(_target_logits(head, final[need].float()), params)  # [N, V]
    res = []
    for d, o in enumerate(outs, start=1):
        q = probs_from_logits(full_logits(head, head.logits(o[starts])), params)  # [M, V]
        p = p_all[where[bi, si + d]]
        res.append(torch.minimum(p, q).sum(-1))
    return torch.stack(res, 1)


def _target_logits(head: EagleHead, final: torch.Tensor) -> torch.Tensor:  # [M, V]
    """The target's full logits from its final normed feature (its LM head = attached rows)."""
    w = head.full_lm_weight
    assert w is not None, "attach the target first"
    return final @ w.float().T


def plot_losses(history: list[dict], path: Path) -> Path:
    """Loss per depth and the training alpha estimate against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [h["step"] for h in history]
    depth = max((len(h["depth"]) for h in history), default=0)
    for d in range(depth):
        for ax, k, name in ((ax1, 0, "loss"), (ax2, 1, "alpha (T=1, train batch)")):
            ys = _smooth([h["depth"][d][k] for h in history])
            ax.plot(steps, ys, label=f"depth {d + 1}")
            ax.set_ylabel(name)
    for ax in (ax1, ax2):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_title("soft cross-entropy vs the target's p")
    ax2.set_title("sum min(p, q) on the training batches")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def _smooth(ys: list[float], k: int = 20) -> list[float]:
    out, acc = [], []
    for y in ys:
        acc.append(y)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out
