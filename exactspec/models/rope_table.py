"""RoPE's cos / sin read from a table, filled once for every user of it.

torch's cos / sin of a position depend on where it falls in the tensor (a vectorised body and
a scalar tail), so the kernel path of the lean forward (`lean_kernels.rope_rows`) and the
batch-invariant mode's rotary swap (`invariant/mode.py`) do not compute a position's angles
in whatever call first needs them: they read them from a table that the model's own rotary
module fills in fixed chunks of ROPE_CHUNK positions (one shape per call, below torch's
threading grain), here, so a position's angles are the same numbers whichever call, and
whichever of the two, filled them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ROPE_CHUNK = 64  # positions per table fill; 64 * head_dim (<= 256) < torch's grain of 32768
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "ntk")  # inv_freq fixed per model

Table = tuple[torch.Tensor, torch.Tensor]  # cos, sin [P, d] float32
RopeOf = Callable[[torch.Tensor, torch.Tensor], Table]  # (x, positions [1, N]) -> [1, N, d] each


def rope_table(rope_of: RopeOf, need: int, device: torch.device,
               table: Table | None = None) -> Table | None:
    """`table` (None: empty) grown to at least `need` positions by calls of `rope_of` (the
    model's rotary forward, x a float32 scalar) on ROPE_CHUNK positions at a time; the rows
    already there are kept as they are."""
    have = 0 if table is None else table[0].shape[0]
    if need <= have:
        return table
    dummy = torch.zeros((), dtype=torch.float32, device=device)
    cos_parts, sin_parts = ([], []) if table is None else ([table[0]], [table[1]])
    with torch.no_grad():
        for start in range(have, need, ROPE_CHUNK):
            pos = torch.arange(start, start + ROPE_CHUNK, device=device)[None]
            cos, sin = rope_of(dummy, pos)  # [1, ROPE_CHUNK, d]
            cos_parts.append(cos[0].float())
            sin_parts.append(sin[0].float())
    return torch.cat(cos_parts), torch.cat(sin_parts)  # [P, d]
