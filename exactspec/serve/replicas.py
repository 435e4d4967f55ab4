"""`exactspec serve --replicas N`: N engine replicas behind one OpenAI endpoint, on Ray Serve.

Layout: N deployments `exactspec-engine-i` (one replica each) and one ingress deployment,
`exactspec-router`, behind Ray Serve's HTTP proxy (the endpoint clients use). An engine
replica loads the model itself and runs the ordinary single-engine server (`BackgroundServer`:
the same app, errors, streaming and draining as `exactspec serve`) on a port of its node; the
router sends each request to the replica with the fewest requests in flight (ties in turn),
streaming the answer back unchanged, so a client disconnect closes the replica's stream and
cancels its rows. GET /metrics scrapes every replica and sums their samples (counters,
histograms, gauges; `..._peak` and the mean acceptance length are combined as a maximum and a
mean), adding `exactspec:replicas`. Separate deployments rather than one with N replicas,
because Ray's router hides which replica answered, and /metrics must reach each of them.

A local cluster by default (loopback, no dashboard); `--ray ADDRESS` joins an existing one,
where replicas listen on their node's address.
"""

# no `from __future__ import annotations`: FastAPI must see the route methods' real types
# through Ray Serve's class-based ingress (string annotations turned `request` into a field)
import asyncio
import itertools
import logging
import signal
import threading
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from ray import serve

from exactspec.serve.main import BackgroundServer, EngineSpec, build_server
from exactspec.serve.metrics import CONTENT_TYPE, PREFIX, merge

log = logging.getLogger(__name__)

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
        "content-encoding"}  # headers that belong to one HTTP hop, not to the answer


ReplicaSpec = EngineSpec  # what each engine replica builds for itself


class EngineReplica:
    """One engine replica: the model, its drafter and a single-engine server on `spec.host`."""

    def __init__(self, spec: ReplicaSpec) -> None:
        model, drafter, config = build_server(spec)
        host = spec.host
        if host is None:  # a cluster of several machines: the router reaches it there
            import ray

            host = ray.util.get_node_ip_address()
        self.server = BackgroundServer(model, drafter, config, host=host,
                                       start_timeout=120.0,
                                       stop_timeout=config.request_timeout + 5)
        self.server.__enter__()

    def url(self) -> str:
        """The replica's own base URL."""
        return self.server.url

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.__exit__(None, None, None)


class _Merged:
    """A collector summing the replicas' /metrics samples by name and labels."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts  # each replica's exposition

    def collect(self):
        merged = {fam.name: fam for fam in merge(self.texts)}
        for fam in merged.values():  # a mean over replicas, not a sum
            fam.samples = [s._replace(value=s.value / len(self.texts))
                           if s.name.endswith("mean_acceptance_length") else s
                           for s in fam.samples]
        yield from merged.values()
        yield GaugeMetricFamily(f"{PREFIX}replicas", "Engine replicas behind this endpoint.",
                                value=len(self.texts))


router_app = FastAPI(title="exactspec replicas")


@serve.deployment(name="exactspec-router", ray_actor_options={"num_cpus": 0})
@serve.ingress(router_app)
class Router:
    """The OpenAI endpoint: forwards each request to one engine replica (see the module)."""

    def __init__(self, api_key: str | None, *engines) -> None:
        self.api_key = api_key  # the replicas' key: /metrics scrapes need it too
        self.engines = list(engines)  # DeploymentHandles of the engine replicas
        self.urls: list[str] | None = None  # their base URLs, asked once
        self.in_flight: list[int] = [0] * len(engines)  # requests each one is answering
        self.turn = itertools.count()  # tie-break between equally loaded replicas
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0))

    async def _urls(self) -> list[str]:
        if self.urls is None:
            self.urls = list(await asyncio.gather(*(e.url.remote() for e in self.engines)))
        return self.urls

    @router_app.get("/metrics")
    async def metrics(self) -> Response:
        urls = await self._urls()
        texts = await asyncio.gather(*(self.client.get(f"{u}/metrics", headers=self._auth)
                                       for u in urls))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Merged([t.text for t in texts]))
        return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE)

    @router_app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, path: str, request: Request) -> Response:
        urls = await self._urls()
        turn = next(self.turn)
        i = min(range(len(urls)), key=lambda j: (self.in_flight[j], (j - turn) % len(urls)))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        req = self.client.build_request(request.method, f"{urls[i]}/{path}", headers=headers,
                                        content=await request.body(),
                                        params=request.query_params)
        self.in_flight[i] += 1
        try:
            answer = await self.client.send(req, stream=True)
        except BaseException:
            self.in_flight[i] -= 1
            raise
        out_headers = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP}

        async def body():
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:  # the client is gone or the answer ended: the replica's stream closes
                await answer.aclose()
                self.in_flight[i] -= 1

        return StreamingResponse(body(), status_code=answer.status_code, headers=out_headers)

    @property
    def _auth(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def deploy(spec: ReplicaSpec, replicas: int, *, host: str, port: int,
           api_key: str | None = None) -> None:
    """Start Ray Serve's proxy on host:port and N engine replicas behind one router."""
    serve.start(http_options={"host": host, "port": port})
    engines = [serve.deployment(EngineReplica, name=f"exactspec-engine-{i}",
                                ray_actor_options={"num_cpus": 0}).bind(spec)
               for i in range(replicas)]
    serve.run(Router.bind(api_key, *engines), name="exactspec", route_prefix="/")


def serve_replicas(spec: ReplicaSpec, replicas: int, *, host: str, port: int,
                   address: str | None = None, api_key: str | None = None,
                   num_cpus: int | None = None) -> None:
    """`exactspec serve --replicas N`: serve until SIGTERM / SIGINT, then stop the replicas
    (each drains its open requests) and the local cluster."""
    import ray

    from exactspec.batch.ray_pool import start_local_ray

    if address is None:
        import os

        start_local_ray(num_cpus=num_cpus or os.cpu_count() or 1)
    else:
        ray.init(address=address, log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deploy(spec, replicas, host=host, port=port, api_key=api_key)
        log.info("serving %d replicas on http://%s:%d", replicas, host, port)
        while not stop.is_set():
            time.sleep(0.5)
    finally:
        serve.shutdown()
        ray.shutdown()
