"""Python's cyclic garbage collector around a model's load, in the processes exactspec owns.

Importing torch and transformers and loading a model make ~400k objects that stay alive for the
process; the collections their allocations set off traverse them again and again (~1 s of a
command's ~5 s start), and once they are in the oldest generation every full collection
traverses them all (~0.2 s, a pause in a server's decoding). `collector_paused` turns the
collector off while they are made; `settle` then moves everything alive into the permanent
generation (gc.freeze), which no collection traverses. Only the CLI's commands and the server's
engine processes call `settle`: in a user's own process freezing would also keep the user's
garbage (docs/performance.md, "Python's garbage collector").
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off inside (an explicit gc.collect() still runs), and on afterwards only
    if it was on before."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def settle() -> None:
    """One collection (what is garbage now is freed, not kept), then everything alive (the
    modules, the loaded model) into the permanent generation, out of every later collection's
    way."""
    gc.collect()
    gc.freeze()
