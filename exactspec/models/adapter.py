"""Target adapter: batched prefill / extend / rollback over any transformers causal LM.

Each row keeps its own length in a SlotCache (`exactspec/models/cache.py`); `extend` writes the
new tokens at `lengths[b] ..` and `commit` / `rewind` only move the per-row length, so rolling
back rejected draft tokens costs nothing and rows may accept different numbers of tokens
(ragged acceptance); nothing is concatenated per step (its cost against transformers'
DynamicCache: docs/performance.md). Llama-family models run through the lean
forward (`exactspec/models/lean.py`); others through transformers' forward with a 4D additive
mask built here, so transformers never has to infer positions from the cache.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import PreTrainedModel

from exactspec.errors import InvalidValue
from exactspec.kernels.threads import GOVERNOR
from exactspec.models.architectures import attention_layout
from exactspec.models.cache import SlotCache, kv_cache_dtype, mark_kv_cache
from exactspec.models.lean import LeanLlama, lean_forward_for

_SUPPORTED_ATTENTION = ("eager", "sdpa")

__all__ = ["LeanLlama", "SlotCache", "TargetAdapter", "lean_forward_for", "unwrap_model"]


GOVERNED_TOKENS = 64  # forwards of at most this many tokens (decode, verify) are governed


def governed(lean: LeanLlama, rows: int, width: int):
    """The context a lean forward runs in: on our kernels, at the thread count the forwards of
    its kind measure fastest (kernels/threads.py: the bits do not depend on it); on torch's
    operators, at torch's count (theirs may)."""
    if not lean.kernels or rows * width > GOVERNED_TOKENS:  # prefills: torch's count
        return contextlib.nullcontext()
    return GOVERNOR.run((("lean", id(lean)), rows, width))


def unwrap_model(model) -> PreTrainedModel:
    """The transformers model inside an `exactspec.Model`, or `model` itself."""
    if isinstance(model, PreTrainedModel):
        return model
    inner = getattr(model, "model", None)
    if isinstance(inner, PreTrainedModel):
        return inner
    raise TypeError(
        f"expected an exactspec Model or a transformers PreTrainedModel, got {type(model).__name__}"
    )


def set_kv_cache(model, kv_cache: str) -> None:
    """The KV cache a target adapter gives `model` (an exactspec Model or a transformers
    model): "float32" (the default) or "bfloat16", each key and value rounded to bf16 (to
    nearest even) as it is stored, which halves what a step reads of a long context. With
    "bfloat16" the target is another function (its stored keys and values rounded), decoded
    exactly like any other: plain and speculative decoding give the same law and, greedy, the
    same tokens (tests/kernels/test_bf16_cache.py). It runs on exactspec's kernels only (a
    refused adapter says so). A drafter's own cache stays float32; a self-draft on the
    target's cache reads the target's."""
    mark_kv_cache(unwrap_model(model), kv_cache)


