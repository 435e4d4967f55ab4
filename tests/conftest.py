"""Suite-wide: the longest test files run first.

`make test` runs two workers that take whole files (`-n 2 --dist loadfile`) in collection
order. The longest files sorted last alphabetically (tests/test_readme.py, 2-2.5 min) could
start when the other worker had little left, which then idled: the suite's wall time grew by
up to one long file. Started first, the long files run side by side and the short ones fill
in behind them. The list is by measured duration (`--durations=0`, both workers' sum,
2026-12-06, a suite of 8 min 17 s on a Zen 4); a file not in it keeps its place after them.
"""

from __future__ import annotations

LONGEST_FIRST = (  # seconds of worker time, rough
    "tests/test_readme.py",  # 73 (every example, the README's server)
    "tests/drafters/test_cross_vocab_real.py",  # 68 (first-token laws on gemma3)
    "tests/models/test_lean_architectures.py",  # 63 (gemma3 converted, its laws)
    "tests/models/test_architecture_law.py",  # 52 (every architecture's law)
    "tests/serve/test_replicas.py",  # 36 (a local Ray cluster)
    "tests/audit/test_engine_lossless.py",  # 32
    "tests/serve/test_exact.py",  # 30 (servers' laws)
    "tests/models/test_embedded.py",  # 27
    "tests/serve/test_process.py",  # 24 (servers in their own processes)
    "tests/batch/test_ray.py",  # 21
    "tests/models/test_architecture_real.py",  # 19
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}

    def key(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(LONGEST_FIRST))

    items.sort(key=key)  # stable: the rest keep their order


pytest_plugins = ["tests.crash_safe"]  # a worker's crash fails its test, not the run
