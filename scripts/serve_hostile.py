"""The hostile run of issue 37 against `exactspec serve`, printing the figures of
docs/serving.md ("Limits"): python scripts/serve_hostile.py [--model smollm2-135m]

Starts the server (API key K, --read-timeout 10), then: a 20 MB body to both completion
endpoints (and chunked), peak RSS of the front; /health polled every 100 ms during 2 MB prompts;
100 stalled connections; 30 hang-ups mid-body (log lines, tracebacks); the engine process
killed with SIGKILL (503s, time until /health is 200 again, same greedy text).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from exactspec.serve.process import ServerProcess

KEY = {"Authorization": "Bearer K"}
MIB = 1024 * 1024


class Serve(ServerProcess):
    name = "exactspec serve"

    def __init__(self, model: str) -> None:
        super().__init__(start_timeout=600.0)
        self.model = model

    def command(self) -> list[str]:
        return [sys.executable, "-m", "exactspec.cli", "serve", "--model", self.model, "--port",
                str(self.port), "--api-key", "K", "--read-timeout", "10", "-v"]


def status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(p) for p in (task / "children").read_text().split()]
    return kids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    with Serve(args.model) as srv:
        front = srv.proc.pid
        (engine,) = children(front)
        url = srv.url
        idle = status(front, "VmRSS")
        print(f"idle RSS: front {idle / MIB:.0f} MB, engine {status(engine, 'VmRSS') / MIB:.0f} MB")
        big = json.dumps({"model": args.model, "prompt": "a" * (20 * MIB)}).encode()
        for path in ("/v1/completions", "/v1/chat/completions"):
            t = time.perf_counter()
            r = httpx.post(url + path, content=big, headers=KEY, timeout=120)
            print(f"20 MB body to {path}: {r.status_code} in {time.perf_counter() - t:.3f} s")
        t = time.perf_counter()
        r = httpx.post(url + "/v1/completions", content=(b" " * MIB for _ in range(20)),
                       headers=KEY, timeout=120)
        print(f"20 MB chunked body: {r.status_code} in {time.perf_counter() - t:.3f} s")
        print(f"front peak RSS - idle: {(status(front, 'VmHWM') - idle) / MIB:.1f} MB")

        lat, done = [], threading.Event()

        def poll():
            with httpx.Client() as c:
                while not done.is_set():
                    t = time.perf_counter()
                    c.get(url + "/health")
                    lat.append(time.perf_counter() - t)
                    time.sleep(0.1)

        poller = threading.Thread(target=poll)
        poller.start()
        codes = []
        for content in ("x" * (2 * MIB), "x" * MIB):  # refused from its size; tokenized, 400
            for path, body in (("/v1/completions", {"prompt": content}),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": content}]})):
                t = time.perf_counter()
                r = httpx.post(url + path, json={"model": args.model, "max_tokens": 1, **body},
                               headers=KEY, timeout=120)
                codes.append((len(content), path, r.status_code, round(time.perf_counter() - t, 3)))
        done.set()
        poller.join()
        print(f"prompts (chars, path, status, s): {codes}")
        print(f"/health during them: {len(lat)} polls, median {statistics.median(lat) * 1e3:.1f} "
              f"ms, max {max(lat) * 1e3:.1f} ms")

        socks = []
        for i in range(100):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
            s.sendall(head[:20] if i % 2 else head + b"{")
            socks.append(s)
        t = time.perf_counter()
        closed = 0
        for s in socks:
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            closed += data.startswith(b"HTTP/1.1 408")
            s.close()
        print(f"100 stalled connections: {closed} answered 408 and all closed after "
              f"{time.perf_counter() - t:.1f} s (--read-timeout 10)")

        before = srv.output()
        for _ in range(30):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer K\r\n"
                      b"Content-Length: 5000\r\n\r\n{\"model\": ")
            time.sleep(0.02)
            s.close()
        time.sleep(2)
        new = srv.output()[len(before):]
        print(f"30 hang-ups mid-body: {len(new.splitlines())} log lines, "
              f"{new.count('Traceback')} tracebacks")

        ask = {"model": args.model, "prompt": "The capital of France is", "max_tokens": 24,
               "temperature": 0}
        greedy = httpx.post(url + "/v1/completions", json=ask, headers=KEY, timeout=120).json()
        long = {**ask, "max_tokens": 400, "stream": True, "temperature": 1.0, "seed": 1}
        with httpx.stream("POST", url + "/v1/completions", json=long, headers=KEY,
                          timeout=120) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(engine, signal.SIGKILL)
            t = time.perf_counter()
            last = [line for line in lines if line.startswith("data: ")][-1]
        print(f"SIGKILL mid-stream: last event {last[:160]}")
        while httpx.get(url + "/health", timeout=10).status_code != 200:
            time.sleep(0.1)
        print(f"engine back (/health 200) {time.perf_counter() - t:.1f} s after the kill")
        again = httpx.post(url + "/v1/completions", json=ask, headers=KEY, timeout=120).json()
        print("same greedy text after the restart:",
              again["choices"][0]["text"] == greedy["choices"][0]["text"])
        print(f"front RSS at the end - idle: {(status(front, 'VmRSS') - idle) / MIB:.1f} MB")


if __name__ == "__main__":
    main()