class TargetAdapter:
    """Batched incremental forward passes of a causal LM with free rollback.

    Protocol: `prefill(prompts)` caches each row's tokens; `extend(tokens)` runs T new tokens
    per row on top of each row's committed length and returns their logits without committing
    them; `commit(n)` keeps the first n of them per row; `rewind(lengths)` sets lengths
    directly; `select(rows)` drops finished rows. Works on any device the model lives on.
    `forward` runs a given lean forward instead of the model's own weights (a quantized draft
    of the model: `lean_forward_for(model, "int8")`). `one_row_copy=False` (a target verifying
    drafts) keeps a rare one-row step from building the float32 one-row weight copy (+540 MB
    for smollm2-135m); plain decoding and draft models, whose every step is one row, want it.
    `strict` (a target): an architecture outside `models/architectures.py`'s contract is
    refused; a drafter (`strict=False`) may approximate, which cannot change the output law.
    """

    def __init__(self, model, *, pad_token_id: int = 0, lean: bool = True,
                 forward: LeanLlama | None = None, one_row_copy: bool = True,
                 strict: bool = True) -> None:
        self.model = unwrap_model(model)
        impl = getattr(self.model.config, "_attn_implementation", "eager")
        if impl not in _SUPPORTED_ATTENTION:
            raise InvalidValue(
                f"attention implementation {impl!r} is not supported; load the model with "
                f"attn_implementation='sdpa' or 'eager'"
            )
        first = next(self.model.parameters())
        self.device = first.device  # where every tensor of this adapter lives
        self.dtype = first.dtype  # model dtype, for the additive mask
        text_config = self.model.config.get_text_config(decoder=True)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])  # logits width
        self.max_context = int(getattr(text_config, "max_position_embeddings", 1 << 30))
        self.layout = attention_layout(self.model.config, strict=strict)  # the masks it needs
        self.pad_token_id = pad_token_id  # filler for ragged inputs; never attended to
        # the lean forward (the Llama family, models/lean_arch.py) unless turned off;
        # transformers' otherwise
        self.lean = forward if forward is not None else (
            lean_forward_for(self.model) if lean else None)
        self.one_row_copy = one_row_copy  # may a one-row step build the [in, out] copy
        # the cache's dtype (set_kv_cache; None: the states', float32 on our kernels); a
        # drafter's own cache (strict=False) keeps the default
        self.kv_dtype = kv_cache_dtype(self.model) if strict else None
        if self.kv_dtype is not None and not (self.lean is not None and self.lean.kernels):
            raise InvalidValue(
                "kv_cache='bfloat16' runs on exactspec's kernels (the lean forward of a CPU "
                "build), and this target runs on transformers' or torch's operators; use "
                "kv_cache='float32'")
        self.cache: SlotCache | None = None
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] committed slots
        self._last_width = 0  # T of the last extend, bounds commit

    @property
    def batch_size(self) -> int:
        return int(self.lengths.numel())

    def prefill(self, prompts: list[list[int]], *, capacity: int | None = None,
                hidden_layers: tuple[int, ...] | None = None) -> torch.Tensor | None:
        """Cache every token of every row (rows may differ in length; empty rows allowed).

        Identical rows are run once and copied. `capacity` preallocates slots per row. With
        `hidden_layers`, returns the features of every prompt token [B, W, H * len(layers)]
        (W = longest prompt), as `extend` does.
        """
        hidden = None
        uniq: dict[tuple[int, ...], int] = {}
        inverse = [uniq.setdefault(tuple(p), len(uniq)) for p in prompts]
        unique = [list(p) for p in uniq]
        lens = [len(p) for p in unique]
        width = max(lens, default=0)
        cap = max(capacity or 0, width, 1)
        self.cache = SlotCache(len(unique), cap, self.kv_dtype)
        self.lengths = torch.zeros(len(unique), dtype=torch.long, device=self.device)
        if width > 0:
            tokens = torch.full((len(unique), width), self.pad_token_id, dtype=torch.long)
            for i, p in enumerate(unique):
                tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
            out = self.extend(tokens.to(self.device), logits_to_keep=1,
                              hidden_layers=hidden_layers)
            if hidden_layers is not None:
                hidden = out[1]  # [U, W, F]
            self.commit(torch.tensor(lens, dtype=torch.long, device=self.device))
        if len(unique) != len(prompts):
            rows = torch.tensor(inverse, dtype=torch.long, device=self.device)
            self.select(rows)
            hidden = hidden[rows] if hidden is not None else None
        return hidden

    def admit(self, prompts: list[list[int]], *, capacity: int | None = None,
              hidden_layers: tuple[int, ...] | None = None) -> torch.Tensor | None:
        """`prefill` new rows and append them after the current ones (between steps).

        The slot capacity becomes the larger of the two; returns the new rows' features as
        `prefill` does.
        """
        old, old_lengths = self.cache, self.lengths
        hidden = self.prefill(prompts, capacity=capacity, hidden_layers=hidden_layers)
        if old is not None and old.rows:
            self.cache = old.cat(self.cache)
            self.lengths = torch.cat([old_lengths, self.lengths])
        return hidden

    @torch.inference_mode()
    def extend(
        self,
        tokens: torch.Tensor,  # [B, T] long
        *,
        return_hidden: bool = False,
        hidden_layers: tuple[int, ...] | None = None,
        logits_to_keep: int = 0,
        tail=None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run T tokens per row after each row's committed length; nothing is committed.

        Returns logits [B, T, V] float (the last `logits_to_keep` positions if nonzero), and
        with `hidden_layers` (indices into transformers' `hidden_states` tuple) also those
        layers' states concatenated, [B, T, H * len(hidden_layers)]; `return_hidden` is
        `hidden_layers=(-1,)`, the last layer's. `tail` (a lean forward on the kernels only):
        what replaces the final norm and head, its result returned (the native draft step).
        """
        if return_hidden and hidden_layers is None:
            hidden_layers = (-1,)
        assert self.cache is not None, "prefill first"
        b, t = tokens.shape
        assert b == self.batch_size, (b, self.batch_size)
        start = self.lengths  # [B]
        positions = start[:, None] + torch.arange(t, device=self.device)  # [B, T]
        view_len = int(start.max()) + t if b else t
        if view_len > self.max_context:
            raise InvalidValue(
                f"sequence of {view_len} tokens exceeds the model's context of {self.max_context}"
            )
        lo, hi = int(start.min()), int(start.max())
        self.cache.write_start = lo if lo == hi else None
        self.cache.write_index = positions
        self.cache.view_len = view_len
        if view_len > self.cache.capacity:
            self.cache.capacity = max(view_len, self.cache.capacity * 3 // 2 + 64)
        if self.lean is not None:
            uniform = lo == hi
            mask = None
            if t > 1 or not uniform or self.lean.sliding:  # else one token sees every slot
                slots = torch.arange(view_len, device=self.device)  # [S]
                visible = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
                mask = visible[:, None]  # [B, 1, T, S]
                if self.lean.sliding:  # slot == position: one mask per layer kind
                    held = slots[None, :].expand(b, view_len)  # [B, S]
                    mask = self.layout.visibility(visible, positions, held)
            with governed(self.lean, b, t):
                out = self.lean.forward(tokens, positions, self.cache, mask, logits_to_keep,
                                        hidden_layers, one_row_copy=self.one_row_copy,
                                        tail=tail)
            self._last_width = t
            return out
        assert tail is None, "a tail needs the lean forward"
        out = self.model(
            input_ids=tokens,
            attention_mask=self._mask(positions, view_len),  # slot == position
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=hidden_layers is not None,
            logits_to_keep=logits_to_keep,
        )
        self._last_width = t
        if hidden_layers is not None:
            feats = torch.cat([out.hidden_states[i] for i in hidden_layers], dim=-1)
            return out.logits, feats
        return out.logits

    def _mask(self, positions: torch.Tensor, view_len: int):
        # positions: [B, T]; slot j holds position j and is visible to position i iff j <= i
        slots = torch.arange(view_len, device=self.device)  # [S]
        visible = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
        held = slots[None, :].expand(positions.shape[0], view_len)  # [B, S]
        return self.layout.mask(visible, positions, held, self.dtype)

    def commit(self, num_tokens: torch.Tensor) -> None:
        """Keep the first `num_tokens[b]` ([B] long, 0..T) tokens of the last extend per row."""
        assert bool((num_tokens >= 0).all()) and bool((num_tokens <= self._last_width).all())
        self.lengths = self.lengths + num_tokens.to(self.device)

    def rewind(self, lengths: torch.Tensor) -> None:
        """Set each row's committed length ([B] long); slots past it are forgotten."""
        assert bool((lengths <= self.lengths + self._last_width).all())
        self.lengths = lengths.to(self.device).clone()

    def feed_rows(self, rows: torch.Tensor, tokens: torch.Tensor,  # [R] long, [R, T] long
                  num_tokens: torch.Tensor) -> None:  # [R] long, 0..T
        """Run `tokens` after the committed lengths of `rows` only and commit the first
        `num_tokens` of each; the other rows are untouched. A forward over R rows, not the
        whole batch padded to the widest (a drafter catching one row up in a batch of 64).
        On batch-invariant kernels the cache gets the same bits as `extend` over every row."""
        assert self.cache is not None, "prefill first"
        rows = rows.to(self.device)
        full, lengths = self.cache, self.lengths
        need = int(lengths.index_select(0, rows).max()) + tokens.shape[1] if len(rows) else 0
        if need > full.capacity:  # grow the whole cache first, so the rows' copy fits back
            full.capacity = max(need, full.capacity * 3 // 2 + 64)
        full.view_len = max(full.view_len, need)
        for i, k in enumerate(full.keys):
            if k is not None:
                full.buffers(i, k[:, :, :0], full.values[i][:, :, :0])
        sub = full.rows_copy(rows)
        self.cache, self.lengths = sub, lengths.index_select(0, rows)
        try:
            self.extend(tokens.to(self.device), logits_to_keep=1)
        finally:
            self.cache, self.lengths = full, lengths
        for i, (k, v) in enumerate(zip(sub.keys, sub.values, strict=True)):
            if k is None:
                continue
            if i >= len(full.keys) or full.keys[i] is None:  # a layer first written here
                full.buffers(i, k[:1, :, :0].expand(full.rows, -1, -1, -1),
                             v[:1, :, :0].expand(full.rows, -1, -1, -1))
            full.keys[i].index_copy_(0, rows, k)
            full.values[i].index_copy_(0, rows, v)
        self.lengths = lengths.index_add(0, rows, num_tokens.to(self.device))

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` ([R] long, repeats allowed), e.g. to drop finished rows."""
        assert self.cache is not None
        rows = rows.to(self.device)
        self.cache.select(rows)
        self.lengths = self.lengths.index_select(0, rows)
