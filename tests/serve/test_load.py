"""Serving under load on a tiny model: 64 concurrent streams through the official `openai`
client with no failure (a speculating server, the draft length chosen per step), a soak of 300
mixed requests with the resident memory recorded at start and end, and the CLI's defaults
(`--num-draft-tokens` auto with a drafter, `--replicas N` handed to Ray Serve)."""

from __future__ import annotations

import asyncio
import gc
import random
import time

import psutil
import pytest

import exactspec
import exactspec as es
from exactspec.cli import main
from tests.batch.tiny_dir import save_tiny
from tests.engine.tiny import perturbed
from tests.serve.conftest import NAME, openai, start

NO_EOS = {"logit_bias": {"0": -100}}  # id 0 is EOS: requests run to max_tokens


def _client(srv):
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_64_concurrent_streams_no_failure(tiny):
    """64 streaming clients at once against a speculating server (auto draft length, 64 rows
    a step): every stream ends with its usage chunk, and each seeded text is the one the
    target alone gives at greedy (the greedy third) or has the asked length."""
    drafter = es.DraftModel(perturbed(tiny.model, 0.3))
    with start(tiny, drafter, engine={"max_batch": 64, "max_queue": 256,
                                      "num_draft_tokens": "auto"}) as srv:
        async def one(c, i):
            stream = await c.completions.create(
                model=NAME, prompt=f"stream {i}", max_tokens=24, seed=i, stream=True,
                temperature=(0.0, 0.8, 1.0)[i % 3], stream_options={"include_usage": True},
                **NO_EOS)
            text, usage = "", None
            async for ch in stream:
                text += "".join(x.text for x in ch.choices)
                usage = ch.usage or usage
            return text, usage

        async def run():
            async with _client(srv) as c:
                return await asyncio.gather(*(one(c, i) for i in range(64)),
                                            return_exceptions=True)

        results = asyncio.run(run())
        metrics = srv.app.state.metrics
        assert [r for r in results if isinstance(r, BaseException)] == []
        assert all(u.completion_tokens == 24 for _, u in results)
        assert metrics.requests.get("length", 0) == 64 and metrics.peak_batch_rows > 16
        assert metrics.requests.get("error", 0) == 0
    greedy = es.SamplingParams(temperature=0, logit_bias={0: -100})
    for i in range(0, 64, 3):
        (g,) = es.generate(tiny, [f"stream {i}"], params=greedy, max_new_tokens=24)
        assert results[i][0] == g.text


def test_soak_300_mixed_requests_memory_recorded(tiny, record_property):
    """300 requests: chat and text, streams and not, n 1-3, stop strings, logprobs with top
    lists, seeds, and some clients that give up mid-stream. No failure but the cancelled;
    resident memory at start and end recorded (and bounded: under 300 MiB of growth)."""
    rng = random.Random(0)
    proc = psutil.Process()
    with start(tiny, es.PromptLookup(), engine={"max_batch": 32, "max_queue": 512,
                                                "num_draft_tokens": "auto"}) as srv:
        async def warm(c):
            await c.completions.create(model=NAME, prompt="warm", max_tokens=4)

        async def one(c, i, sem):
            kind = rng.choice(("chat", "text"))
            kw = dict(max_tokens=rng.choice((4, 8, 16)), n=rng.choice((1, 1, 2, 3)),
                      seed=i, temperature=rng.choice((0.0, 0.7, 1.0)))
            if rng.random() < 0.3:
                kw["stop"] = [rng.choice(("e", "a ", "."))]
            if rng.random() < 0.3:
                kw.update(logprobs=True, top_logprobs=3) if kind == "chat" \
                    else kw.update(logprobs=3)
            stream = rng.random() < 0.5
            give_up = stream and rng.random() < 0.1
            async with sem:
                if kind == "chat":
                    call = c.chat.completions.create(
                        model=NAME, messages=[{"role": "user", "content": f"soak {i}"}],
                        stream=stream, **kw)
                else:
                    call = c.completions.create(model=NAME, prompt=f"soak {i}", stream=stream,
                                                **kw)
                r = await call
                if not stream:
                    return "ok"
                async for _ in r:
                    if give_up:
                        await r.close()
                        return "gave up"
                return "ok"

        async def run():
            async with _client(srv) as c:
                await warm(c)
                sem = asyncio.Semaphore(24)
                gc.collect()
                before = proc.memory_info().rss
                out = await asyncio.gather(*(one(c, i, sem) for i in range(300)),
                                           return_exceptions=True)
                return before, out

        before, results = asyncio.run(run())
        gc.collect()
        after = proc.memory_info().rss
        metrics = srv.app.state.metrics
        failures = [r for r in results if isinstance(r, BaseException)]
        assert failures == []
        assert metrics.requests.get("error", 0) == 0
        end = time.monotonic() + 60  # a client that gave up is counted at the next step
        while sum(metrics.requests.values()) < 300 + 1 and time.monotonic() < end:
            time.sleep(0.05)
        assert sum(metrics.requests.values()) == 300 + 1  # the warm-up too
        assert metrics.batch_rows == 0  # every row left, the cancelled ones included
    record_property("rss_start_mib", round(before / 2**20, 1))
    record_property("rss_end_mib", round(after / 2**20, 1))
    print(f"soak: resident memory {before / 2**20:.1f} MiB at start, {after / 2**20:.1f} MiB "
          "at end")
    assert after - before < 300 * 2**20


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("load") / "model")


def test_cli_drafts_auto_by_default_and_fixed_when_asked(tiny_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(exactspec.serve, "serve", lambda model, drafter, config, **kw:
                        calls.append(config))
    assert main(["serve", "--model", str(tiny_dir), "--prompt-lookup", "--port", "0"]) == 0
    assert main(["serve", "--model", str(tiny_dir), "--prompt-lookup", "--port", "0",
                 "--num-draft-tokens", "3"]) == 0
    assert main(["serve", "--model", str(tiny_dir), "--port", "0"]) == 0
    assert [c.engine.num_draft_tokens for c in calls] == ["auto", 3, 0]


def test_cli_replicas_go_to_ray_serve(tiny_dir, monkeypatch, capsys):
    from exactspec.serve import replicas

    calls = []
    monkeypatch.setattr(replicas, "serve_replicas", lambda spec, n, **kw: calls.append(
        (spec, n, kw)))
    assert main(["serve", "--model", str(tiny_dir), "--replicas", "2", "--prompt-lookup",
                 "--port", "0", "--ray", "10.0.0.1:6379"]) == 0
    ((spec, n, kw),) = calls
    assert n == 2 and kw["address"] == "10.0.0.1:6379" and spec.model == str(tiny_dir)
    assert spec.drafter.prompt_lookup and spec.config.engine.num_draft_tokens == "auto"
    assert spec.host is None  # a cluster: each replica listens on its node's address
    assert main(["serve", "--model", str(tiny_dir), "--ray", "10.0.0.1:6379"]) == 2
    assert "--ray needs --replicas" in capsys.readouterr().err
