"""`exactspec bench-serve`: the server under concurrent streaming load, speculative vs plain.

Method: two servers over the same loaded model (one with the drafter, one plain decoding)
run in this process on 127.0.0.1; for each concurrency c, `c` streaming clients share a fixed
list of chat requests (the bench workloads' prompts, seeded, temperature as configured), the
two servers taking turns round by round so a busy patch of the machine hits both. Per run:
output tokens / wall seconds (throughput), time to first token (TTFT: request sent -> first
text chunk), inter-token latency (ITL: the gap between consecutive text chunks; one chunk
can carry several tokens when drafts are accepted) and time per output token (TPOT:
(last - first chunk) / (tokens - 1), per request), as p50 and p99 over requests (TTFT,
TPOT) or chunks (ITL). Every request must succeed and its usage count its tokens.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import httpx

from exactspec.drafters.base import Drafter
from exactspec.models.loading import Model
from exactspec.serve.app import ServerConfig
from exactspec.serve.engine import EngineConfig
from exactspec.serve.main import BackgroundServer


@dataclass
class ServeBenchConfig:
    """What bench-serve measures."""

    streams: list[int] = field(default_factory=lambda: [1, 4, 16])  # concurrent clients
    requests_per_stream: int = 4  # requests per run = this x streams
    max_tokens: int = 64  # per request
    temperature: float = 1.0  # sampling temperature of every request
    rounds: int = 1  # runs per (server, concurrency), servers interleaved
    num_draft_tokens: int | str = 4  # K for the speculative server
    max_batch: int = 32  # rows decoded together
    seed: int = 0  # request i uses seed + i


@dataclass
class LoadResult:
    """One run of `requests` streaming requests by `streams` clients against one server."""

    streams: int  # concurrent clients
    requests: int  # requests sent
    failed: int  # requests that did not end with [DONE] and a usage chunk
    tokens: int  # output tokens (usage)
    wall_seconds: float  # first request sent -> last one done
    throughput: float  # tokens / wall_seconds
    ttft_p50: float  # seconds
    ttft_p99: float
    itl_p50: float  # seconds between text chunks
    itl_p99: float
    tpot_p50: float  # seconds per output token after the first
    acceptance_length: float  # tokens per row-step reported by the server (1.0 plain)


def bench_prompts() -> list[str]:
    """The user turns of the shipped bench workloads."""
    text = resources.files("exactspec.bench").joinpath("workloads.json").read_text()
    return [p for w in json.loads(text)["workloads"] for p in w["prompts"]]


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[min(998, int(q * 1000) - 1)]


async def _one(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> dict:
    sent = time.perf_counter()
    chunks: list[float] = []
    usage, ext, done = None, None, False
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return {"ok": False, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                return {"ok": False, "error": event["error"]["message"]}
            if event.get("usage"):
                usage, ext = event["usage"], event.get("exactspec")
            if any(c["delta"].get("content") for c in event["choices"]):
                chunks.append(time.perf_counter())
    ok = done and usage is not None
    return {"ok": ok, "sent": sent, "chunks": chunks, "tokens": usage["completion_tokens"]
            if usage else 0, "ext": ext}


async def run_load(url: str, model_name: str, prompts: list[str], streams: int, requests: int,
                   max_tokens: int, temperature: float, seed: int,
                   api_key: str | None = None) -> LoadResult:
    """`streams` clients streaming `requests` chat requests (round-robin over `prompts`)."""
    todo = list(range(requests))
    results: list[dict] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=streams + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker():
            while todo:
                i = todo.pop(0)
                body = {"model": model_name, "stream": True, "max_tokens": max_tokens,
                        "temperature": temperature, "seed": seed + i,
                        "stream_options": {"include_usage": True},
                        "messages": [{"role": "user", "content": prompts[i % len(prompts)]}]}
                try:
                    results.append(await _one(client, f"{url}/v1/chat/completions", body,
                                              headers))
                except httpx.HTTPError as exc:
                    results.append({"ok": False, "error": repr(exc)})

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        wall = time.perf_counter() - start
    good = [r for r in results if r["ok"]]
    ttft = [r["chunks"][0] - r["sent"] for r in good if r["chunks"]]
    itl = [b - a for r in good for a, b in zip(r["chunks"], r["chunks"][1:], strict=False)]
    tpot = [(r["chunks"][-1] - r["chunks"][0]) / (r["tokens"] - 1) for r in good
            if len(r["chunks"]) > 1 and r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in good)
    steps = sum(r["ext"]["steps"] for r in good if r["ext"])
    return LoadResult(streams=streams, requests=requests, failed=len(results) - len(good),
                      tokens=tokens, wall_seconds=wall, throughput=tokens / wall if wall else 0.0,
                      ttft_p50=percentile(ttft, 0.5), ttft_p99=percentile(ttft, 0.99),
                      itl_p50=percentile(itl, 0.5), itl_p99=percentile(itl, 0.99),
                      tpot_p50=percentile(tpot, 0.5),
                      acceptance_length=tokens / steps if steps else 0.0)


def bench_serve(model: Model, drafter: Drafter | None, drafter_name: str,
                cfg: ServeBenchConfig, *, prompts: list[str] | None = None,
                progress=None) -> dict:
    """Both servers at every concurrency; the JSON-ready result (see `format_table`)."""
    prompts = prompts or bench_prompts()
    engines = {"plain": None, drafter_name: drafter}
    runs: dict[str, dict[int, list[LoadResult]]] = {name: {c: [] for c in cfg.streams}
                                                    for name in engines}
    servers = {}
    for name, d in engines.items():
        k = cfg.num_draft_tokens if d is not None else 0
        config = ServerConfig(served_name=model.name, drafter_name=name, engine=EngineConfig(
            max_batch=cfg.max_batch, max_queue=max(64, max(cfg.streams) * 2),
            num_draft_tokens=k))
        servers[name] = BackgroundServer(model, d, config)
    started = time.perf_counter()
    with servers["plain"] as plain, servers[drafter_name] as spec:
        urls = {"plain": plain.url, drafter_name: spec.url}
        for name in engines:  # warm-up: first-call costs are not measured
            asyncio.run(run_load(urls[name], model.name, prompts, 1, 1, 4, cfg.temperature,
                                 cfg.seed))
        for _ in range(cfg.rounds):
            for c in cfg.streams:
                for name in engines:
                    res = asyncio.run(run_load(urls[name], model.name, prompts, c,
                                               c * cfg.requests_per_stream, cfg.max_tokens,
                                               cfg.temperature, cfg.seed))
                    runs[name][c].append(res)
                    if progress is not None:
                        progress(name, res)
    summary = {name: {str(c): asdict(_median(rs)) for c, rs in by_c.items()}
               for name, by_c in runs.items()}
    speedup = {str(c): (summary[drafter_name][str(c)]["throughput"]
                        / summary["plain"][str(c)]["throughput"]
                        if summary["plain"][str(c)]["throughput"] else 0.0)
               for c in cfg.streams}
    return {"model": model.name, "drafter": drafter_name, "config": asdict(cfg),
            "results": summary, "speedup": speedup,
            "duration_seconds": time.perf_counter() - started}


def _median(rs: list[LoadResult]) -> LoadResult:
    """The run with the median throughput (failures summed over all runs)."""
    ordered = sorted(rs, key=lambda r: r.throughput)
    mid = ordered[len(ordered) // 2]
    return LoadResult(**{**asdict(mid), "failed": sum(r.failed for r in rs)})


def format_table(result: dict) -> str:
    """One line per (server, concurrency)."""
    head = (f"{'server':<22} {'streams':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'ITL p50':>8} {'ITL p99':>8} {'TPOT p50':>9} {'acc.len':>7} {'failed':>6}")
    lines = [head, "-" * len(head)]
    for name, by_c in result["results"].items():
        for c, r in by_c.items():
            lines.append(f"{name:<22} {c:>7} {r['throughput']:>8.1f} {r['ttft_p50']:>9.3f} "
                         f"{r['ttft_p99']:>9.3f} {r['itl_p50']:>8.3f} {r['itl_p99']:>8.3f} "
                         f"{r['tpot_p50']:>9.4f} {r['acceptance_length']:>7.2f} "
                         f"{r['failed']:>6}")
    lines.append("speedup (tok/s, speculative / plain): " + ", ".join(
        f"{c} streams {s:.2f}x" for c, s in result["speedup"].items()))
    return "\n".join(lines)


def write_plot(result: dict, path: Path) -> Path:
    """Throughput, TTFT and ITL against concurrency, both servers, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, by_c in result["results"].items():
        cs = [int(c) for c in by_c]
        rs = list(by_c.values())
        axes[0].plot(cs, [r["throughput"] for r in rs], "o-", label=name)
        for ax, key in ((axes[1], "ttft"), (axes[2], "itl")):
            line, = ax.plot(cs, [r[f"{key}_p50"] * 1000 for r in rs], "o-", label=f"{name} p50")
            ax.plot(cs, [r[f"{key}_p99"] * 1000 for r in rs], "s--", color=line.get_color(),
                    label=f"{name} p99")
    titles = ("throughput (output tok/s)", "time to first token (ms)", "inter-token latency (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("concurrent streams")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"exactspec serve: {result['model']}, {result['drafter']} vs plain")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
