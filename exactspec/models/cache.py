"""SlotCache: a preallocated KV cache of per-row slots written by position (gpt-fast style).

One buffer per layer, `[B, heads, slots, head_dim]`, where slot == position. Rollback is free:
rows only move their committed length, and stale slots past it are masked out and overwritten
by the next write. Ragged rows need no masked holes.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache

from exactspec.errors import InvalidValue

# kv_cache= names (es.load, set_kv_cache) -> the dtype of a target's cache buffers (None: the
# states' own, float32 on our kernels)
KV_CACHES = {"float32": None, "bfloat16": torch.bfloat16}
_KV_ATTR = "_exactspec_kv_cache"  # on a transformers model: its target cache's dtype, if set


def kv_cache_dtype(module) -> torch.dtype | None:
    """The dtype `set_kv_cache` gave this transformers model's target cache (None: unset, the
    states' own, float32 on our kernels)."""
    return getattr(module, _KV_ATTR, None)


def kv_dtype_named(kv_cache: str) -> torch.dtype | None:
    """The buffers' dtype `kv_cache` names (KV_CACHES); InvalidValue for another name."""
    if kv_cache not in KV_CACHES:
        raise InvalidValue(f"kv_cache={kv_cache!r} must be one of {list(KV_CACHES)}")
    return KV_CACHES[kv_cache]


def mark_kv_cache(module, kv_cache: str) -> None:
    """Give this transformers model's target cache the dtype named by `kv_cache`."""
    setattr(module, _KV_ATTR, kv_dtype_named(kv_cache))


class SlotCache(Cache):
    """KV cache of per-row slots written by position; `update` returns the first `view_len` slots.

    The adapter sets `write_index` ([B, T] slots to write) and `view_len` before each forward.
    """

    def __init__(self, batch_size: int, capacity: int,
                 kv_dtype: torch.dtype | None = None) -> None:
        super().__init__(layers=[])
        self.rows = batch_size  # rows in the buffers
        self.capacity = capacity  # slots allocated per row (grows on demand)
        # the buffers' dtype (None: the states' that first fill them); torch.bfloat16 for a
        # target loaded with kv_cache="bfloat16" (states rounded as they are written)
        self.kv_dtype = kv_dtype
        self.keys: list[torch.Tensor] = []  # per layer, [B, H, capacity, D]
        self.values: list[torch.Tensor] = []  # per layer, [B, H, capacity, D]
        self.write_index: torch.Tensor | None = None  # [B, T] slots the next forward writes
        self.write_start: int | None = None  # set when every row writes at the same slot
        self.view_len = 0  # slots returned to attention by the next forward

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states, value_states: [B, H, T, D]
        k_buf, v_buf = self.buffers(layer_idx, key_states, value_states)
        t = key_states.shape[2]
        if self.write_start is not None:
            k_buf[:, :, self.write_start : self.write_start + t] = key_states
            v_buf[:, :, self.write_start : self.write_start + t] = value_states
        else:
            b, h, _, d = key_states.shape
            idx = self.write_index[:, None, :, None].expand(b, h, t, d)  # [B, H, T, D]
            k_buf.scatter_(2, idx, key_states.to(k_buf.dtype))  # rounded as a copy rounds
            v_buf.scatter_(2, idx, value_states.to(v_buf.dtype))
        return k_buf[:, :, : self.view_len], v_buf[:, :, : self.view_len]

    def buffers(self, layer_idx: int, like: torch.Tensor, value_like: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole [B, H, capacity, D] key and value buffers of a layer, grown to hold
        `view_len` slots; `update` writes them, and so does an operator that writes and reads
        them itself (kernels.decoder_layer). `like` / `value_like`: [B, H, T, D] states of the
        buffers' dtype and device (values: as keys when not given)."""
        while len(self.keys) <= layer_idx:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer_idx] is None or self.keys[layer_idx].shape[2] < self.view_len:
            self._grow(layer_idx, like, like if value_like is None else value_like)
        return self.keys[layer_idx], self.values[layer_idx]

    def _grow(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.capacity = max(self.capacity, self.view_len)
        old_k, old_v = self.keys[layer_idx], self.values[layer_idx]
        b, h, _, d = key_states.shape
        dtype = old_k.dtype if old_k is not None else self.kv_dtype or key_states.dtype
        new_k = key_states.new_zeros(b, h, self.capacity, d, dtype=dtype)
        new_v = value_states.new_zeros(b, h, self.capacity, value_states.shape[-1], dtype=dtype)
        if old_k is not None:
            new_k[:, :, : old_k.shape[2]] = old_k
            new_v[:, :, : old_v.shape[2]] = old_v
        self.keys[layer_idx], self.values[layer_idx] = new_k, new_v

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` ([R] long) of every buffer, in that order (repeats allowed)."""
        self.keys = [k.index_select(0, rows) if k is not None else None for k in self.keys]
        self.values = [v.index_select(0, rows) if v is not None else None for v in self.values]
        self.rows = int(rows.numel())

    def rows_copy(self, rows: torch.Tensor) -> SlotCache:
        """A cache of its own holding a copy of `rows` ([R] long) of every buffer; this one is
        left as it is."""
        sub = copy.copy(self)  # its own lists after select
        sub.select(rows)
        return sub

    def cat(self, other: SlotCache) -> SlotCache:
        """This cache's rows followed by `other`'s, slots padded to the larger capacity."""
        cap = max(self.capacity, other.capacity)
        ref = next((k for k in self.keys + other.keys if k is not None), None)

        def padded(bufs: list, rows: int, i: int) -> torch.Tensor:
            t = bufs[i] if i < len(bufs) else None
            if t is None:  # no forward ran on these rows yet (empty prompts)
                return ref.new_zeros(rows, ref.shape[1], cap, ref.shape[3])
            return torch.cat([t, t.new_zeros(*t.shape[:2], cap - t.shape[2], t.shape[3])], 2)

        out = SlotCache(self.rows + other.rows, cap, self.kv_dtype)
        layers = max(len(self.keys), len(other.keys))
        for name in ("keys", "values"):
            a, b = getattr(self, name), getattr(other, name)
            setattr(out, name, [torch.cat([padded(a, self.rows, i), padded(b, other.rows, i)])
                                for i in range(layers)])
        return out

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.view_len
