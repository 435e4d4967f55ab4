"""Server metrics in Prometheus' text format, names modelled on vLLM's (`vllm:spec_decode_*`).

Counters only grow; gauges are read when scraped. Everything is updated by the engine thread
and the HTTP handlers under one lock.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from exactspec.engine.results import GenerationStats

PREFIX = "exactspec:"
# Upper bounds (seconds) of the latency histograms' buckets.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Cumulative buckets, sum and count, as Prometheus histograms are exposed."""

    def __init__(self) -> None:
        self.counts = [0] * len(BUCKETS)  # observations <= BUCKETS[i]
        self.total = 0  # observations
        self.sum = 0.0  # of the observed values

    def observe(self, value: float) -> None:
        for i, upper in enumerate(BUCKETS):
            if value <= upper:
                self.counts[i] += 1
        self.total += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{upper}"}} {c}' for upper, c in zip(BUCKETS, self.counts,
                                                                          strict=True)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.total}', f"{name}_sum {self.sum}",
                f"{name}_count {self.total}"]
        return out


class Metrics:
    """Every number /metrics reports."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards every field
        self.requests = defaultdict(int)  # finished requests by outcome: stop, length, error...
        self.rejected = defaultdict(int)  # refused before the engine, by reason
        self.prompt_tokens = 0  # over finished and running requests
        self.generation_tokens = 0  # tokens emitted to choices
        self.steps = 0  # engine steps (one target forward over the batch each)
        self.drafts = 0  # (choice, step) pairs where the drafter proposed tokens
        self.draft_tokens = 0  # draft tokens proposed
        self.accepted_tokens = 0  # draft tokens accepted
        self.row_steps = 0  # (choice, step) pairs: the denominator of acceptance length
        self.accepted_per_pos: dict[int, int] = defaultdict(int)  # position -> accepted drafts
        self.drafted_per_pos: dict[int, int] = defaultdict(int)  # position -> proposed drafts
        self.step_seconds = Histogram()  # wall time of one engine step
        self.ttft = Histogram()  # submission to first token
        self.e2e = Histogram()  # submission to the last token
        self.waiting = 0  # gauge: requests queued, not yet decoding
        self.running = 0  # gauge: requests decoding
        self.batch_rows = 0  # gauge: rows in the engine's batch now
        self.peak_batch_rows = 0  # gauge: the most rows one step has decoded

    def observe_row(self, stats: GenerationStats) -> None:
        """A choice finished (or was cancelled): add its speculative statistics."""
        with self.lock:
            self.generation_tokens += stats.emitted
            self.row_steps += stats.steps
            self.draft_tokens += stats.drafted
            self.accepted_tokens += stats.accepted
            self.drafts += stats.drafted_per_position[0] if stats.drafted_per_position else 0
            for i, c in enumerate(stats.accepted_per_position):
                self.accepted_per_pos[i] += c
            for i, c in enumerate(stats.drafted_per_position):
                self.drafted_per_pos[i] += c

    def observe_steps(self, steps: int, seconds: float) -> None:
        """`steps` engine steps took `seconds` in all (each is recorded at the mean)."""
        with self.lock:
            self.steps += steps
            for _ in range(steps):
                self.step_seconds.observe(seconds / steps)

    def count(self, field: str, key: str, value: int = 1) -> None:
        with self.lock:
            getattr(self, field)[key] += value

    def render(self) -> str:
        """The Prometheus text exposition (version 0.0.4)."""
        with self.lock:
            return "\n".join(self._lines()) + "\n"

    def _lines(self) -> list[str]:
        p = PREFIX
        mean_len = (self.generation_tokens / self.row_steps) if self.row_steps else 0.0
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            out.extend([f"# HELP {p}{name} {help_}", f"# TYPE {p}{name} {kind}"])
            out.extend(f"{p}{s}" for s in samples)

        metric("num_requests_running", "gauge", "Requests decoding in the engine.",
               [f"num_requests_running {self.running}"])
        metric("num_requests_waiting", "gauge", "Requests queued for the engine.",
               [f"num_requests_waiting {self.waiting}"])
        metric("num_batch_rows", "gauge", "Rows (choices) in the engine's current batch.",
               [f"num_batch_rows {self.batch_rows}"])
        metric("num_batch_rows_peak", "gauge", "The most rows one engine step has decoded.",
               [f"num_batch_rows_peak {self.peak_batch_rows}"])
        metric("request_success_total", "counter", "Finished requests by finish reason.",
               [f'request_success_total{{finished_reason="{k}"}} {v}'
                for k, v in sorted(self.requests.items())] or ["request_success_total 0"])
        metric("request_rejected_total", "counter", "Requests refused before the engine.",
               [f'request_rejected_total{{reason="{k}"}} {v}'
                for k, v in sorted(self.rejected.items())] or ["request_rejected_total 0"])
        metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
               [f"prompt_tokens_total {self.prompt_tokens}"])
        metric("generation_tokens_total", "counter", "Tokens generated.",
               [f"generation_tokens_total {self.generation_tokens}"])
        metric("engine_steps_total", "counter", "Engine steps (one target forward each).",
               [f"engine_steps_total {self.steps}"])
        metric("spec_decode_num_drafts_total", "counter",
               "Row-steps in which draft tokens were proposed.",
               [f"spec_decode_num_drafts_total {self.drafts}"])
        metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
               [f"spec_decode_num_draft_tokens_total {self.draft_tokens}"])
        metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
               [f"spec_decode_num_accepted_tokens_total {self.accepted_tokens}"])
        metric("spec_decode_num_accepted_tokens_per_pos_total", "counter",
               "Accepted draft tokens by draft position (0 = first).",
               [f'spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {c}'
                for i, c in sorted(self.accepted_per_pos.items())]
               or ["spec_decode_num_accepted_tokens_per_pos_total 0"])
        metric("spec_decode_num_draft_tokens_per_pos_total", "counter",
               "Proposed draft tokens by draft position (0 = first).",
               [f'spec_decode_num_draft_tokens_per_pos_total{{position="{i}"}} {c}'
                for i, c in sorted(self.drafted_per_pos.items())]
               or ["spec_decode_num_draft_tokens_per_pos_total 0"])
        metric("spec_decode_mean_acceptance_length", "gauge",
               "Tokens emitted per row-step, the bonus / recovered token included.",
               [f"spec_decode_mean_acceptance_length {mean_len}"])
        metric("engine_step_seconds", "histogram", "Wall time of one engine step.",
               self.step_seconds.lines("engine_step_seconds"))
        metric("time_to_first_token_seconds", "histogram", "Submission to first token.",
               self.ttft.lines("time_to_first_token_seconds"))
        metric("e2e_request_latency_seconds", "histogram", "Submission to last token.",
               self.e2e.lines("e2e_request_latency_seconds"))
        return out
