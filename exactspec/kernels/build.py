"""Build the C++ kernels for this machine's CPU: `python -m exactspec.kernels`.

Each ISA unit (`csrc/isa_*.cpp`) is compiled on its own with its own instruction-set flags
(run-time dispatch picks one, see `csrc/ops.cpp`), then the torch operators (`csrc/ops.cpp`)
are compiled and linked against them with torch's cpp_extension (ninja). Everything is built
here, from source, into `build_dir()` (under the virtualenv by default); a build is named by a
digest of the sources, flags and torch version, so a changed source is rebuilt and a stale
library is never loaded. `-ffp-contract=off` everywhere: the only fused multiply-adds are the
explicit ones, so every unit computes the same arithmetic.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
COMMON = ["-O3", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fno-math-errno",
          "-fno-trapping-math"]
VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vnni", "-mavx2", "-mfma"]
AMX_FLAGS = ["-mamx-tile", "-mamx-bf16", "-mavx512bf16"]  # the amx unit's, where taken
BF16_FLAGS = ["-mavx512bf16"]  # the avx512bf16 unit's, where taken
EXTRA_FLAGS = {"amx": AMX_FLAGS, "avx512bf16": BF16_FLAGS}  # else the unit says built = false
ISA_FLAGS = {  # unit -> its instruction-set flags, the first choice first (csrc/ops.cpp kUnits)
    "amx": VNNI_FLAGS,  # + AMX_FLAGS
    "avx512bf16": VNNI_FLAGS,  # + BF16_FLAGS
    "avx512vnni": VNNI_FLAGS,
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx2", "-mfma"],
    "avx2": ["-mavx2", "-mfma"],
    "portable": [],
}
# the operators' unit: OpenMP on, or at::parallel_for (inline, `#pragma omp`) runs serially;
# linked against the libgomp torch already loaded (same soname), so torch.set_num_threads
# governs our threads as well; -fno-trapping-math (as COMMON) lets loops with comparisons be
# vectorized (ops_quant.cpp), no value changes
OPS_FLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp"]
# the operators' units
OPS_SOURCES = ("ops.cpp", "ops_act.cpp", "ops_layer.cpp", "ops_draft.cpp", "ops_quant.cpp")


def build_dir() -> Path:
    """Where the library is built: $EXACTSPEC_KERNELS_DIR, else <sys.prefix>/exactspec-kernels."""
    env = os.environ.get("EXACTSPEC_KERNELS_DIR")
    return Path(env) if env else Path(sys.prefix) / "exactspec-kernels"


def digest() -> str:
    """A digest of everything the library depends on (sources, flags, torch, Python)."""
    h = hashlib.sha256()
    for p in sorted(CSRC.iterdir()):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(repr((COMMON, ISA_FLAGS, EXTRA_FLAGS, OPS_FLAGS, OPS_SOURCES, torch.__version__, sys.version_info[:2])).encode())
    return h.hexdigest()[:12]


def library_name() -> str:
    return f"exactspec_kernels_{digest()}"


def library_path() -> Path:
    return build_dir() / library_name() / f"{library_name()}.so"


def failure_path() -> Path:
    """Written when a build failed, so later processes do not retry it (the build command does)."""
    return build_dir() / f"{library_name()}.failed"


def build(verbose: bool = False) -> Path:
    """Compile (if not built yet) and load the library; returns its path. A failure is
    recorded in `failure_path()` and raised."""
    try:
        return _build(verbose)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        failure_path().parent.mkdir(parents=True, exist_ok=True)
        failure_path().write_text(f"{type(exc).__name__}: {exc}\n")
        raise


def _compiler_takes(cxx: str, flags: list[str]) -> bool:
    """Whether `cxx` accepts `flags` (an older compiler may not know AMX's)."""
    probe = subprocess.run([cxx, *flags, "-x", "c++", "-fsyntax-only", "-"], input=b"int x;\n",
                           capture_output=True, check=False)
    return probe.returncode == 0


def _build(verbose: bool) -> Path:
    from torch.utils import cpp_extension

    name = library_name()
    out = build_dir() / name
    out.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", "c++")
    objects, jobs = [], []  # the ISA units compile side by side (each is one process)
    for unit, flags in ISA_FLAGS.items():
        extra = EXTRA_FLAGS.get(unit)
        if extra and _compiler_takes(cxx, extra):
            flags = [*flags, *extra]  # else the unit says <unit>::built = false
        obj = out / f"isa_{unit}.o"
        if not obj.is_file():
            tmp = obj.with_suffix(f".{os.getpid()}.tmp")
            cmd = [cxx, *COMMON, *flags, "-c", str(CSRC / f"isa_{unit}.cpp"), "-o", str(tmp)]
            log.info("compiling %s", " ".join(cmd))
            jobs.append((subprocess.Popen(cmd), cmd, tmp, obj))
        objects.append(str(obj))
    failed = None
    for proc, cmd, tmp, obj in jobs:
        if proc.wait() != 0:
            failed = failed or subprocess.CalledProcessError(proc.returncode, cmd)
        else:
            tmp.replace(obj)
    if failed is not None:
        raise failed
    cpp_extension.load(name=name, sources=[str(CSRC / f) for f in OPS_SOURCES],
                       extra_cflags=OPS_FLAGS,
                       extra_ldflags=[*objects, "-fopenmp"], build_directory=str(out),
                       is_python_module=False, verbose=verbose)
    return library_path()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m exactspec.kernels", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  python -m exactspec.kernels                 # build (or find) the library\n"
               "  python -m exactspec.kernels --check         # then time a step on every path\n"
               "  python -m exactspec.kernels --check --threads 1 --layers 4")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    parser.add_argument("--check", action="store_true",
                        help="after the build, time a one-token step on every instruction-set "
                             "path this CPU offers and name any path far off the fastest "
                             "(python -m exactspec.bench.isa_paths; it reports, asserts nothing)")
    parser.add_argument("--threads", type=int, default=None,
                        help="--check: torch threads (default: torch's choice)")
    parser.add_argument("--layers", type=int, default=None, help="--check: decoder layers (30)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="--check: timed steps a path (9)")
    args = parser.parse_args(argv)
    # the --check options given: {"--threads": 2, ...}
    given = {f"--{n}": getattr(args, n) for n in ("threads", "layers", "repeats")
             if getattr(args, n) is not None}
    if given and not args.check:
        parser.error(f"{' / '.join(given)} only go with --check (add --check, or drop them)")
    for flag, value in given.items():
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    failure_path().unlink(missing_ok=True)
    path = build(verbose=args.verbose)
    isa = torch.ops.exactspec.current_isa()
    sys.stdout.write(f"exactspec kernels: {path} (ISA {isa}, available "
                     f"{list(torch.ops.exactspec.available_isas())})\n")
    if not args.check:
        return 0
    # the check times a model's step (the models layer, above this one): its own command, run
    # as a child process in this environment
    sys.stdout.flush()
    check = [arg for flag, value in given.items() for arg in (flag, str(value))]
    return subprocess.run([sys.executable, "-m", "exactspec.bench.isa_paths", *check],
                          check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
