"""A test that crashes its worker process fails alone; the run goes on.

Native code (llama.cpp, our kernels, torch) can kill a pytest-xdist worker with a signal.
xdist's `--dist loadfile` scheduler then puts the crashed test back in the queue with the rest
of its file, so the next worker runs it again and dies too, until the restart limit ends the
whole run; and it hands work to a replacement worker before that worker has collected
(`KeyError: <WorkerController gwN>`, an INTERNALERROR). This scheduler reports the crashed test
as failed once (xdist's report names the worker and the test), never runs it again, re-queues
only the rest of its file, and gives work to a worker only once it has collected.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling


class CrashSafeLoadFile(LoadFileScheduling):
    """`--dist loadfile` whose crashed test is failed once and not run again."""

    def remove_node(self, node) -> str | None:
        workload = self.assigned_work.pop(node)
        crashed = next((nodeid for unit in workload.values()
                        for nodeid, done in unit.items() if not done), None)
        if crashed is None:  # shut down with nothing pending
            return None
        for unit in workload.values():
            if crashed in unit:
                unit[crashed] = True  # reported as failed by xdist; never run again
        self.workqueue.update({scope: unit for scope, unit in workload.items()
                               if not all(unit.values())})
        for other in self.assigned_work:
            if other in self.registered_collections:  # a replacement gets work once collected
                self._reschedule(other)
        return crashed


@pytest.hookimpl(optionalhook=True)  # unknown where xdist is off (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
        return CrashSafeLoadFile(config, log)
    return None
