"""The decode loop: batching, ragged acceptance, stopping, streaming, logprobs, draft length."""

from exactspec.engine.api import TextStream, generate, stream
from exactspec.engine.results import Generation, GenerationStats

__all__ = ["Generation", "GenerationStats", "TextStream", "generate", "stream"]
