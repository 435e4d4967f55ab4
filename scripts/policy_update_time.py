"""What a policy update costs an RL loop that drafts with the quantized self-draft:
`Engine.update_weights` (new values copied in place), then the next generation, which rebuilds
the draft's quantized copy from the new weights before it decodes (the weights are the same
values here, so only the work is timed, not a changed policy).

    python scripts/policy_update_time.py
    python scripts/policy_update_time.py --bits 8 --updates 5
"""

from __future__ import annotations

import argparse
import time

import torch

import exactspec as es


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--bits", type=int, choices=(8, 4), default=4)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--tokens", type=int, default=8, help="new tokens per generation")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = es.load(args.model)
    engine = es.Engine(model, es.QuantizedDraft(bits=args.bits, backend="torch"),
                       num_draft_tokens=6)
    params = es.SamplingParams(temperature=0.7, seed=0)
    ids = model.encode("Hello there", chat=True)
    engine.generate_rows([ids], [params], max_new_tokens=args.tokens)  # the first build
    t0 = time.perf_counter()
    engine.generate_rows([ids], [params], max_new_tokens=args.tokens)
    steady = time.perf_counter() - t0
    state = {k: v.clone() for k, v in model.model.state_dict().items()}
    for _ in range(args.updates):
        t0 = time.perf_counter()
        engine.update_weights(state)
        t1 = time.perf_counter()
        engine.generate_rows([ids], [params], max_new_tokens=args.tokens)
        t2 = time.perf_counter()
        print(f"update_weights {t1 - t0:.2f} s, then {args.tokens} tokens {t2 - t1:.2f} s "
              f"(without an update {steady:.2f} s)")


if __name__ == "__main__":
    main()
