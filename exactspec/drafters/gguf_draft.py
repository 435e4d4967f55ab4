"""GgufDraft: the target's own GGUF file, run by llama.cpp, drafts for the target.

The embedded models are GGUF files whose blocks exactspec dequantizes to float32 to make the
target. llama.cpp runs the very same blocks natively (4-bit dot products, several times cheaper
a token than the float32 target: docs/performance.md), so as a draft it is cheap and agrees
with the target nearly always. Only its logits are used: q is standardized by
exactspec's own `probs_from_logits` with the target's parameters and history, and the draft
token is drawn by exactspec from q, so verification stays exact whatever llama.cpp computes.

Caveat, stated wherever its figures are quoted: the target here *is* the dequantized GGUF, so
this draft's agreement is higher than a 4-bit copy of a model trained in 16 bits would give
(that case is `QuantizedDraft`'s fresh int4 / int8 quantization).

Needs the optional `llama-cpp-python` package (`make llama-cpp` compiles llama.cpp for this
CPU). Rows are llama.cpp sequences of one context: one `llama_decode` per draft
position for the whole batch; rollback is `llama_memory_seq_rm` past the agreeing prefix.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import threading
import weakref
from pathlib import Path

import numpy as np
import torch

from exactspec.drafters import llama_cpp_check
from exactspec.drafters.base import DraftContext, TargetInfo, empty_proposal
from exactspec.errors import InvalidValue

log = logging.getLogger(__name__)

SEQ_PER_CONTEXT = 64  # rows per llama.cpp context (it caps sequences per context)
_MODELS: dict[str, object] = {}  # GGUF path -> loaded llama_model pointer (once per process)
_LOCK = threading.Lock()


def llama_cpp_available() -> bool:
    """Whether llama.cpp is installed and its build passed the smoke test on this machine
    (drafters/llama_cpp_check.py: a build that crashes is never used)."""
    return llama_cpp_check.status().usable


def llama_cpp_why() -> str:
    """One line: why llama.cpp is unusable here (or what its smoke test passed)."""
    return llama_cpp_check.status().why


def _lib():
    verdict = llama_cpp_check.status()
    if not verdict.usable:
        raise InvalidValue(f"the llama.cpp draft cannot run here: {verdict.why}; or use "
                           "QuantizedDraft(bits=8) (torch int8, no compilation)")
    import llama_cpp

    return llama_cpp


def _load_model(path: str):
    lib = _lib()
    with _LOCK:
        if path not in _MODELS:
            lib.llama_backend_init()
            _quiet(lib)
            params = lib.llama_model_default_params()
            params.n_gpu_layers = 0
            model = lib.llama_model_load_from_file(path.encode(), params)
            if not model:
                raise InvalidValue(f"llama.cpp could not load {path!r} as a GGUF model")
            _MODELS[path] = model
        return _MODELS[path]


def unload(path: str) -> None:
    """Free a model `_load_model` loaded (after a weight update made its file stale)."""
    with _LOCK:
        model = _MODELS.pop(path, None)
        if model is not None:
            _lib().llama_model_free(model)


_LOG_CALLBACK = None  # kept alive: llama.cpp holds the pointer


def _quiet(lib) -> None:
    """Route llama.cpp's own log lines (it prints model details to stderr) to nowhere."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = lib.llama_log_callback(lambda level, text, data: None)
        lib.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


_LIVE: weakref.WeakSet = weakref.WeakSet()  # drafts that may hold llama.cpp contexts


@atexit.register
def _free_at_exit() -> None:
    """Free every draft's contexts at interpreter exit while llama_cpp is still whole: a
    `__del__` run later, during shutdown, finds its functions torn down (None)."""
    for draft in list(_LIVE):
        draft.free()


