"""Pieces of the serving stack that need no server: the replicas' /metrics merge, the llama.cpp
comparison server's discovery, bench-serve's target checks, /metrics through prometheus_client."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exactspec.engine.results import GenerationStats
from exactspec.serve.bench import targets
from exactspec.serve.llama_server import gguf_of, llama_server_missing
from exactspec.serve.metrics import Metrics


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_keep_their_names_and_count():
    m = Metrics()
    m.count("requests", "stop", 2)
    m.count("rejected", "queue_full")
    m.count("drafter_faults", "step")
    stats = GenerationStats()
    stats.record_step(3, 2, 3, 0.0, 0.0, 0.0, 0.1)
    m.observe_row(stats)
    m.observe_steps(2, 0.2)
    m.ttft.observe(0.3)
    got = _samples(m.render())
    assert got[("exactspec:request_success_total", (("finished_reason", "stop"),))] == 2
    assert got[("exactspec:request_rejected_total", (("reason", "queue_full"),))] == 1
    assert got[("exactspec:drafter_faults_total", (("where", "step"),))] == 1
    assert got[("exactspec:spec_decode_num_draft_tokens_total", ())] == 3
    assert got[("exactspec:spec_decode_num_accepted_tokens_total", ())] == 2
    assert got[("exactspec:engine_steps_total", ())] == 2
    assert got[("exactspec:engine_step_seconds_count", ())] == 2
    assert got[("exactspec:time_to_first_token_seconds_bucket", (("le", "0.5"),))] == 1
    assert got[("exactspec:time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 0
    assert got[("exactspec:spec_decode_mean_acceptance_length", ())] == 3.0
    assert Metrics().render() != m.render()  # each server has its own registry


def test_replica_metrics_are_summed():
    from exactspec.serve.replicas import _Merged

    a, b = Metrics(), Metrics()
    a.count("requests", "stop", 3)
    b.count("requests", "stop", 4)
    b.count("requests", "length", 1)
    a.ttft.observe(0.1)
    b.ttft.observe(2.0)
    a.peak_batch_rows, b.peak_batch_rows = 5, 9
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged([a.render(), b.render()]))
    got = _samples(generate_latest(registry).decode())
    assert got[("exactspec:request_success_total", (("finished_reason", "stop"),))] == 7
    assert got[("exactspec:request_success_total", (("finished_reason", "length"),))] == 1
    assert got[("exactspec:time_to_first_token_seconds_count", ())] == 2
    assert got[("exactspec:time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 1
    assert got[("exactspec:num_batch_rows_peak", ())] == 9  # a maximum, not a sum
    assert got[("exactspec:replicas", ())] == 2


def test_llama_server_discovery(tmp_path):
    missing = llama_server_missing()
    assert missing is None or "needs" in missing
    assert gguf_of(str(tmp_path / "no.gguf")) is None
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert gguf_of(str(f)) == f
    assert gguf_of(str(tmp_path)) is None  # a transformers directory: no GGUF to give it


def test_bench_targets_are_checked():
    row = {"failed": 0}
    summary = {"spec": {c: row for c in ("1", "4", "16", "64")},
               "plain": {c: row for c in ("1", "4", "16", "64")}}
    speed = {"1": 1.9, "4": 1.02, "16": 0.97, "64": 1.1}
    t = targets(summary, "spec", speed, {"16": 1.1})
    assert [v["met"] for v in t.values()] == [True, True, False, True, True, True]
    assert t["speedup at 16 streams >= 1.0"]["value"] == pytest.approx(0.97)


def test_a_server_process_that_exits_at_start_says_why():
    """bench-serve's servers run in their own processes (serve/process.py); one that dies
    while loading is a RuntimeError carrying its exit status and the end of its output."""
    import sys

    from exactspec.serve.process import ServerProcess

    class Broken(ServerProcess):
        name = "test server"

        def command(self):
            return [sys.executable, "-c", "import sys; print('no such model: x'); sys.exit(3)"]

    srv = Broken(start_timeout=30)
    with pytest.raises(RuntimeError, match=r"the test server exited with 3: no such model: x"):
        srv.__enter__()
    assert srv.log is None and srv.proc.poll() == 3  # its output file closed


@pytest.mark.parametrize("drafter, k, calibrates", [(True, "auto", True), (True, 3, False),
                                                    (False, 0, False)])
def test_the_engine_calibrates_auto_draft_lengths_before_serving(monkeypatch, drafter, k,
                                                                 calibrates):
    """With a drafter and auto K the engine thread measures every verify width at one row
    (Decoder.calibrate) before the first request; with a fixed K or no drafter it does not."""
    from exactspec.drafters import PromptLookup
    from exactspec.engine.decoder import Decoder
    from exactspec.serve import EngineConfig, ServingEngine
    from tests.engine.tiny import tiny_model

    seen = []
    real = Decoder.calibrate

    def calibrate(self, prompt, **kw):
        seen.append(len(prompt))
        return real(self, prompt, **kw)

    monkeypatch.setattr(Decoder, "calibrate", calibrate)
    engine = ServingEngine(tiny_model(0, eos=0), PromptLookup() if drafter else None,
                           EngineConfig(num_draft_tokens=k))
    engine.start()
    engine.stop(drain=True, timeout=30)  # the thread calibrates, if it does, before it waits
    assert not engine._thread.is_alive()
    assert bool(seen) == calibrates and all(n > 0 for n in seen)
