"""Two steps of TRL's GRPOTrainer on the embedded model, with exactspec's exact rollouts.

The rollouts come from `exactspec.integrations.trl.make_rollout_func(es.QuantizedDraft(8))`:
each step the function copies the policy's new weights into its engine (`update_weights`), the
int8 self-draft rebuilds itself from them, and the completions are drawn exactly as the policy
samples them, with their log p. A toy reward (the share of the letter "a" in the answer) drives
the update. Per step it prints the largest |rollout log p - trainer log p| over the step's tokens
(the trainer's own scoring: its model's fused LM head at its temperature, on the weights of that
step) and the draft's acceptance, overall and per draft position.

    python examples/trl_grpo.py [--steps 2] [--prompts 2] [--group 4] [--max-new-tokens 24]
                                [--threads 2] [--backend auto|torch|llama.cpp]

A few minutes on 2 CPU cores (smollm2-135m in float32; converted into the cache on first use).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

import exactspec as es
from exactspec.integrations.trl import make_rollout_func

QUESTIONS = ["Name a fruit.", "Say something about cats.", "What is a banana?",
             "Give me an animal name."]


def share_of_a(completions, **kwargs) -> list[float]:
    """Toy reward: the share of the letter "a" in the assistant's answer."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [t.count("a") / max(1, len(t)) for t in texts]


def trainer_logprobs(trainer, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """log p of each completion token as GRPOTrainer scores it: [n]."""
    ids = torch.tensor([prompt_ids + completion_ids])  # [1, T]
    labels = ids.clone()
    labels[:, :len(prompt_ids)] = -100  # only the completion is scored
    with torch.no_grad():
        out = trainer.model(input_ids=ids, labels=labels, fused_lm_head=True)
    return out.log_probs[0, -len(completion_ids):]


class Report:
    """Wraps the rollout function: after each call, prints the step's log p gap and acceptance."""

    def __init__(self, rollout) -> None:
        self.rollout = rollout
        self.gaps: list[float] = []

    def __call__(self, prompts, trainer):
        out = self.rollout(prompts, trainer)
        gap = max(float((trainer_logprobs(trainer, p, c) - torch.tensor(lp)).abs().max())
                  for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"],
                                      strict=True))
        self.gaps.append(gap)
        s = self.rollout.last
        per = " ".join(f"{a:.2f}" for a in s.acceptance_per_position)
        print(f"step {s.policy_version}: {s.samples} rollouts, {s.tokens} tokens in "
              f"{s.seconds:.1f} s; max |rollout log p - trainer log p| = {gap:.1e}; draft "
              f"acceptance {s.acceptance_rate:.2f} (per position {per}), "
              f"{s.mean_acceptance_length:.2f} tokens per target step", flush=True)
        return out


def main(argv: list[str] | None = None) -> Report:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2, help="distinct prompts per step")
    ap.add_argument("--group", type=int, default=4, help="num_generations (GRPO group)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="auto", help="the int8 draft's backend")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    target = es.load("smollm2-135m")
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS[:args.prompts]]
    report = Report(make_rollout_func(es.QuantizedDraft(8, backend=args.backend),
                                      num_draft_tokens=4))
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir, max_steps=args.steps, learning_rate=args.lr,
            per_device_train_batch_size=args.prompts * args.group,
            num_generations=args.group, max_completion_length=args.max_new_tokens,
            temperature=1.0, bf16=False, use_cpu=True, report_to="none", save_strategy="no",
            logging_steps=1, disable_tqdm=True, seed=0, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=target.model, reward_funcs=share_of_a, args=config,
                              train_dataset=Dataset.from_dict({"prompt": prompts * args.steps}),
                              processing_class=target.tokenizer, rollout_func=report)
        t0 = time.perf_counter()
        trainer.train()
    print(f"{args.steps} GRPO steps in {time.perf_counter() - t0:.0f} s; max |log p gap| over "
          f"all steps {max(report.gaps):.1e}")
    return report


if __name__ == "__main__":
    main()
