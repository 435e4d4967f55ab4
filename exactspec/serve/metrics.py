"""Server metrics through `prometheus_client`, names modelled on vLLM's (`vllm:spec_decode_*`).

The engine thread and the HTTP handlers update plain fields under one lock (tests and the
replica router read them); a collector turns them into Prometheus families at scrape time,
and the latency histograms are `prometheus_client.Histogram`s. Every instance has its own
registry, so several servers in one process (tests, bench-serve) never share counts.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from exactspec.engine.results import GenerationStats

PREFIX = "exactspec:"
# Upper bounds (seconds) of the latency histograms' buckets.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what /metrics answers with


class Metrics:
    """Every number /metrics reports."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards every plain field below
        self.requests = defaultdict(int)  # finished requests by outcome: stop, length, error...
        self.rejected = defaultdict(int)  # refused before the engine, by reason
        self.answers = defaultdict(int)  # (route, status code) -> HTTP answers sent
        self.drafter_faults = defaultdict(int)  # drafter exceptions survived (rows went plain)
        self.prompt_tokens = 0  # over finished and running requests
        self.generation_tokens = 0  # tokens emitted to choices
        self.steps = 0  # engine steps (one target forward over the batch each)
        self.drafts = 0  # (choice, step) pairs where the drafter proposed tokens
        self.draft_tokens = 0  # draft tokens proposed
        self.accepted_tokens = 0  # draft tokens accepted
        self.row_steps = 0  # (choice, step) pairs: the denominator of acceptance length
        # the finished choices' statistics merged: accepted / proposed drafts by position
        self.per_position = GenerationStats()
        self.waiting = 0  # gauge: requests queued, not yet decoding
        self.running = 0  # gauge: requests decoding
        self.batch_rows = 0  # gauge: rows in the engine's batch now
        self.peak_batch_rows = 0  # gauge: the most rows one step has decoded
        self.registry = CollectorRegistry(auto_describe=False)  # this server's own
        self.step_seconds = Histogram(  # wall time of one engine step
            f"{PREFIX}engine_step_seconds", "Wall time of one engine step.", buckets=BUCKETS,
            registry=self.registry)
        self.ttft = Histogram(  # submission to first token
            f"{PREFIX}time_to_first_token_seconds", "Submission to first token.",
            buckets=BUCKETS, registry=self.registry)
        self.e2e = Histogram(  # submission to the last token
            f"{PREFIX}e2e_request_latency_seconds", "Submission to last token.",
            buckets=BUCKETS, registry=self.registry)
        self.registry.register(_Fields(self))

    def observe_row(self, stats: GenerationStats) -> None:
        """A choice finished (or was cancelled): add its speculative statistics."""
        with self.lock:
            self.generation_tokens += stats.emitted
            self.row_steps += stats.steps
            self.draft_tokens += stats.drafted
            self.accepted_tokens += stats.accepted
            self.drafts += stats.drafted_per_position[0] if stats.drafted_per_position else 0
            self.per_position = self.per_position.merge(stats)

    def observe_steps(self, steps: int, seconds: float) -> None:
        """`steps` engine steps took `seconds` in all (each is recorded at the mean)."""
        with self.lock:
            self.steps += steps
        for _ in range(steps):
            self.step_seconds.observe(seconds / steps)

    def count(self, field: str, key: str, value: int = 1) -> None:
        with self.lock:
            getattr(self, field)[key] += value

    def count_answer(self, route: str, status: int) -> None:
        """One HTTP answer sent on `route` with `status` (every answer, refusals included)."""
        with self.lock:
            self.answers[(route, str(status))] += 1

    def render(self) -> str:
        """The Prometheus text exposition (version 0.0.4)."""
        return generate_latest(self.registry).decode()


class _Fields:
    """A prometheus_client collector over a `Metrics`' plain fields, read at scrape time."""

    def __init__(self, m: Metrics) -> None:
        self.m = m  # the fields' owner

    def collect(self):
        m, p = self.m, PREFIX
        with m.lock:
            mean_len = (m.generation_tokens / m.row_steps) if m.row_steps else 0.0
            gauges = [("num_requests_running", "Requests decoding in the engine.", m.running),
                      ("num_requests_waiting", "Requests queued for the engine.", m.waiting),
                      ("num_batch_rows", "Rows (choices) in the engine's current batch.",
                       m.batch_rows),
                      ("num_batch_rows_peak", "The most rows one engine step has decoded.",
                       m.peak_batch_rows),
                      ("spec_decode_mean_acceptance_length",
                       "Tokens emitted per row-step, the bonus / recovered token included.",
                       mean_len)]
            counters = [("prompt_tokens", "Prompt tokens of admitted requests.",
                         m.prompt_tokens),
                        ("generation_tokens", "Tokens generated.", m.generation_tokens),
                        ("engine_steps", "Engine steps (one target forward each).", m.steps),
                        ("spec_decode_num_drafts",
                         "Row-steps in which draft tokens were proposed.", m.drafts),
                        ("spec_decode_num_draft_tokens", "Draft tokens proposed.",
                         m.draft_tokens),
                        ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                         m.accepted_tokens)]
            labelled = [("request_success", "Finished requests by finish reason.",
                         "finished_reason", dict(m.requests)),
                        ("request_rejected", "Requests refused before the engine.", "reason",
                         dict(m.rejected)),
                        ("drafter_faults", "Drafter exceptions inside a step; the rows in "
                         "flight continued with plain decoding.", "where",
                         dict(m.drafter_faults)),
                        ("spec_decode_num_accepted_tokens_per_pos",
                         "Accepted draft tokens by draft position (0 = first).", "position",
                         {str(k): v for k, v in
                          enumerate(m.per_position.accepted_per_position)}),
                        ("spec_decode_num_draft_tokens_per_pos",
                         "Proposed draft tokens by draft position (0 = first).", "position",
                         {str(k): v for k, v in
                          enumerate(m.per_position.drafted_per_position)})]
            answers = dict(m.answers)
        for name, help_, value in gauges:
            yield GaugeMetricFamily(p + name, help_, value=value)
        for name, help_, value in counters:
            yield CounterMetricFamily(p + name, help_, value=value)
        for name, help_, label, values in labelled:
            family = CounterMetricFamily(p + name, help_, labels=[label])
            for key, value in sorted(values.items()):
                family.add_metric([key], value)
            yield family
        family = CounterMetricFamily(p + "http_requests", "HTTP answers by route and status "
                                     "code, refusals included.", labels=["route", "code"])
        for key, value in sorted(answers.items()):
            family.add_metric(list(key), value)
        yield family


def merge(texts: list[str]) -> list:
    """The families of several expositions with equal samples summed (a `_peak` gauge: the
    largest); for the replicas' router and the front over its engine process."""
    merged: dict[str, object] = {}  # family name -> family, samples summed in place
    for text in texts:
        for fam in text_string_to_metric_families(text):
            if fam.name.endswith("_created"):
                continue
            fam.samples = [s for s in fam.samples if not s.name.endswith("_created")]
            mine = merged.get(fam.name)
            if mine is None:
                merged[fam.name] = fam
                continue
            index = {(s.name, tuple(sorted(s.labels.items()))): n
                     for n, s in enumerate(mine.samples)}
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in index:
                    index[key] = len(mine.samples)
                    mine.samples.append(s)
                    continue
                old = mine.samples[index[key]]
                value = max(old.value, s.value) if s.name.endswith("_peak") \
                    else old.value + s.value
                mine.samples[index[key]] = old._replace(value=value)
    return list(merged.values())
