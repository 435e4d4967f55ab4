"""The batch-invariant mode for on-policy RL: the trainer's forward on the engine's numbers.

`batch_invariant()` / `set_batch_invariant(bool)` put a transformers Llama model's own forward
on our invariant CPU operators (`invariant/mode.py` says how and why), and `token_logprobs`
computes the log p of generated tokens exactly as the engine's `Generation.logprobs`.

mode.py      the mode: aten overrides and swaps while it is on (docs/invariant.md)
ops.py       differentiable wrappers of the kernels for the trainer's forward
logprobs.py  `token_logprobs`
"""

from exactspec.invariant.logprobs import token_logprobs
from exactspec.invariant.mode import (
    batch_invariant,
    check_invariant_target,
    is_batch_invariant,
    set_batch_invariant,
    warn_if_uncovered,
)

__all__ = ["batch_invariant", "check_invariant_target", "is_batch_invariant", "set_batch_invariant",
           "token_logprobs", "warn_if_uncovered"]
