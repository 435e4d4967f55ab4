"""llama.cpp is used only after its build passed a smoke test on this machine
(drafters/llama_cpp_check.py, llama_cpp_build.py), tested on a stand-in that segfaults at a
given batch size, so the defence holds on every machine, AMX or not: the crash is caught in
the child, a crashing build is rebuilt with AMX off and then disabled, `auto` falls back to
torch, a forced llama.cpp backend is a one-line error, and the verdict is kept per build."""

from __future__ import annotations

import json

import pytest

from exactspec.cli import main
from exactspec.drafters import gguf_draft, llama_cpp_build, llama_cpp_check, quantized_auto
from exactspec.drafters.llama_cpp_build import Build, build_and_check
from exactspec.drafters.llama_cpp_check import Status
from exactspec.drafters.quantized import QuantizedDraft

STANDIN = "tests.drafters.llama_standin:CrashingLlama"
CRASHED = Status(False, "llama.cpp crashed with SIGSEGV in its smoke test at a 100-token Q8_0 "
                        "batch; rebuild it with `make llama-cpp`, or use the torch backend")


def _smoke(monkeypatch, crash_at: int) -> Status:
    monkeypatch.setenv("EXACTSPEC_STANDIN_CRASH_AT", str(crash_at))
    return llama_cpp_check.smoke_test(STANDIN, batches=(1, 7, 64, 100, 512))


def test_the_smoke_test_survives_a_segfault_and_names_the_case(monkeypatch):
    verdict = _smoke(monkeypatch, 100)
    assert not verdict.usable
    assert "crashed with SIGSEGV" in verdict.why and "100-token Q8_0 batch" in verdict.why
    assert "\n" not in verdict.why


def test_the_smoke_test_passes_a_build_that_does_not_crash(monkeypatch):
    verdict = _smoke(monkeypatch, 0)
    assert verdict.usable and "passed" in verdict.why


def test_a_crashing_build_is_rebuilt_with_amx_off_and_kept_when_that_passes(monkeypatch):
    installed, kept = [], []

    def install(build: Build) -> bool:
        installed.append(build.name)
        return True

    def check() -> Status:  # the native build crashes at 100 tokens, AMX off does not
        return _smoke(monkeypatch, 100 if installed[-1] == "native" else 0)

    verdict = build_and_check(llama_cpp_build.builds(amx=True), install, check,
                              lambda v, name: kept.append((v.usable, name)))
    assert installed == ["native", "native, AMX off"]
    assert verdict.usable and verdict.why.endswith("build: native, AMX off")
    assert kept == [(False, "native"), (True, "native, AMX off")]
    assert "-mno-amx-int8" in llama_cpp_build.builds(amx=True)[1].cflags


def test_a_build_that_crashes_both_ways_is_marked_unusable(monkeypatch):
    installed = []

    def install(build: Build) -> bool:
        installed.append(build.name)
        return True

    verdict = build_and_check(llama_cpp_build.builds(amx=True), install,
                              lambda: _smoke(monkeypatch, 64), lambda v, name: None)
    assert installed == ["native", "native, AMX off"]
    assert not verdict.usable and "SIGSEGV" in verdict.why and "64-token" in verdict.why


def test_without_amx_there_is_no_rebuild_and_a_failed_compile_is_said():
    assert [b.name for b in llama_cpp_build.builds(amx=False)] == ["native"]
    verdict = build_and_check(llama_cpp_build.builds(amx=False), lambda b: False,
                              lambda: pytest.fail("nothing was built to check"),
                              lambda v, name: None)
    assert not verdict.usable and "did not build" in verdict.why


def test_the_verdict_is_kept_per_build_and_measured_again_for_another(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libggml-cpu.so").write_bytes(b"one build")
    runs = []
    monkeypatch.setattr(llama_cpp_check, "find_lib_dir", lambda: lib)
    monkeypatch.setattr(llama_cpp_check, "smoke_test", lambda: runs.append(1) or CRASHED)
    llama_cpp_check.status.cache_clear()
    try:
        assert llama_cpp_check.status() == CRASHED and len(runs) == 1
        llama_cpp_check.status.cache_clear()
        assert llama_cpp_check.status() == CRASHED and len(runs) == 1  # read, not measured
        saved = json.loads((lib / llama_cpp_check.VERDICT).read_text())
        assert saved["usable"] is False and saved["why"] == CRASHED.why
        (lib / "libggml-cpu.so").write_bytes(b"another build, another size")
        llama_cpp_check.status.cache_clear()
        llama_cpp_check.status()
        assert len(runs) == 2  # a new build is tested again
    finally:
        llama_cpp_check.status.cache_clear()


@pytest.fixture
def unusable(monkeypatch):
    """llama.cpp installed but its build crashed the smoke test."""
    monkeypatch.setattr(llama_cpp_check, "status", lambda: CRASHED)
    return CRASHED


def test_auto_drafts_with_torch_where_llama_cpp_is_unusable(unusable, monkeypatch):
    monkeypatch.delenv(quantized_auto.ENV, raising=False)
    assert QuantizedDraft(8).backend == "torch" and QuantizedDraft(4).backend == "torch"
    assert not gguf_draft.llama_cpp_available()


def test_a_forced_llama_cpp_backend_is_one_line_naming_cause_and_fix(unusable, monkeypatch):
    with pytest.raises(ValueError, match=r"cannot run here: llama\.cpp crashed with SIGSEGV") as e:
        QuantizedDraft(8, backend="llama.cpp")
    assert "make llama-cpp" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setenv(quantized_auto.ENV, "llama.cpp")
    with pytest.raises(ValueError, match=r"EXACTSPEC_QUANTIZED_BACKEND=llama\.cpp cannot run"):
        QuantizedDraft(4)
    assert QuantizedDraft(8, layers=[0]).backend == "torch"  # not llama.cpp's to draft anyway


def test_the_command_line_refuses_a_forced_llama_cpp_draft_in_one_line(unusable, monkeypatch,
                                                                        capsys):
    monkeypatch.setenv(quantized_auto.ENV, "llama.cpp")
    assert main(["generate", "x" * 600, "--quantized-draft", "8", "--max-new-tokens", "4"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "SIGSEGV" in err[0] and "make llama-cpp" in err[0], err


def test_a_missing_gguf_file_is_named(tmp_path, capsys):
    missing = tmp_path / "missing.gguf"
    assert main(["generate", "hi", "--gguf-draft", str(missing), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"the GGUF file '{missing}' does not exist" in err
