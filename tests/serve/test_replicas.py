"""`exactspec serve --replicas 2` on a local Ray cluster (2 CPUs, loopback, no dashboard): one
OpenAI endpoint answers through both engine replicas, each answer is its seed's `es.generate`
text, and /metrics sums both replicas' counts. The cluster is stopped at the end."""

from __future__ import annotations

import time

import httpx
import pytest

import exactspec as es
from exactspec.serve import EngineConfig, ServerConfig
from exactspec.serve.main import free_port
from tests.batch.tiny_dir import save_tiny
from tests.serve.conftest import NAME, openai

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    from exactspec.batch.ray_pool import start_local_ray
    from exactspec.serve.replicas import ReplicaSpec, deploy

    model_dir = save_tiny(tmp_path_factory.mktemp("replicas") / "model")
    start_local_ray(num_cpus=2)
    port = free_port()
    spec = ReplicaSpec(model=str(model_dir), threads=1, config=ServerConfig(
        served_name=NAME, request_timeout=120.0, engine=EngineConfig(max_batch=8)))
    try:
        deploy(spec, 2, host="127.0.0.1", port=port)
        yield f"http://127.0.0.1:{port}", model_dir
    finally:
        serve.shutdown()
        ray.shutdown()


def _successes(text: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("exactspec:request_success_total{"))


def test_two_replicas_answer_and_metrics_count_both(endpoint):
    url, model_dir = endpoint
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    asks = [dict(seed=i, temperature=(0.8, 0)[i % 2]) for i in range(6)]
    answers = [c.completions.create(model=NAME, prompt="abc", max_tokens=6, **a) for a in asks]
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model=NAME, prompt="abc", max_tokens=6, seed=0, temperature=0.8, stream=True)
        if ch.choices)
    model = es.load(str(model_dir))
    for ask, r in zip(asks, answers, strict=True):
        params = es.SamplingParams(temperature=ask["temperature"], seed=ask["seed"])
        (g,) = es.generate(model, ["abc"], params=params, max_new_tokens=6,
                           verify="coupled")  # a seeded request: coupled (issue 38)
        assert r.choices[0].text == g.text
    assert text == answers[0].choices[0].text  # streams pass through unchanged
    # each replica served some of the seven; the endpoint's /metrics counts all of them
    per_replica = []
    for i in range(2):
        handle = serve.get_deployment_handle(f"exactspec-engine-{i}", app_name="exactspec")
        own = handle.url.remote().result(timeout_s=60)
        per_replica.append(_successes(httpx.get(own + "/metrics").text))
    assert min(per_replica) >= 1 and sum(per_replica) == 7
    end = time.monotonic() + 30
    merged = httpx.get(url + "/metrics", timeout=60).text
    while _successes(merged) != 7 and time.monotonic() < end:  # a stream's last count
        time.sleep(0.2)
        merged = httpx.get(url + "/metrics", timeout=60).text
    assert _successes(merged) == 7
    assert "exactspec:replicas 2.0" in merged
    assert "exactspec:time_to_first_token_seconds_count 7.0" in merged
