"""The decode loop: batching, ragged acceptance, stopping, streaming, logprobs, draft length.

`Decoder` is the engine's one boundary: `generate`, `batch` and the server admit rows (each
with its own budget, stop rule and sampling parameters), step them and drop them through it.

api.py        `generate` and `stream`; arguments.py validates their arguments
loop.py       `Decoder`: admit / step / drop; batch.py: `BatchState`, every per-row tensor
step.py       one chain step: propose -> forward -> standardize -> verify -> commit
tree_step.py  the same step for token trees
policy.py     draft length, fixed or "auto" (curves.py: its cost curves); stopping.py: EOS,
              stop strings, budgets
results.py    `Generation` and its stats (mean acceptance length defined once)
session.py    `Engine`: a long-lived engine for RL loops and batch jobs (`update_weights`)
(docs/generate.md)
"""

from exactspec.engine.api import TextStream, generate, stream
from exactspec.engine.batch import Row, RowOutput
from exactspec.engine.loop import DecodeConfig, Decoder
from exactspec.engine.results import Generation, GenerationStats

__all__ = ["DecodeConfig", "Decoder", "Generation", "GenerationStats", "Row", "RowOutput",
           "TextStream", "generate", "stream"]
