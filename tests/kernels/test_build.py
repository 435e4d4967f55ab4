"""The set-up side: an instruction set forced by EXACTSPEC_KERNEL_ISA, and a failed build (no
compiler) falling back to the torch path with one warning line, in fresh processes."""

from __future__ import annotations

import os
import subprocess
import sys

from exactspec import kernels

LEAN = ("import logging, torch; logging.basicConfig(level=logging.WARNING);"
        "from exactspec.models.lean import LeanLlama; from tests.engine.tiny import tiny_llama;"
        "m = tiny_llama(0); a, b = LeanLlama(m), LeanLlama(m);"
        "print('kernels', a.kernels, b.kernels)")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300, check=True)


def test_isa_forced_by_the_environment():
    name = kernels.available_isas()[-1]  # "portable": never the automatic choice on x86-64
    out = _run("from exactspec import kernels; kernels.enabled();"
               "print(kernels.current_isa())", EXACTSPEC_KERNEL_ISA=name)
    assert out.stdout.split() == [name]


def test_a_unit_not_taken_is_said_once():
    """EXACTSPEC_KERNEL_ISA naming no unit, or one this CPU does not run: the kernels run on the
    best unit and one warning line says which name was not taken and why."""
    code = ("import logging; logging.basicConfig(level=logging.WARNING);"
            "from exactspec import kernels; kernels.enabled(); kernels.enabled();"
            "print(kernels.current_isa())")
    out = _run(code, EXACTSPEC_KERNEL_ISA="avx9000")
    assert out.stdout.split() == [kernels.available_isas()[0]]
    said = [line for line in out.stderr.splitlines() if "EXACTSPEC_KERNEL_ISA" in line]
    assert len(said) == 1 and "avx9000: not a unit;" in said[0], out.stderr
    missing = [u for u in kernels.UNITS if u not in kernels.available_isas()]
    if missing:  # a unit this CPU lacks (amx off an AMX machine, say)
        out = _run(code, EXACTSPEC_KERNEL_ISA=missing[0])
        assert f"{missing[0]}: not a unit this CPU (or build) runs" in out.stderr, out.stderr
    # taken, or not set: nothing said
    assert kernels.forced_isa_note("portable", "portable", ["portable"]) is None
    assert kernels.forced_isa_note(None, "avx2", ["avx2", "portable"]) is None
    assert kernels.forced_isa_note("auto", "avx2", ["avx2", "portable"]) is None


def test_failed_build_falls_back_with_one_warning_line(tmp_path):
    out = _run(LEAN, EXACTSPEC_KERNELS_DIR=str(tmp_path), CXX="false")
    assert out.stdout.split() == ["kernels", "False", "False"]
    warnings = [line for line in out.stderr.splitlines() if "exactspec kernels" in line]
    assert len(warnings) == 1 and "not built" in warnings[0], out.stderr
    # the failure is remembered: the next process does not try again, and says why
    again = _run(LEAN, EXACTSPEC_KERNELS_DIR=str(tmp_path), CXX="false")
    assert "the build failed earlier" in again.stderr
