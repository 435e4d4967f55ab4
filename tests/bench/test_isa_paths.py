"""`python -m exactspec.bench.isa_paths` as a smoke test: it times every path this CPU offers
and reports (it asserts nothing about speed)."""

from __future__ import annotations

import pytest

from exactspec import kernels
from exactspec.bench.isa_paths import FAR_OFF, PathTime, main, report, time_paths

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="the exactspec kernels are not "
                                "built here (python -m exactspec.kernels)")


def test_every_path_is_timed_and_reported():
    paths = time_paths(hidden=64, layers=2, vocab=256, context=8, repeats=2)
    assert [p.isa for p in paths] == kernels.available_isas()
    assert min(p.ratio for p in paths) == 1.0 and all(p.ms > 0 for p in paths)
    assert all(p.isa in report(paths) for p in paths)


def test_the_command_prints_every_path(capsys):
    assert main(["--layers", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert all(isa in out for isa in kernels.available_isas())


def test_the_kernels_command_checks_every_path_after_its_build(capfd):
    from exactspec.kernels import build

    assert build.main(["--check", "--layers", "1", "--repeats", "1"]) == 0
    out = capfd.readouterr().out
    assert out.startswith("exactspec kernels: ") and " threads, 1 layers" in out
    assert all(isa in out.split("\n", 1)[1] for isa in kernels.available_isas())
    assert out.rstrip().splitlines()[-1].startswith(("every path within", "far off"))
    assert build.main([]) == 0 and "one-token step" not in capfd.readouterr().out


@pytest.mark.parametrize(("argv", "says"), [
    (["--threads", "2"], "--threads only go with --check"),
    (["--check", "--layers", "0"], "--layers must be at least 1, got 0"),
    (["--check", "--repeats", "-1"], "--repeats must be at least 1, got -1"),
])
def test_the_kernels_command_refuses_what_it_would_ignore_or_cannot_run(argv, says, capsys):
    from exactspec.kernels import build

    with pytest.raises(SystemExit) as exc:
        build.main(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_a_path_far_off_the_fastest_is_named():
    text = report([PathTime("avx512", 10.0, 1.0), PathTime("avx2", 16.0, 1.6),
                   PathTime("portable", 14.0, 1.4)])
    assert text.splitlines()[-1] == f"far off (over {FAR_OFF}x the fastest): avx2"
    assert report([PathTime("avx2", 1.0, 1.0)]).endswith(f"within {FAR_OFF}x of the fastest")
