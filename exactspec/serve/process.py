"""A server in its own process, on 127.0.0.1 and a free port: what `exactspec bench-serve`
measures, as a user runs it (the server in one process, its clients in others).

`ServerProcess` starts a command, waits until its health URL answers 200, and on exit sends
SIGTERM (our server drains), killing it after `stop_timeout`. `EngineProcess` is our server
built from an `EngineSpec` (`python -m exactspec.serve.process PORT`, the pickled spec on
stdin); the llama-cpp-python server (`llama_server.LlamaServer`) is the other one.

Why not a thread of the benchmark's process: the clients' event loop, the server's and the
engine's Python would share one GIL, and on 2 cores every token's HTTP work stalls the engine's
2-thread products (docs/performance.md, "Serving: measurements once quoted in its code").
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import tempfile
import time

import httpx

from exactspec.serve.main import EngineSpec, free_port


class ServerProcess:
    """`cmd` (which must listen on `self.port`) as a child process; a context manager."""

    name = "server"  # in errors
    health = "/health"  # answers 200 once the server serves

    def __init__(self, *, start_timeout: float = 180.0, stop_timeout: float = 60.0) -> None:
        self.port = free_port()  # where it listens
        self.url = f"http://127.0.0.1:{self.port}"  # base URL
        self.start_timeout = start_timeout  # seconds to wait for `health`
        self.stop_timeout = stop_timeout  # seconds to wait after SIGTERM before killing it
        self.proc: subprocess.Popen | None = None  # the server process, once started
        self.log = None  # its output file, once started

    def command(self) -> list[str]:
        raise NotImplementedError

    def stdin(self) -> bytes | None:
        """What the child reads on its standard input (None: nothing)."""
        return None

    def __enter__(self):
        """Start the process and wait until its health URL answers 200 (RuntimeError with the
        end of its output if it exits or does not answer in `start_timeout`)."""
        # its log goes to a file: a server writes more than a pipe holds, then blocks
        self.log = tempfile.TemporaryFile()  # its output, open until __exit__
        data = self.stdin()
        self.proc = subprocess.Popen(self.command(), stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.PIPE if data is not None else None)
        if data is not None:
            self.proc.stdin.write(data)
            self.proc.stdin.close()
        end = time.monotonic() + self.start_timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                problem = f"exited with {self.proc.returncode}"
                break
            try:
                if httpx.get(self.url + self.health, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            problem = f"did not answer in {self.start_timeout:g} s"
        said = self.output()[-600:]
        self.__exit__()
        raise RuntimeError(f"the {self.name} {problem}: {said}")

    def output(self) -> str:
        """What the process wrote so far."""
        if self.log is None:
            return ""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.log is not None:
            self.log.close()
            self.log = None


class EngineProcess(ServerProcess):
    """Our server, built in the child from `spec` (model, drafter, config, threads)."""

    name = "exactspec server"

    def __init__(self, spec: EngineSpec, **kw) -> None:
        super().__init__(**kw)
        self.spec = spec  # what the child builds

    def command(self) -> list[str]:
        return [sys.executable, "-m", "exactspec.serve.process", str(self.port)]

    def stdin(self) -> bytes:
        return pickle.dumps(self.spec)


def main(argv: list[str]) -> None:
    """The child: build the server of the spec on stdin and serve it on 127.0.0.1:PORT (the
    argument) until SIGTERM."""
    from exactspec.serve.main import build_server, serve

    (port,) = argv
    spec = pickle.loads(sys.stdin.buffer.read())
    model, drafter, config = build_server(spec)
    serve(model, drafter, config, host=spec.host or "127.0.0.1", port=int(port))


if __name__ == "__main__":
    main(sys.argv[1:])
