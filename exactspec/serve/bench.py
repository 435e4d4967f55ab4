"""`exactspec bench-serve`: the server under concurrent streaming load, speculative vs plain.

Method: two servers over the same model (one with the drafter, one plain decoding), each in
its own process on 127.0.0.1 as a user runs it (`serve/process.py`: in this process the
clients' Python stole the engine's), and, when it is installed, the llama-cpp-python OpenAI
server on the model's GGUF (also a subprocess, same threads; `serve/llama_server.py`); for each
concurrency c, `c` streaming clients share a fixed list of chat requests (the bench workloads'
prompts, seeded, temperature as configured), the servers taking turns round by round so a
busy patch of the machine hits each. Per run:
output tokens / wall seconds (throughput), time to first token (TTFT: request sent -> first
text chunk), inter-token latency (ITL: the gap between consecutive text chunks; one chunk
can carry several tokens when drafts are accepted) and time per output token (TPOT:
(last - first chunk) / (tokens - 1), per request), as p50 and p99 over requests (TTFT,
TPOT) or chunks (ITL). Every request must succeed and its usage count its tokens (the
llama.cpp server, which may send no usage chunk, is counted one token per chunk).
The issue-21 targets are checked in the result's `targets`: speculative / plain tokens/s
>= 1.0 at 4, 16 and 64 streams and >= 1.8 at one, TTFT p50 at 16 streams within 1.2x of
plain's, no failed request at 64 streams.
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

from exactspec.serve.app import ServerConfig
from exactspec.serve.engine import EngineConfig
from exactspec.serve.main import DrafterChoice, EngineSpec
from exactspec.serve.process import EngineProcess


@dataclass
class ServeBenchConfig:
    """What bench-serve measures."""

    streams: list[int] = field(default_factory=lambda: [1, 4, 16, 64])  # concurrent clients
    requests_per_stream: int = 4  # requests per run = this x streams
    max_tokens: int = 64  # per request
    temperature: float = 1.0  # sampling temperature of every request
    rounds: int = 1  # runs per (server, concurrency), servers interleaved
    num_draft_tokens: int | str = "auto"  # K for the speculative server (the serve default)
    max_batch: int = 64  # rows decoded together
    seed: int = 0  # request i uses seed + i
    llama_server: bool = True  # also the llama-cpp-python server, when installed
    threads: int | None = None  # the llama.cpp server's threads (None: torch's)


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


async def _one(client: httpx.AsyncClient, url: str, body: dict, headers: dict,
               chunk_tokens: bool = False) -> dict:
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
    if usage is None and chunk_tokens and done:  # a server without a usage chunk
        usage = {"completion_tokens": len(chunks)}
    ok = done and usage is not None
    return {"ok": ok, "sent": sent, "chunks": chunks, "tokens": usage["completion_tokens"]
            if usage else 0, "ext": ext}


async def run_load(url: str, model_name: str, prompts: list[str], streams: int, requests: int,
                   max_tokens: int, temperature: float, seed: int,
                   api_key: str | None = None, chunk_tokens: bool = False) -> LoadResult:
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
                                              headers, chunk_tokens))
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


def bench_serve(model: str, drafter: DrafterChoice, drafter_name: str,
                cfg: ServeBenchConfig, *, prompts: list[str] | None = None,
                progress=None) -> dict:
    """Every server at every concurrency; the JSON-ready result (see `format_table`).
    `model` is what --model names (es.load's argument; it also finds the GGUF for the
    llama.cpp server), `drafter` the speculative server's choice, `drafter_name` its name."""
    from contextlib import ExitStack

    from exactspec.serve.llama_server import LlamaServer, gguf_of, llama_server_missing

    prompts = prompts or bench_prompts()
    servers: dict[str, object] = {}
    for name, choice in (("plain", DrafterChoice()), (drafter_name, drafter)):
        k = cfg.num_draft_tokens if name != "plain" else 0
        config = ServerConfig(served_name=model, drafter_name=name, engine=EngineConfig(
            max_batch=cfg.max_batch, max_queue=max(64, max(cfg.streams) * 2),
            num_draft_tokens=k))
        servers[name] = EngineProcess(EngineSpec(model=model, drafter=choice, config=config,
                                                 threads=cfg.threads))
    skipped = None
    if cfg.llama_server:
        gguf = gguf_of(model)
        skipped = llama_server_missing() or (None if gguf else
                                             f"no GGUF file for {model!r}")
        if skipped is None:
            import torch

            servers[LLAMA] = LlamaServer(gguf, threads=cfg.threads or torch.get_num_threads())
    runs: dict[str, dict[int, list[LoadResult]]] = {name: {c: [] for c in cfg.streams}
                                                    for name in servers}
    started = time.perf_counter()
    with ExitStack() as stack:
        # one after the other: the speculative server calibrates its draft-length policy at
        # start (Decoder.calibrate), which another server loading at the same time slowed
        # (docs/performance.md, "Serving: measurements once quoted in its code")
        urls = {name: stack.enter_context(srv).url for name, srv in servers.items()}
        for name in servers:  # warm-up: first-call costs are not measured
            asyncio.run(run_load(urls[name], model, prompts, 1, 1, 4, cfg.temperature,
                                 cfg.seed, chunk_tokens=name == LLAMA))
        for _ in range(cfg.rounds):
            for c in cfg.streams:
                for name in servers:
                    res = asyncio.run(run_load(urls[name], model, prompts, c,
                                               c * cfg.requests_per_stream, cfg.max_tokens,
                                               cfg.temperature, cfg.seed,
                                               chunk_tokens=name == LLAMA))
                    runs[name][c].append(res)
                    if progress is not None:
                        progress(name, res)
    summary = {name: {str(c): asdict(_median(rs)) for c, rs in by_c.items()}
               for name, by_c in runs.items()}
    speedup = {str(c): _ratio(summary[drafter_name][str(c)]["throughput"],
                              summary["plain"][str(c)]["throughput"]) for c in cfg.streams}
    ttft_ratio = {str(c): _ratio(summary[drafter_name][str(c)]["ttft_p50"],
                                 summary["plain"][str(c)]["ttft_p50"]) for c in cfg.streams}
    return {"model": model, "drafter": drafter_name, "config": asdict(cfg),
            "results": summary, "speedup": speedup, "ttft_ratio": ttft_ratio,
            "targets": targets(summary, drafter_name, speedup, ttft_ratio),
            "llama_server_skipped": skipped,
            "duration_seconds": time.perf_counter() - started}


