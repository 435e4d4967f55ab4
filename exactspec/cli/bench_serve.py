"""`exactspec bench-serve`: the server under 1, 4, 16, 64 concurrent streams, speculative vs
plain (and the llama-cpp-python server when installed)."""

from __future__ import annotations

from exactspec.cli.common import UsageError, at_least, draft_tokens
from exactspec.cli.serve import add_drafter_flags, drafter_choice


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--streams takes comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"--streams needs ints >= 1, got {text!r}")
    return values


def add(sub) -> None:
    p = sub.add_parser(
        "bench-serve", help="throughput and latency of the server, speculative vs plain",
        description="Starts two servers over the same model, each in its own process "
        "(127.0.0.1), as a user runs them: one "
        "speculating with the chosen drafter (default --quantized-draft 8), one plain. For "
        "each concurrency, that many streaming clients send a fixed list of chat requests; "
        "the servers take turns; the llama-cpp-python OpenAI server on the model's GGUF "
        "joins when its server extra is installed. Prints throughput, p50 / p99 TTFT and "
        "inter-token latency per server and concurrency and the issue-21 targets, writes "
        "OUT/bench_serve.json and OUT/bench_serve.png. Example: exactspec bench-serve "
        "--quantized-draft 8 --threads 2")
    p.add_argument("--model", default="smollm2-135m",
                   help="target: embedded name, transformers directory or .gguf file")
    add_drafter_flags(p)
    p.add_argument("--num-draft-tokens", type=draft_tokens, default="auto", metavar="N|auto",
                   help="K of the speculative server (default auto, as exactspec serve)")
    p.add_argument("--streams", default="1,4,16,64", help="concurrencies (default %(default)s)")
    p.add_argument("--requests-per-stream", type=at_least(1), default=4,
                   help="requests per run = this x streams (default %(default)s)")
    p.add_argument("--max-tokens", type=at_least(1), default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rounds", type=at_least(1), default=1)
    p.add_argument("--max-batch", type=at_least(1), default=64)
    p.add_argument("--no-llama-server", action="store_true",
                   help="leave out the llama-cpp-python server even when it is installed")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--out", default="out/bench-serve", help="output directory")
    p.set_defaults(run=run)


def run(args) -> int:
    import json
    from pathlib import Path

    import torch

    from exactspec.models import load
    from exactspec.serve import build_drafter
    from exactspec.serve.bench import ServeBenchConfig, bench_serve, format_table, write_plot

    streams = _ints(args.streams)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    choice = drafter_choice(args)
    if not (choice.prompt_lookup or choice.draft or choice.eagle or choice.quantized_draft
            or choice.cross_vocab_draft):
        choice.quantized_draft = 8  # the comparison: the quantized self-draft
    model = load(args.model)  # here too: a wrong --model or drafter is one line, not a crash
    _, name = build_drafter(choice, model)  # in the servers' processes
    del model
    cfg = ServeBenchConfig(streams=streams, requests_per_stream=args.requests_per_stream,
                           max_tokens=args.max_tokens, temperature=args.temperature,
                           rounds=args.rounds, num_draft_tokens=args.num_draft_tokens,
                           max_batch=args.max_batch, llama_server=not args.no_llama_server,
                           threads=args.threads)

    def progress(server, res) -> None:
        print(f"{server}: {res.streams} streams, {res.throughput:.1f} tok/s, "
              f"{res.failed} failed", flush=True)

    result = bench_serve(args.model, choice, name, cfg, progress=progress)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_serve.json").write_text(json.dumps(result, indent=1))
    png = write_plot(result, out / "bench_serve.png")
    print(format_table(result))
    print(f"wrote {out / 'bench_serve.json'}, {png}")
    failed = sum(r["failed"] for by_c in result["results"].values() for r in by_c.values())
    return 1 if failed else 0
