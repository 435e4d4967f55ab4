"""A third-party engine in a child process of its own, so that its native crash loses its own
rows and never the bench.

llama.cpp's AMX product segfaulted on AMX Xeons and took the whole `exactspec bench` with it
(no table, no JSON). The bench now runs such an engine through `Isolated`: the engine is built
in a child process (spawned: a fresh interpreter, nothing inherited but what is sent), each
call is sent over a pipe, and a child that dies raises `EngineCrashed` naming the signal. The
harness then marks that engine crashed, skips its remaining runs and writes every other row.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import traceback
from collections.abc import Callable
from typing import Any


class EngineCrashed(RuntimeError):
    """The engine's child process died (a signal, or exited) during a call."""


def _serve(conn, factory: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """The child: build the engine, then answer (method, args) calls until None."""
    try:
        engine = factory(*args, **kwargs)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    conn.send(("ready", None))
    while (msg := conn.recv()) is not None:
        method, call_args = msg
        try:
            conn.send(("ok", getattr(engine, method)(*call_args)))
        except Exception as e:  # an error in the engine is the caller's to raise
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _death(proc) -> str:
    proc.join(timeout=5)
    code = proc.exitcode
    if code is not None and code < 0:
        return f"crashed with {signal.Signals(-code).name}"
    return f"exited with status {code}"


class Isolated:
    """`factory(*args, **kwargs)` built and called in a child process: `call(method, *args)` returns the
    engine's result, re-raises its Python errors as RuntimeError, raises EngineCrashed when the
    child dies. `close()` ends the child (also at garbage collection)."""

    def __init__(self, name: str, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.name = name  # the engine's name, in messages
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, factory, args, kwargs), daemon=True,
                                 name=f"exactspec-bench {name}")
        self._proc.start()
        child.close()
        self._receive()  # built, or the reason it was not

    def _receive(self) -> Any:
        try:
            kind, value = self._conn.recv()
        except (EOFError, ConnectionError, OSError):
            raise EngineCrashed(f"{self.name}: {_death(self._proc)}") from None
        if kind == "error":
            raise RuntimeError(f"{self.name}: {value}")
        return value

    def call(self, method: str, *args: Any) -> Any:
        try:
            self._conn.send((method, args))
        except (BrokenPipeError, ConnectionError, OSError):
            raise EngineCrashed(f"{self.name}: {_death(self._proc)}") from None
        return self._receive()

    def close(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is None or not proc.is_alive():
            return
        with contextlib.suppress(OSError):
            self._conn.send(None)
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)

    def __del__(self) -> None:
        self.close()
