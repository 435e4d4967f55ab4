"""`exactspec serve`: the OpenAI-compatible server (see the README's Server section)."""

from __future__ import annotations

import argparse
import errno
import socket
from dataclasses import replace

from exactspec.cli.common import (
    UsageError,
    add_dtype_flag,
    add_kv_cache_flag,
    at_least,
    draft_tokens,
    refuse_without,
    value_or,
    warn_lossy,
)
from exactspec.cli.drafter_flags import add_drafter_flags, drafter_spec
from exactspec.drafters.registry import drafter_flags


def serve_method(name: str):
    """--verify parsed once into its method object (exactspec.sampling.methods), the same
    choices as generate's (traversal: block on chains, its own rule on trees), refused in one
    line when unknown or out of range; a lossy rule is warned about here, once."""
    from exactspec.errors import InvalidValue
    from exactspec.sampling import parse_method

    try:
        method = parse_method(name)
    except InvalidValue as exc:
        raise UsageError(f"--verify: {exc}") from None
    if not method.lossless:
        warn_lossy(method.name, '; responses say "lossless": false')
    return method


def check_tree_method(drafter, verify) -> None:
    """A tree drafter's method refused before serving, as generate refuses it (block has no
    tree rule; traversal needs a fixed shape or deterministic siblings)."""
    from exactspec.engine.tree_step import tree_rule
    from exactspec.errors import InvalidValue

    try:
        tree_rule(drafter, verify)
    except InvalidValue as exc:
        raise UsageError(f"--verify: {exc}") from None


def drafter_choice(args):
    """The drafter the flags name (cli/drafter_flags.py), as the server's choice."""
    from exactspec.serve import DrafterChoice

    return DrafterChoice.of(drafter_spec(args))


def port(text: str) -> int:
    """argparse type of --port: 0 (any free port) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 1-65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port: give 1-65535 (or 0 for "
                                         "any free one)")
    return value


def check_bind(host: str, port: int) -> None:
    """UsageError (one line) unless `host:port` can be listened on now, as uvicorn will.

    Checked before the model loads, so a busy port or a wrong --host costs no loading time and
    prints no server log; another process could still take the port in between (then uvicorn
    reports it).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host!r} is not an address of this machine ({exc.strerror}); "
                         "use 127.0.0.1, 0.0.0.0 or one of its addresses") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(f"port {port} on {host} is already in use (another server?): "
                                 "stop it or choose another --port") from None
            if exc.errno == errno.EACCES:
                raise UsageError(f"port {port} on {host} needs privileges this user lacks: "
                                 "choose a --port above 1023") from None
            raise UsageError(f"cannot listen on {host}:{port} ({exc.strerror}): check --host "
                             "and --port") from None


def add(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve the model over the OpenAI API, speculatively",
        description="An OpenAI-compatible HTTP server (POST /v1/chat/completions, "
        "/v1/completions; GET /v1/models, /health, /metrics) whose outputs are distributed "
        "exactly as the target's. SIGTERM drains running requests, then exits. Example: "
        "exactspec serve --prompt-lookup --port 8000 --api-key secret")
    p.add_argument("--model", default="smollm2-135m",
                   help="target: embedded name, transformers directory or .gguf file")
    add_dtype_flag(p, "; every engine process and replica")
    add_kv_cache_flag(p, "; every engine process and replica")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                   "%(default)s; 0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=port, default=8000,
                   help="TCP port, 1-65535, or 0 for any free one (default %(default)s)")
    add_drafter_flags(p)
    p.add_argument("--num-draft-tokens", type=draft_tokens, default=None, metavar="N|auto",
                   help="draft tokens per step, or 'auto' (the default: K per step, 0 "
                   "included, from the costs measured at the current load, so speculation "
                   "never makes the server slower; still exact, but a seed's text then "
                   "depends on timings: give N for reproducible seeded text); needs a drafter")
    p.add_argument("--verify", default=None, metavar="METHOD",
                   help="verification method: token (default), block, traversal (lossless), "
                   "greedy (exact "
                   "only at temperature 0: other requests are refused with 400), or the opt-in "
                   "lossy rules lenient:L / typical:EPS (a warning is printed at start-up and "
                   "every response says lossless: false); needs a drafter")
    p.add_argument("--seeded-verify", choices=("coupled", "method"), default="coupled",
                   help="how a request with a seed is verified: coupled (the default: its text "
                   "is plain decoding's for that seed, whatever the draft length, with or "
                   "without speculation) or method (--verify, as unseeded requests: more drafts "
                   "accepted at high temperature, the text then depends on the draft length)")
    p.add_argument("--logprobs-mode", choices=("raw", "processed"), default="raw",
                   help="the law logprobs report unless a request's logprobs_mode says "
                   "otherwise: raw (the default: the model's own, before temperature, "
                   "top-k/p and penalties, as OpenAI and vLLM report) or processed (the law "
                   "each token was drawn from, what an RL trainer needs)")
    p.add_argument("--max-batch", type=at_least(1), default=32,
                   help="rows decoded together (default %(default)s)")
    p.add_argument("--max-queue", type=at_least(1), default=64,
                   help="requests waiting for the engine; more are answered 429 (default "
                   "%(default)s)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds per request before it fails with 504 (default %(default)s)")
    p.add_argument("--max-body-bytes", type=at_least(1), default=8 * 1024 * 1024,
                   help="largest request body; a larger one is refused with 413 before it is "
                   "read (default %(default)s, 8 MiB)")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds for a request's head, and for its body, to arrive; then 408 "
                   "and the connection closed (default %(default)s)")
    p.add_argument("--limit-concurrency", type=at_least(1), default=1024,
                   help="open connections; one more is answered 503 (default %(default)s)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default "
                   "%(default)s)")
    p.add_argument("--engine-restarts", type=at_least(0), default=5,
                   help="the engine (model, drafter, decoding) runs in a child process; if it "
                   "dies, requests in flight get 503 and it is restarted, at most this many "
                   "tries in a row (default %(default)s)")
    p.add_argument("--engine-in-process", action="store_true",
                   help="run the engine in the server's own process (no restart; a crash of "
                   "the engine ends the server)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--served-name", default=None,
                   help="model id clients send (default: --model)")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--replicas", type=at_least(1), default=1,
                   help="engine replicas behind one endpoint, on Ray Serve (default 1: one "
                   "engine, no Ray)")
    p.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="with --replicas: the address of an existing Ray cluster (default: a "
                   "local one on this machine)")
    p.set_defaults(run=run)