LLAMA = "llama.cpp server"  # the llama-cpp-python server's name in the results


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def targets(summary: dict, drafter_name: str, speedup: dict, ttft_ratio: dict) -> dict:
    """Issue 21's targets, each with its measured value and whether it is met (only those
    whose concurrency was run)."""
    out = {}
    for c, need in (("1", 1.8), ("4", 1.0), ("16", 1.0), ("64", 1.0)):
        if c in speedup:
            out[f"speedup at {c} streams >= {need}"] = {"value": speedup[c],
                                                         "met": speedup[c] >= need}
    if "16" in ttft_ratio:
        out["TTFT p50 at 16 streams <= 1.2x plain"] = {"value": ttft_ratio["16"],
                                                       "met": ttft_ratio["16"] <= 1.2}
    if "64" in summary[drafter_name]:
        failed = summary[drafter_name]["64"]["failed"] + summary["plain"]["64"]["failed"]
        out["failed requests at 64 streams == 0"] = {"value": failed, "met": failed == 0}
    return out


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
    if result.get("ttft_ratio"):
        lines.append("TTFT p50, speculative / plain: " + ", ".join(
            f"{c} streams {s:.2f}x" for c, s in result["ttft_ratio"].items()))
    for name, t in result.get("targets", {}).items():
        lines.append(f"target {name}: {t['value']:.2f} {'met' if t['met'] else 'NOT met'}")
    if result.get("llama_server_skipped"):
        lines.append(f"llama.cpp server not run: {result['llama_server_skipped']}")
    return "\n".join(lines)


def write_plot(result: dict, path: Path) -> Path:
    """Throughput, TTFT and ITL against concurrency, both servers, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for name, by_c in result["results"].items():
        cs = [int(c) for c in by_c]
        rs = list(by_c.values())
        axes[0].plot(cs, [r["throughput"] for r in rs], "o-", label=name)
        for ax, key in ((axes[1], "ttft"), (axes[2], "itl")):
            line, = ax.plot(cs, [r[f"{key}_p50"] * 1000 for r in rs], "o-", label=f"{name} p50")
            ax.plot(cs, [r[f"{key}_p99"] * 1000 for r in rs], "s--", color=line.get_color(),
                    label=f"{name} p99")
    ratio = result["speedup"]
    cs = [int(c) for c in ratio]
    axes[3].plot(cs, list(ratio.values()), "o-", label="tok/s")
    if result.get("ttft_ratio"):
        axes[3].plot(cs, list(result["ttft_ratio"].values()), "s--", label="TTFT p50")
    for y, style in ((1.0, ":"), (1.8, "-."), (1.2, "--")):
        axes[3].axhline(y, color="grey", linestyle=style, linewidth=0.8)
    titles = ("throughput (output tok/s)", "time to first token (ms)",
              "inter-token latency (ms)", f"{result['drafter']} / plain")
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
