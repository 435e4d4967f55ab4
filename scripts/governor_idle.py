"""What the per-forward thread count (exactspec/kernels/threads.py) costs on an idle machine:
plain and int8 self-draft (K=6) greedy generations of 128 tokens on smollm2-135m, with the
governor on and off (EXACTSPEC_ADAPTIVE_THREADS) alternating in one process, 2 threads.

    .venv/bin/python scripts/governor_idle.py            # docs/performance.md, the AMX machine
"""

import os
import time

import torch

import exactspec as es
from exactspec.kernels.threads import GOVERNOR

torch.set_num_threads(2)
model = es.load("smollm2-135m")
ids = model.encode("Write a long story about a lighthouse keeper.", chat=True)
params = es.SamplingParams(temperature=0)
draft = es.QuantizedDraft(8)
speeds: dict[tuple[str, str], list[float]] = {}
for rep in range(4):  # the first round warms up
    for on in ("0", "1"):
        os.environ["EXACTSPEC_ADAPTIVE_THREADS"] = on
        for name, drafter in (("plain", None), ("int8 K=6", draft)):
            t0 = time.perf_counter()
            g = es.generate(model, [ids], drafter=drafter, params=params, max_new_tokens=128,
                            num_draft_tokens=6)[0]
            if rep:
                speeds.setdefault((name, on), []).append(len(g.token_ids) /
                                                         (time.perf_counter() - t0))
for (name, on), v in sorted(speeds.items()):
    print(f"{name:9} governor {'on ' if on == '1' else 'off'}: "
          + " ".join(f"{x:.1f}" for x in v) + " tok/s")
for key, kind in GOVERNOR.kinds.items():
    print("forward", key[1:], {n: f"{c * 1e3:.1f} ms" for n, c in kind.cost.items()},
          "in use:", kind.best)
