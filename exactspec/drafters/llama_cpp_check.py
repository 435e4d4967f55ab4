"""Whether llama.cpp works on this machine: a smoke test of its build, in a child process.

llama.cpp is foreign native code compiled for this CPU (`make llama-cpp`, GGML_NATIVE). Some of
its paths crash on some CPUs: on AMX Xeons, llama.cpp 0.3.36's AMX product segfaults on a
batch of ~100 tokens or more of a Q8_0 or Q4_0 model, which killed pytest workers, the bench
and any process drafting with it. So nothing here uses llama.cpp before its build has passed
this test: a child process loads a small random Llama written as GGUF in every type the project
runs (F32, Q8_0, Q4_0, Q4_1) and decodes batches of 1, 7, 64 and 512 tokens; a signal or a
non-finite logit fails it. The verdict is kept beside the library (keyed by the library files'
size and time and by the CPU), so it is measured once per build and machine.

Where llama.cpp is unusable, everything goes on without it: QuantizedDraft's "auto" picks torch,
a forced llama.cpp backend is a one-line error with `status().why`, the llama.cpp tests skip
with it and the bench leaves its rows out with it. `scripts/build_llama_cpp.py` (make
llama-cpp) builds, runs this test, and rebuilds with llama.cpp's AMX path off when it fails.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

QTYPES = ("f32", "bf16", "q8_0", "q4_0", "q4_1", "q4_k")  # the GGUF types the project runs
# on llama.cpp (the bench rows and the GGUF draft)
BATCHES = (1, 7, 64, 512)  # tokens in one llama_decode
BACKEND = "exactspec.drafters.llama_cpp_check:LlamaBackend"  # what the child decodes with
VERDICT = "exactspec-smoke.json"  # beside the library files
TIMEOUT = 300  # seconds for the whole child


@dataclasses.dataclass(frozen=True)
class Status:
    """The verdict on llama.cpp here."""

    usable: bool  # it passed the smoke test on this machine (this build)
    why: str  # one line: what failed and the fix, or what passed


def find_lib_dir() -> Path | None:
    """llama-cpp-python's shared libraries, found without importing (importing loads them)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def build_key(lib_dir: Path) -> str:
    """The build and the CPU a verdict holds for: the libraries' names, sizes and times, and the
    CPU's model and flags."""
    h = hashlib.sha256()
    for p in sorted(lib_dir.glob("*.so*")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(_cpu_id().encode())
    return h.hexdigest()[:16]


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))  # one copy per distinct line (every core repeats)


def cpu_has_amx() -> bool:
    cpu = _cpu_id()  # /proc/cpuinfo read once
    return " amx_int8" in cpu or " amx_tile" in cpu


def _verdict_path(lib_dir: Path) -> Path:
    return lib_dir / VERDICT


@cache
def status() -> Status:
    """The verdict on this machine's llama.cpp (measured once per build and CPU, then read)."""
    lib_dir = find_lib_dir()
    if lib_dir is None:
        return Status(False, "llama-cpp-python is not installed; `make llama-cpp` compiles it "
                             "for this CPU (~3-8 minutes on 2 cores)")
    key = build_key(lib_dir)
    try:
        saved = json.loads(_verdict_path(lib_dir).read_text())
        if saved.get("key") == key:
            return Status(bool(saved["usable"]), str(saved["why"]))
    except (OSError, ValueError, KeyError):
        pass
    verdict = smoke_test()
    save(lib_dir, verdict)
    return verdict


def save(lib_dir: Path, verdict: Status, build: str = "") -> None:
    """Keep `verdict` beside the library (warns when it cannot be written)."""
    try:
        _verdict_path(lib_dir).write_text(json.dumps(
            {"key": build_key(lib_dir), "usable": verdict.usable, "why": verdict.why,
             "build": build}, indent=1))
    except OSError as e:
        log.warning("could not keep the llama.cpp smoke test's verdict (%s); it runs again "
                    "in the next process", e)


