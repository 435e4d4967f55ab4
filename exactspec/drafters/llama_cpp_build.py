"""Build llama.cpp for this machine and keep only a build that passes its smoke test:
`python -m exactspec.drafters.llama_cpp_build` (what `make llama-cpp` and `make test` run).

llama-cpp-python is compiled here from source for this CPU (GGML_NATIVE), without pip's wheel
cache, so a machine with other CPU features never reuses another's build. After each build the
smoke test of `llama_cpp_check` runs in a child process. On a CPU with AMX, a build that fails
it is rebuilt with llama.cpp's AMX path off (GGML_NATIVE still on, `-mno-amx-*`, so no AMX code
is compiled in: llama.cpp 0.3.36's AMX product segfaults on batches of ~100 tokens of Q8_0 /
Q4_0 models there); if that fails too, or on a CPU without AMX, llama.cpp is marked unusable
(one line, why) and everything goes on without it. Always exits 0: llama.cpp is optional.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
from collections.abc import Callable

from exactspec.drafters import llama_cpp_check
from exactspec.drafters.llama_cpp_check import Status

log = logging.getLogger(__name__)

PACKAGE = "llama-cpp-python==0.3.36"
CMAKE_ARGS = ["-DGGML_NATIVE=ON", "-DLLAVA_BUILD=OFF", "-DMTMD_BUILD=OFF", "-DLLAMA_CURL=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
              "-DLLAMA_BUILD_SERVER=OFF"]
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # wins over -march=native's AMX in GCC


@dataclasses.dataclass(frozen=True)
class Build:
    """One way to compile llama.cpp."""

    name: str  # "native", "native, AMX off"
    cmake_args: list[str]  # CMAKE_ARGS for llama-cpp-python's build
    cflags: str = ""  # CFLAGS and CXXFLAGS (CMake's initial C / C++ flags)


def builds(amx: bool) -> list[Build]:
    """The builds to try in order: native, then (on an AMX CPU) native with AMX off."""
    out = [Build("native", CMAKE_ARGS)]
    if amx:
        out.append(Build("native, AMX off", CMAKE_ARGS, NO_AMX))
    return out


def pip_install(build: Build) -> bool:
    """Compile and install llama-cpp-python with `build`'s flags; False when it fails."""
    env = dict(os.environ, CMAKE_ARGS=" ".join(build.cmake_args),
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    if build.cflags:
        env["CFLAGS"] = f"{env.get('CFLAGS', '')} {build.cflags}".strip()
        env["CXXFLAGS"] = f"{env.get('CXXFLAGS', '')} {build.cflags}".strip()
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    if subprocess.run([*pip, "--no-cache-dir", "--force-reinstall", "--no-deps", PACKAGE],
                      env=env).returncode != 0:
        return False
    return subprocess.run([*pip, PACKAGE]).returncode == 0  # its dependencies, no compile


def build_and_check(tries: list[Build], install: Callable[[Build], bool],
                    check: Callable[[], Status], keep: Callable[[Status, str], None]) -> Status:
    """Install each build in turn until one passes `check`; `keep(verdict, build name)` records
    the verdict of the build left installed. The last failure's verdict when none passes."""
    verdict = Status(False, "llama-cpp-python did not build; QuantizedDraft uses its torch "
                            "backend (`make llama-cpp` retries)")
    for i, build in enumerate(tries):
        if not install(build):
            log.warning("llama.cpp (%s) did not build", build.name)
            continue
        verdict = check()
        if verdict.usable:
            verdict = Status(True, f"{verdict.why}; build: {build.name}")
            keep(verdict, build.name)
            return verdict
        rest = tries[i + 1:]
        log.warning("llama.cpp (%s): %s%s", build.name, verdict.why,
                    f"; rebuilding: {rest[0].name}" if rest else "")
        keep(verdict, build.name)
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m exactspec.drafters.llama_cpp_build", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check-only", action="store_true",
                        help="run the smoke test of the installed build, do not compile")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def check() -> Status:
        return llama_cpp_check.smoke_test()

    def keep(verdict: Status, name: str) -> None:
        lib_dir = llama_cpp_check.find_lib_dir()
        if lib_dir is not None:
            llama_cpp_check.save(lib_dir, verdict, name)

    if args.check_only:
        verdict = check()
        keep(verdict, "installed")
    else:
        verdict = build_and_check(builds(llama_cpp_check.cpu_has_amx()), pip_install, check,
                                  keep)
    print(("llama.cpp: " if verdict.usable else "llama.cpp unusable: ") + verdict.why)
    return 0


if __name__ == "__main__":
    sys.exit(main())
