"""The decode loop: batching, ragged acceptance, stopping, streaming, logprobs, draft length.

`Decoder` is the engine's one boundary: `generate`, `batch` and the server admit rows (each
with its own budget, stop rule and sampling parameters), step them and drop them through it.
"""

from exactspec.engine.api import TextStream, generate, stream
from exactspec.engine.batch import Row, RowOutput
from exactspec.engine.loop import DecodeConfig, Decoder
from exactspec.engine.results import Generation, GenerationStats

__all__ = ["DecodeConfig", "Decoder", "Generation", "GenerationStats", "Row", "RowOutput",
           "TextStream", "generate", "stream"]
