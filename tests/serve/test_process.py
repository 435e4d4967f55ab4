"""`exactspec serve` as a process (SIGTERM drains), the chat template, a bounded load test, and
`exactspec bench-serve` on a tiny model with tiny counts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

import exactspec as es
from exactspec.cli import main
from exactspec.serve.main import free_port
from tests.batch.tiny_dir import save_tiny
from tests.serve.conftest import NAME, client, openai, start

NO_EOS = {"0": -100}  # id 0 is EOS


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama with a character tokenizer and a chat template, as a directory."""
    return save_tiny(tmp_path_factory.mktemp("serve") / "model")


def test_sigterm_drains_the_running_request_and_exits_0(tiny_dir):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "exactspec.cli", "serve", "--model", str(tiny_dir), "--port",
         str(port), "--threads", "1", "--served-name", NAME],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        body = {"model": NAME, "prompt": "go", "max_tokens": 400, "stream": True,
                "logit_bias": NO_EOS, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        usage = json.loads(rest[-2][6:])["usage"]
        assert usage["completion_tokens"] == 400  # finished after the signal, not cut
        assert len(rest) > 10  # most of it streamed after SIGTERM
        assert proc.wait(timeout=300) == 0  # generous: a starved 2-core machine
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate(timeout=10)[0].decode(errors="replace")
    assert "Shutting down" in out or "shutdown" in out.lower(), out


def _wait_healthy(url: str, proc, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError("the server did not come up")


def test_chat_template_single_and_multi_turn(tiny_dir):
    model = es.load(tiny_dir)
    with start(model) as srv:
        c = client(srv)
        one = [{"role": "user", "content": "hi there"}]
        r = c.chat.completions.create(model=NAME, messages=one, max_tokens=5, seed=1)
        assert r.usage.prompt_tokens == len(model.encode("hi there", chat=True))
        chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "why"}]
        r = c.chat.completions.create(model=NAME, messages=chat, max_tokens=5, seed=1)
        text = model.tokenizer.apply_chat_template(chat, tokenize=False,
                                                   add_generation_prompt=True)
        assert text == "s- be brief. u- hi. a- yo. u- why. a- "
        ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
        (g,) = es.generate(model, [ids], params=es.SamplingParams(seed=1), max_new_tokens=5,
                           verify="coupled")  # a seeded request: coupled (issue 38)
        assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == g.text


def test_bounded_load_every_token_accounted(tiny):
    """12 concurrent streaming clients, 48 requests of mixed settings: no failure, each stream's
    text is its seed's es.generate text, and the server counted exactly the tokens sent."""
    asks = [dict(seed=i, max_tokens=(8, 20)[i % 2], temperature=(1.0, 0.6, 0)[i % 3])
            for i in range(48)]
    with start(tiny, engine={"max_batch": 16, "max_queue": 64}) as srv:
        async def one(c, ask):
            stream = await c.completions.create(model=NAME, prompt="load", stream=True,
                                                stream_options={"include_usage": True}, **ask)
            text, usage = "", None
            async for ch in stream:
                text += "".join(x.text for x in ch.choices)
                usage = ch.usage or usage
            return text, usage

        async def run():
            sem = asyncio.Semaphore(12)
            async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x",
                                          max_retries=0, timeout=60) as c:
                async def bounded(ask):
                    async with sem:
                        return await one(c, ask)
                return await asyncio.gather(*(bounded(a) for a in asks))

        results = asyncio.run(run())
        metrics = srv.app.state.metrics
        assert sum(metrics.requests.values()) == len(asks)
        assert metrics.requests.get("error", 0) == metrics.requests.get("cancelled", 0) == 0
        assert metrics.generation_tokens == sum(u.completion_tokens for _, u in results)
        assert metrics.peak_batch_rows > 1  # requests of different settings shared steps
    for ask, (text, usage) in zip(asks, results, strict=True):
        params = es.SamplingParams(temperature=ask["temperature"], seed=ask["seed"])
        (g,) = es.generate(tiny, ["load"], params=params, max_new_tokens=ask["max_tokens"],
                           verify="coupled")  # a seeded request: coupled (issue 38)
        assert text == g.text and usage.completion_tokens == len(g.token_ids)


