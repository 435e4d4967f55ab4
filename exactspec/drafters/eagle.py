"""EagleDrafter: drafts a chain of K tokens with a trained EagleHead over the target's features.

Engine contract: the drafter's `hidden_layers` (indices into transformers'
`output_hidden_states`) tells the engine which target features to pass; `DraftContext.hidden`
is then [B, T, H * len(hidden_layers)], hidden[b, i] valid for i < lengths[b] - 1 (the last
token has not been run by the target yet).

The head keeps its own KV cache of *real* positions only (s <= lengths - 2, computed from the
target's features and the emitted tokens). Draft positions live outside it, so rolling back a
rejection costs nothing: the next `propose` recomputes from the first position whose token
disagrees with what the cache was fed, normally just the newly emitted positions.

q at draft position j is `probs_from_logits` of the head's logits (the draft vocabulary
scattered into the full vocabulary, other tokens at a logit 1e4 below the row's minimum, so
their probability underflows to 0), with the engine's parameters and the history the target
uses there; the token is drawn from exactly that q with `DOMAIN_DRAFT + j`. Without penalties
or logit_bias the same q is computed on the draft vocabulary alone and scattered (cheaper).

`load_drafter("smollm2-135m")` returns the shipped head; `load_drafter(path)` one written by
`exactspec train-draft`. The frozen target parts (embedding, final norm, LM head) are shared
with the target, never copied: pass `target=` to `load_drafter`, or the drafter attaches at
`begin` to `TargetInfo.model` when the engine provides it, else loads the embedded target
named in the head's metadata.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from exactspec.drafters.base import DraftContext, TargetInfo, empty_proposal
from exactspec.drafters.eagle_head import EagleConfig, EagleHead, attend, full_logits
from exactspec.drafters.eagle_tree import HeadCache, eagle_tree
from exactspec.drafters.tree_shape import check_tree, tree_of
from exactspec.errors import InvalidValue
from exactspec.sampling.standardize import probs_from_logits_rows

log = logging.getLogger(__name__)

WEIGHTS_DIR = Path(__file__).parent / "weights"  # shipped heads, one folder per embedded name
CONFIG_FILE = "config.json"  # EagleConfig as JSON
WEIGHTS_FILE = "head.safetensors"  # trainable weights (float16) + the draft vocabulary ids


class EagleDrafter:
    """Chain drafter over an `EagleHead`; follows the `Drafter` Protocol."""

    standardized_q = True  # q from probs_from_logits_rows, not re-checked (base.trusts_q)

    hidden_layers: tuple[int, ...] = (-1,)  # target features wanted (overridden per instance)

    def __init__(self, head: EagleHead, target=None, *, name: str = "eagle", tree=None,
                 siblings: str = "without_replacement") -> None:
        # branching per depth or a DynamicTree (None: chains; drafters/tree_draft.py,
        # drafters/dynamic_tree.py) and how siblings are drawn
        self.tree, self.siblings = check_tree(tree, siblings)
        self.head = head.eval()  # the trained layer; frozen parts attached from the target
        self.hidden_layers = tuple(head.config.hidden_layers)
        self.name = name  # embedded name or path, for logs
        self._attached = None  # the transformers model whose parts the head shares
        if target is not None:
            self.attach(target)
        self._committed: torch.Tensor | None = None  # [B] real positions in the cache
        self._seen: torch.Tensor | None = None  # [B, S+1] tokens the cache was computed from
        self._k: torch.Tensor | None = None  # [B, h, S, d] keys of real positions
        self._v: torch.Tensor | None = None  # [B, h, S, d]
        self._o_last: torch.Tensor | None = None  # [B, H] head output at the last real position

    def __repr__(self) -> str:
        return f"EagleDrafter({self.name!r}, hidden_layers={self.hidden_layers})"

    def attach(self, target) -> None:
        """Share `target`'s embedding / final norm / LM head (an exactspec Model or HF model)."""
        from exactspec.models.adapter import unwrap_model

        model = unwrap_model(target)
        if model is self._attached:
            return
        self.head.attach(model)
        dev = next(model.parameters()).device
        self.head.to(dev)
        self._attached = model

    def begin(self, context: DraftContext, target: TargetInfo) -> None:
        if self._attached is None:
            model = getattr(target, "model", None)
            if model is None:
                name = self.head.config.meta.get("target")
                if not name:
                    raise InvalidValue("EagleDrafter needs the target model: pass "
                                     "load_drafter(..., target=model)")
                from exactspec.models.loading import load

                log.info("loading target %s for the draft head's frozen parts", name)
                model = load(name)
            self.attach(model)
        if target.vocab_size != self.head.config.vocab_size:
            raise InvalidValue(f"vocabulary mismatch: the draft head predicts "
                             f"{self.head.config.vocab_size} tokens, the target has "
                             f"{target.vocab_size}")
        b = context.tokens.shape[0]
        dev = self.head.vocab_ids.device
        c = self.head.config
        self._committed = torch.zeros(b, dtype=torch.long, device=dev)
        self._seen = torch.full((b, 1), -1, dtype=torch.long, device=dev)
        dtype = self.head.fc.weight.dtype
        self._k = torch.zeros(b, c.num_heads, 0, c.head_dim, dtype=dtype, device=dev)
        self._v = torch.zeros_like(self._k)
        self._o_last = torch.zeros(b, c.hidden_size, dtype=dtype, device=dev)

    def admit(self, context: DraftContext, target: TargetInfo, start: int) -> None:
        """Rows start.. are new: empty head caches (filled from the target's features at their
        next propose); the running rows keep theirs."""
        assert self._committed is not None, "begin() first"
        r = int(context.tokens.shape[0]) - start
        self._committed = torch.cat([self._committed, self._committed.new_zeros(r)])
        self._seen = torch.cat([self._seen, self._seen.new_full((r, self._seen.shape[1]), -1)])
        self._k = torch.cat([self._k, self._k.new_zeros(r, *self._k.shape[1:])])
        self._v = torch.cat([self._v, self._v.new_zeros(r, *self._v.shape[1:])])
        self._o_last = torch.cat([self._o_last, self._o_last.new_zeros(r, self._o_last.shape[1])])

    def select(self, rows: torch.Tensor) -> None:
        assert self._committed is not None, "begin() first"
        rows = rows.to(self._committed.device)
        self._committed = self._committed[rows]
        self._seen = self._seen[rows]
        self._k, self._v = self._k[rows], self._v[rows]
        self._o_last = self._o_last[rows]

    @torch.inference_mode()
    def propose_tree(self, context: DraftContext, max_depth: torch.Tensor):
        """The head drafting the tree of `self.tree`, fixed or dynamic (drafters/eagle_tree.py),
        after catching up with the target's features; max_depth [B]."""
        hidden = context.hidden
        if hidden is None:
            raise ValueError("EagleDrafter needs the target's hidden states in DraftContext.hidden")
        dev = self._committed.device
        tok, lengths = context.tokens.to(dev), context.lengths.to(dev)
        real = self._catch_up(hidden.to(dev), tok, lengths)  # [B]
        cache = HeadCache(self._k, self._v, self._o_last, real)
        return eagle_tree(self.head, cache, context, tree_of(self), self.siblings, max_depth)

    @torch.inference_mode()
    def propose(
        self, context: DraftContext, num_tokens: torch.Tensor  # [B]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K] -1 padded, [B, K, V]
        assert self._committed is not None, "begin() first"
        hidden = context.hidden  # [B, T, L*H]
        if hidden is None:
            raise ValueError("EagleDrafter needs the target's hidden states in "
                             "DraftContext.hidden (the engine passes them for drafters with "
                             "a `hidden_layers` attribute)")
        head = self.head
        dev = self._committed.device
        tokens, lengths = context.tokens.to(dev), context.lengths.to(dev)  # [B, T], [B]
        b = tokens.shape[0]
        drafts, q = empty_proposal(num_tokens, head.config.vocab_size, dev)  # [B, K] -1, [B, K, V] 0
        k = drafts.shape[1]
        if k == 0:
            return drafts, q
        real = self._catch_up(hidden.to(dev), tokens, lengths)  # [B] real positions cached
        s = real - 1  # last real position per row (-1: a one-token row, nothing to draft)
        g = self._o_last  # [B, H]
        slots = torch.arange(self._k.shape[2], device=dev)
        mask = (slots[None, :] < real[:, None])[:, None, :]  # [B, 1, S]
        ks, vs = [], []
        rows_params = context.rows_params()
        # penalties and logit_bias act on the full vocabulary (history, token ids); without
        # them, standardizing the draft vocabulary alone gives the same q (off-vocabulary
        # tokens have probability 0 either way) at a sixth of the work
        on_sub_vocab = not any(p.uses_history or p.logit_bias for p in rows_params)
        ids = head.vocab_ids[None, :].expand(b, -1)  # [B, Vd]
        for j in range(k):
            if j > 0:  # chain depth j+1: own output and the previous draft token
                x, qh, kh, vh = head.qkv(g[:, None], drafts[:, j - 1 : j], (s + j)[:, None])
                ks.append(kh)
                vs.append(vh)
                a = attend(qh, self._k, self._v, mask, torch.stack(ks, 3), torch.stack(vs, 3))
                g = head.finish(x, a)[:, 0]
            sub = head.logits(g)  # [B, Vd]
            if on_sub_vocab:  # q is zero off the draft vocabulary: standardize only Vd entries
                q_sub = probs_from_logits_rows(sub, rows_params)  # [B, Vd]
                drafts[:, j] = head.vocab_ids[context.draw(q_sub, j)]
                q[:, j].scatter_(1, ids, q_sub)
                continue
            q_j = context.standardize(full_logits(head, sub), drafts[:, :j])  # [B, V]
            drafts[:, j] = context.draw(q_j, j)
            q[:, j] = q_j
        want = torch.arange(k, device=dev)[None, :] < num_tokens.to(dev)[:, None]
        want &= (s >= 0)[:, None]
        return torch.where(want, drafts, -1), q

    def _catch_up(self, hidden: torch.Tensor, tokens: torch.Tensor,
                  lengths: torch.Tensor) -> torch.Tensor:  # [B] real positions now cached
        """Run the head on every real position the cache lacks; keep the agreeing prefix."""
        head = self.head
        dev = tokens.device
        b, t = tokens.shape
        # position s was computed from tokens 0..s+1: keep the prefix the context agrees with
        n = min(self._seen.shape[1], t)
        agree = (self._seen[:, :n] == tokens[:, :n]).long().cumprod(1).sum(1)  # [B]
        keep = torch.minimum(self._committed, (agree - 1).clamp(min=0))
        target_real = (lengths - 1).clamp(min=0)  # positions with a feature and a next token
        keep = torch.minimum(keep, target_real - 1).clamp(min=0)  # always redo the last one
        width = int((target_real - keep).max()) if b else 0
        if width > 0:
            pos = keep[:, None] + torch.arange(width, device=dev)  # [B, W]
            valid = pos < target_real[:, None]
            feats = hidden.gather(1, pos.clamp(max=hidden.shape[1] - 1)[..., None]
                                  .expand(-1, -1, hidden.shape[2]))  # [B, W, L*H]
            nxt = tokens.gather(1, (pos + 1).clamp(max=t - 1))
            nxt = torch.where(valid, nxt, 0)
            x, qh, kh, vh = head.qkv(head.fuse(feats), nxt, pos)
            need = int(pos.max()) + 1
            if need > self._k.shape[2]:
                grow = need - self._k.shape[2] + 64
                pad = self._k.new_zeros(*self._k.shape[:2], grow, self._k.shape[3])
                self._k, self._v = torch.cat([self._k, pad], 2), torch.cat([self._v, pad], 2)
            # invalid entries land beyond the row's real length: masked now, overwritten later
            idx = pos[:, None, :, None].expand_as(kh)
            self._k.scatter_(2, idx, kh)
            self._v.scatter_(2, idx, vh)
            slots = torch.arange(self._k.shape[2], device=dev)
            mask = slots[None, None, :] <= pos[:, :, None]  # [B, W, S]
            o = head.finish(x, attend(qh, self._k, self._v, mask))  # [B, W, H]
            last = (target_real - keep - 1).clamp(min=0)
            moved = target_real > keep
            o_last = o[torch.arange(b, device=dev), last]
            self._o_last = torch.where(moved[:, None], o_last, self._o_last)
        self._committed = target_real
        self._seen = tokens[:, : int(lengths.max())].clone() if b else self._seen
        return target_real


# --- saving and loading -----------------------------------------------------------------------

def save_head(head: EagleHead, out_dir: str | os.PathLike[str]) -> None:
    """Write `config.json` + `head.safetensors` (float16 weights, int64 draft vocabulary)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to(torch.float16) if v.is_floating_point() else v.detach()).cpu()
             .contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE))
    (out / CONFIG_FILE).write_text(json.dumps(head.config.to_json_dict(), indent=2) + "\n")


def load_head(path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32) -> EagleHead:
    """An `EagleHead` from a directory written by `save_head` (frozen parts not attached)."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise InvalidValue(f"{str(path)!r} is not a draft head directory: it needs {CONFIG_FILE} "
                         f"and {WEIGHTS_FILE} (written by `exactspec train-draft`)")
    config = EagleConfig(**json.loads((path / CONFIG_FILE).read_text()))
    head = EagleHead(config)
    state = load_file(str(path / WEIGHTS_FILE))
    head.vocab_ids = state["vocab_ids"].long()
    head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                          for k, v in state.items()})
    return head.to(dtype).eval()


def shipped_names() -> list[str]:
    """Embedded target names with a shipped draft head."""
    if not WEIGHTS_DIR.is_dir():
        return []
    return sorted(p.name for p in WEIGHTS_DIR.iterdir() if (p / CONFIG_FILE).is_file())


def load_drafter(name_or_path: str | os.PathLike[str], target=None, *, tree=None,
                 siblings: str = "without_replacement") -> EagleDrafter:
    """The shipped head for an embedded name (e.g. "smollm2-135m"), or a trained head directory.

    `target` (an exactspec Model or transformers model) shares its frozen parts now; without
    it the drafter attaches at `begin` (see the module docstring). `tree` / `siblings` as for
    EagleDrafter: a fixed tree (3, 2, 1) or DynamicTree(node_budget=16).
    """
    text = os.fspath(name_or_path)
    path = WEIGHTS_DIR / text if text in shipped_names() else Path(text).expanduser()
    if not path.is_dir():
        raise InvalidValue(f"no draft head {text!r}: use an embedded name with a shipped head "
                         f"{shipped_names()} or a directory written by `exactspec train-draft`")
    return EagleDrafter(load_head(path), target, name=text, tree=tree, siblings=siblings)
