"""Ctrl-C (SIGINT) exits quietly with 130, no traceback; `bench` keeps what it measured so far."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path

from exactspec.bench import Bench, BenchConfig, EngineSpec, Workload
from tests.cli.conftest import exactspec_process
from tests.engine.tiny import tiny_model


class _Reader:
    """Collects a pipe's bytes on a thread, so the test can wait for some output."""

    def __init__(self, pipe) -> None:
        self.data = b""
        self._thread = threading.Thread(target=self._run, args=(pipe,), daemon=True)
        self._thread.start()

    def _run(self, pipe) -> None:
        while chunk := pipe.read1(4096):
            self.data += chunk

    def wait_for(self, ok, proc, timeout: float = 120.0) -> None:
        """Until `ok(text so far)`; fails if `proc` exits first or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while not ok(self.data.decode(errors="replace")):
            assert proc.poll() is None, f"exited with {proc.returncode}: {self.data[-2000:]!r}"
            assert time.monotonic() < deadline, f"timed out; got {self.data[-2000:]!r}"
            time.sleep(0.05)

    def text(self) -> str:
        self._thread.join(timeout=30)
        return self.data.decode(errors="replace")


def test_sigint_during_generate_exits_130_without_traceback(endless_dir) -> None:
    proc = exactspec_process("generate", "hello there", "--model", endless_dir, "--no-chat",
                             "--max-new-tokens", "200000", "--prompt-lookup")
    out, err = _Reader(proc.stdout), _Reader(proc.stderr)
    out.wait_for(lambda text: len(text) >= 20, proc)  # streaming has started
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    stderr = err.text()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert len(out.text()) >= 20


def test_sigint_during_bench_writes_what_was_measured(endless_dir, tmp_path: Path) -> None:
    proc = exactspec_process("--progress", "bench", "--model", endless_dir, "--no-eagle",
                             "--device", "cpu", "--threads", "1", "--draft-layers", "1",
                             "--engines", "exactspec plain,exactspec lookup K=4",
                             "--workloads", "chat", "--out", str(tmp_path))
    out, err = _Reader(proc.stdout), _Reader(proc.stderr)
    # past the warm-up: a few measured runs (the bar's postfix names the mode of each job)
    err.wait_for(lambda text: len(re.findall(r", (?:greedy|t1|t0\.7p0\.9) ", text)) >= 2, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    stderr = err.text()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["interrupted"] is True and result["results"]
    assert (tmp_path / "bench.md").is_file()
    assert "bench interrupted after" in out.text()


def test_bench_run_keeps_the_runs_before_an_interrupt() -> None:
    model = tiny_model(0, layers=2, eos=0)
    work = [Workload("chat", "questions", False, 6, ["why is the sky blue?", "a b c"])]
    cfg = BenchConfig(rounds=1, modes=["greedy"], sweep_ks=[], batch_rows=0, draft_layers=1,
                      prompts_per_workload=None)  # 2 prompts x 2 engines = 4 jobs
    engines = [EngineSpec("exactspec plain", "exactspec", "none"),
               EngineSpec("exactspec lookup K=4", "exactspec", "lookup", 4)]
    bench = Bench(model, cfg, engines=engines, workloads=work, progress=False)
    calls, real = [], bench.runner.run
    warm_ups = len(bench.specs)

    def run_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == warm_ups + 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    bench.runner.run = run_then_interrupt
    result = bench.run()
    assert result["interrupted"] is True
    measured = sum(len(r["tokens_per_second_rounds"]) for r in result["results"])
    assert measured == 2  # the two jobs finished before Ctrl-C, and nothing else