def run(args) -> int:
    import torch

    from exactspec.models import load
    from exactspec.serve import EngineConfig, ServerConfig, build_drafter, serve
    from exactspec.serve.main import EngineSpec

    for flag in ("request_timeout", "read_timeout", "keep_alive_timeout"):
        if not getattr(args, flag) > 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be > 0 seconds, got "
                             f"{getattr(args, flag)}")
    has_drafter = drafter_spec(args) is not None  # refuses ignored drafter flags
    refuse_without(args, {"num_draft_tokens": "--num-draft-tokens", "verify": "--verify"},
                   has_drafter, f"a drafter ({drafter_flags()})")
    check_bind(args.host, args.port)  # before the model loads: a busy port is one line
    verify = serve_method(value_or(args, "verify", "token"))  # parsed once, here
    if args.ray is not None and args.replicas == 1:
        raise UsageError("--ray needs --replicas N (N >= 2): it places engine replicas")
    if args.replicas > 1:  # the replicas load the model themselves, on Ray
        return _replicas(args, verify, has_drafter)
    config = ServerConfig(
        served_name=args.served_name or args.model, api_key=args.api_key,
        request_timeout=args.request_timeout, limits=limits(args),
        engine=EngineConfig(max_batch=args.max_batch, max_queue=args.max_queue,
                            num_draft_tokens=value_or(args, "num_draft_tokens", "auto")
                            if has_drafter else 0, verify=verify,
                            logprobs_mode=args.logprobs_mode, seeded_verify=args.seeded_verify))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.engine_in_process or (has_drafter and args.verify is not None):
        # the engine here, or a model to refuse the flags against now
        model = load(args.model, dtype=args.dtype, kv_cache=args.kv_cache)
        drafter, name = build_drafter(drafter_choice(args), model)
        check_tree_method(drafter, verify)
        config = replace(config, drafter_name=name)
        if not args.engine_in_process:
            del model, drafter  # the engine process loads its own
    spec = None if args.engine_in_process else EngineSpec(
        model=args.model, drafter=drafter_choice(args), config=config, threads=args.threads,
        dtype=args.dtype, kv_cache=args.kv_cache)
    try:  # with a spec, the model loads in the engine process, restarted if it dies
        serve(None if spec else model, None if spec else drafter, config, host=args.host,
              port=args.port, engine_process=spec, max_restarts=args.engine_restarts)
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    return 0


def limits(args):
    """The server's bounds from the flags (exactspec/serve/guard.py)."""
    from exactspec.serve.guard import Limits

    return Limits(max_body_bytes=args.max_body_bytes, read_timeout=args.read_timeout,
                  limit_concurrency=args.limit_concurrency, keep_alive=args.keep_alive_timeout)


def _replicas(args, verify, has_drafter: bool) -> int:
    """`--replicas N`: N engines behind one endpoint on Ray Serve (exactspec/serve/replicas.py)."""
    from exactspec.batch.ray_pool import require_ray
    from exactspec.serve import EngineConfig, ServerConfig

    require_ray("exactspec serve --replicas")
    from exactspec.serve.replicas import ReplicaSpec, serve_replicas

    config = ServerConfig(
        served_name=args.served_name or args.model, api_key=args.api_key,
        request_timeout=args.request_timeout, drafter_name="plain", limits=limits(args),
        engine=EngineConfig(max_batch=args.max_batch, max_queue=args.max_queue,
                            num_draft_tokens=value_or(args, "num_draft_tokens", "auto")
                            if has_drafter else 0, verify=verify,
                            logprobs_mode=args.logprobs_mode, seeded_verify=args.seeded_verify))
    spec = ReplicaSpec(model=args.model, drafter=drafter_choice(args), config=config,
                       threads=args.threads, kv_cache=args.kv_cache,
                       host="127.0.0.1" if args.ray is None else None)
    serve_replicas(spec, args.replicas, host=args.host, port=args.port, address=args.ray,
                   api_key=args.api_key)
    return 0
