"""The engine process: `python -m exactspec.serve.worker FD`, started by `EngineSupervisor`.

It reads an `EngineSpec` from the connection on file descriptor FD, loads the model and the
drafter (`build_server`), runs a `ServingEngine` and answers the front's messages:
("submit", id, RequestSpec) -> ("ack", id, None | ApiError), then ("event", id, event) for
each Delta / Finished / Failed; ("cancel", id); ("metrics", token) -> ("metrics", token, text);
("stop", drain, timeout) -> ("stopped",). Once loaded it sends ("ready", info) where info is
what the front needs to tokenize (`ModelInfo`); a failure to load is ("error", message).
It ignores SIGINT (the front drains on Ctrl-C and then stops it) and exits when the front's
end of the connection closes.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from multiprocessing.connection import Connection

from exactspec.serve.engine import ServingEngine
from exactspec.serve.metrics import Metrics
from exactspec.serve.protocol import ApiError

log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    fd, level = int(argv[0]), int(argv[1])
    logging.basicConfig(level=level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    spec = conn.recv()
    try:
        from exactspec.serve.main import build_server
        from exactspec.serve.supervisor import ModelInfo

        model, drafter, config = build_server(spec)
        if drafter is not None:
            from exactspec.engine.arguments import parse_verify
            from exactspec.engine.tree_step import tree_rule
            from exactspec.engine.verifier import UserRule

            method = parse_verify(config.engine.verify)  # a callable: a UserRule, left alone
            if not isinstance(method, UserRule):
                tree_rule(drafter, method)  # a tree's method, refused before serving
    except Exception as exc:  # told to the front, which reports it and exits
        log.debug("the engine failed to load", exc_info=True)
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return 1
    metrics = Metrics()
    engine = ServingEngine(model, drafter, config.engine, metrics)
    engine.start()
    lock = threading.Lock()  # the engine thread and this one both send

    def send(message: tuple) -> None:
        with lock:
            conn.send(message)

    conn.send(("ready", ModelInfo.of(model, config.drafter_name)))
    subs = {}  # request id -> its Submission, while it may still be cancelled
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the front is gone: nobody reads the answers
            engine.stop(drain=False)
            return 0
        kind = message[0]
        if kind == "submit":
            _, rid, request = message
            for done in [k for k, s in subs.items() if s.done or s.cancelled]:
                del subs[done]
            try:
                subs[rid] = engine.submit(request, None, deliver=lambda ev, rid=rid: send(
                    ("event", rid, ev)))
            except ApiError as exc:  # 429 queue full, 503 stopping
                send(("ack", rid, exc))
            else:
                send(("ack", rid, None))
        elif kind == "cancel":
            sub = subs.pop(message[1], None)
            if sub is not None:
                sub.cancel()
        elif kind == "metrics":
            send(("metrics", message[1], metrics.render()))
        elif kind == "stop":
            engine.stop(drain=message[1], timeout=message[2])
            send(("stopped",))
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
