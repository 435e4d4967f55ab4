"""What QuantizedDraft can be asked for: its weight bits and its backends, in one place.

Read by the drafter (`quantized.py`) and by the command line's --quantized-draft and
--draft-backend flags (`cli/drafter_flags.py`); no torch here, so `exactspec --help` stays fast.
"""

from __future__ import annotations

BITS = {8: "int8", 4: "int4", 16: "bfloat16"}  # bits -> torch weight format, in help order
GGUF_TYPES = {8: "q8_0", 4: "q4_0"}  # bits -> llama.cpp GGUF type (llama.cpp runs these only)
BACKENDS = ("auto", "torch", "llama.cpp")  # QuantizedDraft(backend=...), --draft-backend
GROUP_SIZES = (32, 64, 128, 256)  # int4 groups along the input dimension


def bits_text() -> str:
    """'8 (int8), 4 (int4) or 16 (bfloat16)': the bits a quantized draft takes (messages)."""
    names = [f"{bits} ({fmt})" for bits, fmt in BITS.items()]
    return ", ".join(names[:-1]) + " or " + names[-1]
