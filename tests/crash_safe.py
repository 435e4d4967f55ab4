"""A test that crashes its worker process fails alone; the run goes on.

Native code (llama.cpp, our kernels, torch) can kill a pytest-xdist worker with a signal.
xdist's `--dist loadfile` scheduler then puts the crashed test back in the queue with the rest
of its file, so the next worker runs it again and dies too, until the restart limit ends the
whole run; and it hands work to a replacement worker before that worker has collected
(`KeyError: <WorkerController gwN>`, an INTERNALERROR). This scheduler reports the crashed test
as failed once (xdist's report names the worker and the test), never runs it again, re-queues
only the rest of its file, gives work to a worker only once it has collected, and does not fail
on a send to a worker that died between two of its events.
"""

from __future__ import annotations

import contextlib

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

    def _assign_work_unit(self, node) -> None:
        """xdist's, but a worker that has not collected yet gets nothing (KeyError in xdist),
        and one that died after its last report and before this send keeps the unit (its
        death, handled next, re-queues it) instead of ending the run with `OSError: cannot
        send (already closed?)`."""
        collection = self.registered_collections.get(node)
        if collection is None:  # a replacement not collected yet: work once it has
            return
        scope, work_unit = self.workqueue.popitem(last=False)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        pending = [collection.index(nodeid) for nodeid, done in work_unit.items() if not done]
        with contextlib.suppress(OSError):
            node.send_runtest_some(pending)


@pytest.hookimpl(optionalhook=True)  # unknown where xdist is off (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
        return CrashSafeLoadFile(config, log)
    return None