class GgufDraft:
    """Drafts with llama.cpp running a GGUF file of the target (see the module docstring).

    gguf: path of the GGUF, or an embedded model name ("smollm2-135m"); its vocabulary must be
    the target's. threads: llama.cpp threads (default: torch's thread count).
    """

    standardized_q = True  # q made by exactspec, not re-checked (base.trusts_q)

    hidden_layers = None  # needs no target features

    def __init__(self, gguf: str | os.PathLike[str] = "smollm2-135m", *,
                 threads: int | None = None) -> None:
        self.path = _resolve(gguf)  # the GGUF file llama.cpp runs
        self.threads = threads  # llama.cpp threads, None = torch's
        self._lib = _lib()
        self._model = _load_model(self.path)
        vocab = self._lib.llama_model_get_vocab(self._model)
        self.vocab_size = int(self._lib.llama_vocab_n_tokens(vocab))  # llama.cpp's logits width
        self._ctxs: list = []  # llama.cpp contexts, SEQ_PER_CONTEXT rows each
        self._mems: list = []  # their KV memories
        self._caps: list[int] = []  # their batch capacities (tokens per llama_decode)
        self._where: list[tuple[int, int]] = []  # per row: (context index, sequence id)
        self._slots: list[int] = []  # per context: KV slots per sequence
        self._counts: list[int] = []  # per context: its sequences
        self._fed: torch.Tensor | None = None  # [B, S] long: tokens in each row's draft cache
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"GgufDraft({Path(self.path).name!r})"

    def __del__(self) -> None:
        # nothing left after `_free_at_exit` (interpreter exit, when llama_cpp and this
        # module's globals may already be torn down): then touch nothing
        if self.__dict__.get("_ctxs"):
            self.free()

    def free(self) -> None:
        """Free its llama.cpp contexts (the model stays loaded: `unload`); `begin` makes new
        ones."""
        for ctx in getattr(self, "_ctxs", []):
            self._lib.llama_free(ctx)
        self._ctxs = []

    _free = free  # the former name (tests/models/test_gguf_export.py frees a draft with it)

    def begin(self, context: DraftContext, target: TargetInfo) -> None:
        if self.vocab_size != target.vocab_size:
            raise InvalidValue(
                f"vocabulary mismatch: the GGUF {Path(self.path).name!r} has {self.vocab_size} "
                f"tokens, the target {target.vocab_size}; give the target's own GGUF")
        self.free()
        b, width = context.tokens.shape
        self._ctxs, self._mems, self._caps, self._slots, self._counts = [], [], [], [], []
        self._where = self._new_contexts(max(b, 1), width)[:b]
        self._fed = torch.full((b, width), -1, dtype=torch.long)

    def admit(self, context: DraftContext, target: TargetInfo, start: int) -> None:
        """Rows start.. are new: each takes a free llama.cpp sequence (one a dropped row left,
        if its context is wide enough, else in a new context), filled at its next propose;
        the running rows keep theirs."""
        assert self._fed is not None, "begin() first"
        b, width = context.tokens.shape
        used = set(self._where)
        free = [(c, seq) for c, slots in enumerate(self._slots) if slots >= width + 8
                for seq in range(self._counts[c]) if (c, seq) not in used]
        if len(free) < b - start:
            free += self._new_contexts(b - start - len(free), width)
        for c, seq in free[: b - start]:  # what a dropped row left there
            self._lib.llama_memory_seq_rm(self._mems[c], seq, -1, -1)
        self._where += free[: b - start]
        fed = torch.full((b, max(width, self._fed.shape[1])), -1, dtype=torch.long)
        fed[:start, : self._fed.shape[1]] = self._fed
        self._fed = fed

    def _new_contexts(self, rows: int, width: int) -> list[tuple[int, int]]:
        """Contexts for `rows` more rows of up to `width` tokens; their (context, sequence)."""
        lib = self._lib
        per_row = -(-(width + 8) // 256) * 256  # slots per row, rounded up
        out = []
        for lo in range(0, rows, SEQ_PER_CONTEXT):  # llama.cpp caps sequences per context
            n = min(SEQ_PER_CONTEXT, rows - lo)
            params = lib.llama_context_default_params()
            params.n_ctx = per_row * n
            params.n_batch = params.n_ubatch = min(max(per_row * n, 512), 8192)
            params.n_seq_max = n
            params.n_threads = params.n_threads_batch = self.threads or torch.get_num_threads()
            params.no_perf = True
            ctx = lib.llama_init_from_model(self._model, params)
            if not ctx:
                raise InvalidValue(f"llama.cpp could not make a context of {params.n_ctx} tokens")
            c = len(self._ctxs)
            self._ctxs.append(ctx)
            self._mems.append(lib.llama_get_memory(ctx))
            self._caps.append(params.n_batch)
            self._slots.append(per_row)
            self._counts.append(n)
            out += [(c, seq) for seq in range(n)]
        return out

    def select(self, rows: torch.Tensor) -> None:
        """Keep `rows` (unique indices: the engine only ever drops rows)."""
        assert self._fed is not None
        rows = rows.cpu().tolist()
        assert len(set(rows)) == len(rows), "GgufDraft.select takes each row once"
        kept = set(rows)
        for r, (c, seq) in enumerate(self._where):
            if r not in kept:
                self._lib.llama_memory_seq_rm(self._mems[c], seq, -1, -1)
        self._where = [self._where[r] for r in rows]
        self._fed = self._fed[rows] if rows else self._fed[:0]

    @torch.inference_mode()
    def propose(self, context: DraftContext, num_tokens: torch.Tensor,  # [B]
                ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K] -1 padded, [B, K, V]
        assert self._ctxs and self._fed is not None, "begin() first"
        dev = context.tokens.device
        drafts, q = empty_proposal(num_tokens, self.vocab_size, dev)  # [B, K], [B, K, V]
        k = drafts.shape[1]
        if k == 0:
            return drafts, q
        tokens = context.tokens.cpu()  # [B, T]
        lengths = context.lengths.cpu().tolist()  # [B]
        if self._fed.shape[1] < tokens.shape[1] + k:
            grow = tokens.shape[1] + k - self._fed.shape[1]
            self._fed = torch.cat([self._fed, torch.full((len(lengths), grow), -1)], 1)
        # roll back each row to the prefix its cache agrees on (never its last token); a row
        # that drafts nothing now is not fed (its sequence catches up when it next drafts)
        nums = num_tokens.cpu().tolist()  # [B]
        feeds = []
        for i, n in enumerate(lengths):
            if nums[i] <= 0:
                feeds.append((0, []))
                continue
            agree = int((self._fed[i, :n] == tokens[i, :n]).long().cumprod(0).sum())
            keep = min(agree, n - 1)
            c, seq = self._where[i]
            self._lib.llama_memory_seq_rm(self._mems[c], seq, keep, -1)
            self._fed[i, keep:] = -1
            feeds.append((keep, tokens[i, keep:n].tolist()))
        logits = self._decode(feeds)  # [B, V]
        for j in range(k):
            q_j = context.standardize(logits.to(dev), drafts[:, :j])  # [B, V]
            x = context.draw(q_j, j)  # [B]
            drafts[:, j] = x
            q[:, j] = q_j
            if j + 1 < k:
                xs = x.cpu().tolist()
                logits = self._decode([(lengths[i] + j, [xs[i]] if nums[i] > j + 1 else [])
                                       for i in range(len(xs))])
        want = torch.arange(k, device=dev)[None, :] < num_tokens.to(dev)[:, None]
        return torch.where(want, drafts, -1), q

    def _decode(self, feeds: list[tuple[int, list[int]]]) -> torch.Tensor:  # -> [B, V] float32
        """Feed row i's tokens at positions start_i.. (feeds[i] = (start_i, tokens_i)); the
        logits after each row's last fed token (zeros for a row fed nothing). One llama_decode
        per context and chunk."""
        out = torch.zeros(len(feeds), self.vocab_size, dtype=torch.float32)
        per_ctx: list[list[tuple[int, int, int, bool]]] = [[] for _ in self._ctxs]
        for i, (start, toks) in enumerate(feeds):
            c = self._where[i][0]
            per_ctx[c] += [(i, start + p, t, p == len(toks) - 1) for p, t in enumerate(toks)]
        for c, items in enumerate(per_ctx):
            for lo in range(0, len(items), self._caps[c]):
                self._decode_chunk(c, items[lo: lo + self._caps[c]], out)
        return out

    def _decode_chunk(self, c: int, chunk: list[tuple[int, int, int, bool]],
                      out: torch.Tensor) -> None:
        lib = self._lib
        batch = lib.llama_batch_init(len(chunk), 0, 1)
        try:
            batch.n_tokens = len(chunk)
            outputs = []
            for n, (i, pos, tok, last) in enumerate(chunk):
                batch.token[n] = tok
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = self._where[i][1]
                batch.logits[n] = 1 if last else 0
                if last:
                    outputs.append((n, i))
                self._fed[i, pos] = tok
            rc = lib.llama_decode(self._ctxs[c], batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc}")
            for n, i in outputs:
                ptr = lib.llama_get_logits_ith(self._ctxs[c], n)
                out[i] = torch.from_numpy(
                    np.ctypeslib.as_array(ptr, shape=(self.vocab_size,)).copy())
        finally:
            lib.llama_batch_free(batch)


def _resolve(gguf: str | os.PathLike[str]) -> str:
    """A GGUF file path from a path or an embedded model name."""
    from exactspec.models import registry

    raw = str(gguf)
    if raw in registry.EMBEDDED:
        entry = registry.get(raw)
        chunks = registry.locate_chunks(entry)
        if len(chunks) != 1:
            raise InvalidValue(f"embedded model {raw!r} ships its GGUF in {len(chunks)} pieces; "
                               "assemble it and pass the file's path")
        return str(chunks[0])
    path = Path(raw).expanduser()
    if path.suffix.lower() == ".gguf" and not path.is_file():
        raise InvalidValue(f"the GGUF file {str(path.absolute())!r} does not exist; pass the path "
                           f"of a .gguf file, or an embedded model name "
                           f"({', '.join(registry.known_names())})")
    if not path.is_file() or path.suffix.lower() != ".gguf":
        raise InvalidValue(f"gguf={raw!r} is neither an embedded model name "
                           f"({', '.join(registry.known_names())}) nor a .gguf file")
    return str(path)