def test_bench_serve_on_a_tiny_model(tiny_dir, tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench-serve", "--model", str(tiny_dir), "--prompt-lookup", "--streams", "1,3",
                 "--requests-per-stream", "2", "--max-tokens", "6", "--threads", "1",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr()
    result = json.loads((out / "bench_serve.json").read_text())
    assert set(result["results"]) == {"plain", "prompt-lookup"}
    for by_c in result["results"].values():
        assert set(by_c) == {"1", "3"}
        for c, r in by_c.items():
            assert r["failed"] == 0 and r["requests"] == 2 * int(c)
            assert 0 < r["tokens"] <= 6 * r["requests"] and r["throughput"] > 0
            assert 0 < r["ttft_p50"] <= r["ttft_p99"]
    assert result["results"]["plain"]["1"]["acceptance_length"] == 1.0
    assert (out / "bench_serve.png").stat().st_size > 10_000
    assert set(result["targets"]) == {"speedup at 1 streams >= 1.8"}  # the ones run here
    assert "GGUF" in result["llama_server_skipped"] or "needs" in result["llama_server_skipped"]
    printed = capsys.readouterr().out
    assert "speedup" in printed and "target speedup at 1 streams >= 1.8" in printed


def test_quantized_draft_flag_is_refused_or_built(tiny_dir):
    code = main(["serve", "--model", str(tiny_dir), "--quantized-draft", "3"])
    assert code == 2  # argparse: 8 or 4 only


def test_the_kv_cache_flag_reaches_the_engines_model(tiny_dir):
    import gc

    import torch

    from exactspec.models.cache import kv_cache_dtype
    from exactspec.serve.main import EngineSpec, build_server

    assert main(["serve", "--model", str(tiny_dir), "--kv-cache", "fp8"]) == 2
    try:
        model, _, _ = build_server(EngineSpec(model=str(tiny_dir), kv_cache="bfloat16"))
        assert kv_cache_dtype(model.model) == torch.bfloat16
        greedy = es.SamplingParams(temperature=0)
        out = es.generate(model, [[1, 2, 3]], params=greedy, max_new_tokens=4)[0]
        assert len(out.token_ids) >= 1
        plain, _, _ = build_server(EngineSpec(model=str(tiny_dir)))
        assert kv_cache_dtype(plain.model) is None
    finally:
        gc.unfreeze()  # build_server settled this worker's objects


def test_the_dtype_flag_reaches_the_engines_model(tiny_dir, monkeypatch):
    """--dtype bfloat16 loads the target in bf16 in the engine process (and in this one when
    the engine runs here); a name es.load does not take is refused by the flag."""
    import gc

    import torch

    import exactspec.serve
    from exactspec.serve.main import EngineSpec, build_server

    assert main(["serve", "--model", str(tiny_dir), "--dtype", "float16"]) == 2
    specs = []
    monkeypatch.setattr(exactspec.serve, "serve", lambda model, drafter, config, **kw:
                        specs.append(kw["engine_process"]))
    assert main(["serve", "--model", str(tiny_dir), "--dtype", "bfloat16", "--port", "0"]) == 0
    assert main(["serve", "--model", str(tiny_dir), "--port", "0"]) == 0
    assert [s.dtype for s in specs] == ["bfloat16", "float32"]
    try:
        model, _, _ = build_server(specs[0])
        assert next(model.model.parameters()).dtype == torch.bfloat16
        greedy = es.SamplingParams(temperature=0)
        assert es.generate(model, [[1, 2, 3]], params=greedy, max_new_tokens=3)[0].token_ids
        plain, _, _ = build_server(EngineSpec(model=str(tiny_dir)))
        assert next(plain.model.parameters()).dtype == torch.float32
    finally:
        gc.unfreeze()