def smoke_test(backend: str = BACKEND, qtypes: tuple[str, ...] = QTYPES,
               batches: tuple[int, ...] = BATCHES) -> Status:
    """Run the smoke test in a child process with `backend` ("module:Class", see LlamaBackend)
    and judge it: usable when the child decoded every type and batch."""
    with tempfile.TemporaryDirectory(prefix="exactspec-llama-smoke-") as tmp:
        cmd = [sys.executable, "-m", "exactspec.drafters.llama_cpp_check", "--child", backend,
               tmp, ",".join(qtypes), ",".join(map(str, batches))]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT,
                                 env=dict(os.environ, PYTHONFAULTHANDLER=""))
        except subprocess.TimeoutExpired:
            return Status(False, f"llama.cpp's smoke test did not finish in {TIMEOUT} s")
        done = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("ok ")]
        if out.returncode == 0:
            return Status(True, f"llama.cpp passed its smoke test ({', '.join(qtypes)} at "
                                f"{', '.join(map(str, batches))} tokens)")
        at = _next_case(done, qtypes, batches)
        if out.returncode < 0:
            cause = f"crashed with {signal.Signals(-out.returncode).name}"
        else:
            tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
            cause = f"failed ({tail[:200]})"
        return Status(False, f"llama.cpp {cause} in its smoke test{at}; rebuild it with "
                             "`make llama-cpp` (which retries with its AMX path off), or use the "
                             "torch backend")


def _next_case(done: list[list[str]], qtypes, batches) -> str:
    """' at a 512-token Q8_0 batch': the case after the last one the child reported."""
    cases = [(q, b) for q in qtypes for b in batches]
    n = len(done)
    if n >= len(cases):
        return ""
    q, b = cases[n]
    return f" at a {b}-token {q.upper()} batch"


class LlamaBackend:
    """The child's real work: llama.cpp decodes a GGUF of each type (a small random Llama,
    shapes like a real model's: every matrix a whole number of 256-value blocks)."""

    def __init__(self, workdir: str) -> None:
        self.workdir = Path(workdir)
        self.lib = importlib.import_module("llama_cpp")
        self.lib.llama_backend_init()
        self._cb = self.lib.llama_log_callback(lambda level, text, data: None)
        self.lib.llama_log_set(self._cb, None)

    def gguf(self, qtype: str) -> Path:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from exactspec.models.gguf_export import export_gguf

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=768,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=1024, tie_word_embeddings=False)
        path = self.workdir / f"smoke-{qtype}.gguf"
        export_gguf(LlamaForCausalLM(cfg).eval(), path, qtype)
        return path

    def decode(self, path: Path, tokens: int) -> None:
        """One llama_decode of `tokens` tokens; raises on an error or a non-finite logit."""
        import numpy as np

        lib = self.lib
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = lib.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = max(256, tokens)
        cp.n_threads = cp.n_threads_batch = max(1, min(2, os.cpu_count() or 1))
        ctx = lib.llama_init_from_model(model, cp)
        batch = lib.llama_batch_init(tokens, 0, 1)
        try:
            batch.n_tokens = tokens
            for n in range(tokens):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = (7 * n + 3) % 1024, n, 1
                batch.seq_id[n][0] = 0
                batch.logits[n] = n == tokens - 1
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError(f"llama_decode of {tokens} tokens failed")
            logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, tokens - 1),
                                           shape=(1024,))
            if not np.isfinite(logits).all():
                raise RuntimeError(f"non-finite logits after {tokens} tokens")
        finally:
            lib.llama_batch_free(batch)
            lib.llama_free(ctx)
            lib.llama_model_free(model)


def _child(backend: str, workdir: str, qtypes: str, batches: str) -> None:
    """The child process: every type and batch in order, one 'ok TYPE BATCH' line each."""
    module, name = backend.split(":")
    runner = getattr(importlib.import_module(module), name)(workdir)
    for qtype in qtypes.split(","):
        path = runner.gguf(qtype)
        for tokens in map(int, batches.split(",")):
            runner.decode(path, tokens)
            print("ok", qtype, tokens, flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        _child(*sys.argv[2:])
    else:
        print(status().why)
