"""Where a draft token's time goes: the quantized self-draft (QuantizedDraft(bits=8 or 4, backend="torch"))
drafting for a float32 target, one row, by wrapping the calls of `DraftModel.propose` with
perf_counter accumulators.

Parts: the decoder layers (`kernels.decoder_stack`), the final norm and head product, the rest
of the lean forward (embedding, RoPE rows, masks: `extend` minus those two), q's
standardization (`DraftContext.standardize`), the draw (`DraftContext.draw`), the native draft
step (`kernels.draft_step.draft_step`, when the loop takes it: norm, head, q and draw),
and what is left of propose (Python between the calls, bookkeeping). Per draft token, in ms,
and each part's share of propose.

    python scripts/draft_step_profile.py --mode greedy --mode t1 --tokens 96 --threads 1
    EXACTSPEC_DRAFT_STEP=0 python scripts/draft_step_profile.py ...   # the Python path
    python scripts/draft_step_profile.py --threads 2 --ab 6   # the two, interleaved

Rough figures for decisions only when other processes share the cores.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch

import exactspec as es
from exactspec import kernels
from exactspec.drafters import draft_model
from exactspec.drafters.base import DraftContext
from exactspec.kernels import draft_step
from exactspec.models import adapter as adapter_module
from exactspec.models import lean_kernels

TIMES: dict[str, float] = collections.defaultdict(float)
COUNTS: dict[str, int] = collections.defaultdict(int)
_DEPTH = [0]  # only the outermost propose counts (propose recurses for a probe's rows)


def timed(obj, name: str, label: str, outer_only: bool = False) -> None:
    """Wrap obj.name so its seconds add up under `label`."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        if not outer_only and _DEPTH[0] == 0:  # the target's calls: not the draft's
            return fn(*args, **kwargs)
        if outer_only:
            _DEPTH[0] += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if not outer_only or _DEPTH[0] == 1:
                TIMES[label] += time.perf_counter() - t0
                COUNTS[label] += 1
            if outer_only:
                _DEPTH[0] -= 1

    setattr(obj, name, wrapper)


def instrument() -> None:
    timed(draft_model.DraftModel, "propose", "propose", outer_only=True)
    timed(adapter_module.TargetAdapter, "extend", "extend")
    timed(kernels, "decoder_stack", "layers (decoder_stack)")
    timed(lean_kernels.kernels, "rms_norm", "norms (rms_norm)")
    timed(DraftContext, "standardize", "standardize")
    timed(DraftContext, "draw", "draw")
    timed(draft_step, "draft_step", "native draft step (norm, head, q, draw)")
    # the head: the Matrix whose product is the logits (out_features = vocabulary)
    from exactspec.models import formats
    fn = formats.Matrix.kernel

    def head_timed(self, x, residual=None):
        if self.out_features < 20000 or _DEPTH[0] == 0:
            return fn(self, x, residual)
        t0 = time.perf_counter()
        try:
            return fn(self, x, residual)
        finally:
            TIMES["head product"] += time.perf_counter() - t0
            COUNTS["head product"] += 1

    formats.Matrix.kernel = head_timed


MODES = {"greedy": es.SamplingParams(temperature=0.0, seed=1),
         "t1": es.SamplingParams(temperature=1.0, seed=1),
         "t0.7p0.9": es.SamplingParams(temperature=0.7, top_p=0.9, seed=1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--mode", action="append", choices=sorted(MODES), default=None)
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per run")
    ap.add_argument("--k", type=int, default=6, help="draft tokens per step")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--bits", type=int, choices=(8, 4), default=8, help="the draft's weights")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the target's weights")
    ap.add_argument("--ab", type=int, default=0, metavar="ROUNDS",
                    help="instead of the parts: ROUNDS generations per mode alternating "
                    "EXACTSPEC_DRAFT_STEP=0 / 1 in this process (the order flipped every "
                    "round), the median ms per draft token of each")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = es.load(a.model, dtype=a.dtype)
    text = "Explain in a few sentences why the sky is blue, then give one example."
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True, tokenize=True)
    prompt = [list(ids["input_ids"] if hasattr(ids, "keys") else ids)]
    drafter = es.QuantizedDraft(bits=a.bits, backend="torch")
    es.generate(model, prompt, drafter=drafter, params=MODES["greedy"], max_new_tokens=16,
                num_draft_tokens=a.k)  # warm: the copy, the kernels, the governor
    if a.ab:
        return ab(model, prompt, drafter, a)
    instrument()
    for mode in a.mode or ["greedy", "t1"]:
        TIMES.clear()
        COUNTS.clear()
        out = es.generate(model, prompt, drafter=drafter, params=MODES[mode],
                          max_new_tokens=a.tokens, num_draft_tokens=a.k)
        drafted = COUNTS["propose"] * a.k  # every propose drafts K for the one row
        total = TIMES["propose"]
        print(f"\n{mode}: {len(out[0].token_ids)} tokens, {COUNTS['propose']} proposes, "
              f"{drafted} draft tokens, {1e3 * total / max(drafted, 1):.3f} ms per draft token")
        inner = {k: v for k, v in TIMES.items() if k not in ("propose", "extend")}
        rest_forward = TIMES["extend"] - TIMES["layers (decoder_stack)"] - TIMES["head product"] \
            - TIMES["norms (rms_norm)"] - TIMES["native draft step (norm, head, q, draw)"]
        inner["rest of the forward (embed, rope, masks)"] = rest_forward
        inner["rest of propose (Python, bookkeeping)"] = total - TIMES["extend"] - sum(
            v for k, v in TIMES.items() if k in ("standardize", "draw"))
        for k, v in sorted(inner.items(), key=lambda kv: -kv[1]):
            print(f"  {k:45s} {1e3 * v / max(drafted, 1):7.3f} ms/token  "
                  f"{100 * v / max(total, 1e-12):5.1f} %")


def ab(model, prompt, drafter, a) -> None:
    """The Python path against the native step, interleaved: propose's time per draft token."""
    timed(draft_model.DraftModel, "propose", "propose", outer_only=True)
    for mode in a.mode or ["greedy", "t1"]:
        per: dict[str, list[float]] = {"0": [], "1": []}
        for r in range(a.ab):
            for flag in ("0", "1") if r % 2 == 0 else ("1", "0"):
                os.environ["EXACTSPEC_DRAFT_STEP"] = flag
                TIMES.clear()
                COUNTS.clear()
                es.generate(model, prompt, drafter=drafter, params=MODES[mode],
                            max_new_tokens=a.tokens, num_draft_tokens=a.k)
                per[flag].append(1e3 * TIMES["propose"] / max(COUNTS["propose"] * a.k, 1))
        for flag, name in (("0", "Python path"), ("1", "native step")):
            runs = " ".join(f"{v:.2f}" for v in per[flag])
            print(f"{mode} {name}: median {statistics.median(per[flag]):.3f} ms per draft "
                  f"token ({runs})")


if __name__ == "__main__":
    main()
