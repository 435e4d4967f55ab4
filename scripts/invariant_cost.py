"""The batch-invariant mode's cost on a trainer's step: forward + backward, mode vs plain torch.

    python scripts/invariant_cost.py                 # tiny Llama and smollm2-135m, 8 x 256
    python scripts/invariant_cost.py --models tiny --rows 8 --tokens 256 --repeats 5

A step is what an RL trainer does per batch: the model's own forward in training mode over
[rows, tokens] ids, log-softmax of the logits at every position, the mean log p of the next
tokens, backward. Each figure is the median of `--repeats` timed steps after one warm-up, in
this process's torch thread count; run it on an idle machine. Prints one table and, with
--json, writes the figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import exactspec as es


def tiny() -> LlamaForCausalLM:
    """A 4-layer Llama of hidden size 256 (4 heads, 2 kv heads), random weights."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def step(model, ids: torch.Tensor) -> float:  # ids [B, T]
    """One forward + backward; returns its seconds."""
    t0 = time.perf_counter()
    logits = model(input_ids=ids).logits  # [B, T, V]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    loss = -logp.gather(-1, ids[:, 1:, None]).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def timed(model, ids: torch.Tensor, repeats: int, invariant: bool) -> float:
    with es.batch_invariant() if invariant else torch.enable_grad():
        step(model, ids)  # warm-up (the mode's RoPE table, allocator)
        return statistics.median(step(model, ids) for _ in range(repeats))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m"],
                    help="'tiny' and / or names for es.load (default: tiny smollm2-135m)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    a = ap.parse_args(argv)
    rows = []
    for name in a.models:
        model = tiny() if name == "tiny" else copy.deepcopy(es.load(name).model)
        model.train()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (a.rows, a.tokens), generator=g)
        plain = timed(model, ids, a.repeats, False)
        mode = timed(model, ids, a.repeats, True)
        rows.append({"model": name, "rows": a.rows, "tokens": a.tokens, "plain_s": plain,
                     "mode_s": mode, "ratio": mode / plain, "threads": torch.get_num_threads()})
    print(f"{'model':<16} {'shape':>9} {'plain s':>9} {'mode s':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['model']:<16} {r['rows']:>4}x{r['tokens']:<4} {r['plain_s']:>9.3f} "
              f"{r['mode_s']:>9.3f} {r['ratio']:>6.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
