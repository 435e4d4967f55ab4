"""Suite-wide: the longest test files run first.

`make test` runs two workers that take whole files (`-n 2 --dist loadfile`) in collection
order. The longest files sorted last alphabetically (tests/test_readme.py, 2-2.5 min) could
start when the other worker had little left, which then idled: the suite's wall time grew by
up to one long file. Started first, the long files run side by side and the short ones fill
in behind them. The list is by measured duration (fresh-clone CI of 2026-12-02); a file not
in it keeps its place after them.
"""

from __future__ import annotations

LONGEST_FIRST = (  # seconds in the fresh-clone run of 2026-12-02 (both workers' sum, rough)
    "tests/models/test_lean_architectures.py",  # 160 (gemma3 converted, its laws)
    "tests/test_readme.py",  # 140 (every example, the README's server)
    "tests/drafters/test_cross_vocab_real.py",  # 130 (first-token laws on gemma3)
    "tests/serve/test_replicas.py",  # 35 (a local Ray cluster)
    "tests/serve/test_process.py",  # 35 (servers in their own processes)
    "tests/models/test_architecture_real.py",  # 25
    "tests/models/test_embedded.py",  # 35
    "tests/batch/test_ray.py",  # 20
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}

    def key(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(LONGEST_FIRST))

    items.sort(key=key)  # stable: the rest keep their order


pytest_plugins = ["tests.crash_safe"]  # a worker's crash fails its test, not the run
