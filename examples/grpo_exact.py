"""A toy GRPO loop that is on-policy to the last bit: speculative rollouts, trainer log p equal.

    python examples/grpo_exact.py [--steps 4] [--no-speculation]

A tiny random Llama learns to say the token 7 more often. Each step: the engine
(`es.Engine(..., batch_invariant=True)` with the int8 self-draft, so rollouts are speculative)
draws n completions per prompt with their logprobs; the trainer scores the same tokens with
`es.token_logprobs` under `es.batch_invariant()` (one padded batch, training mode, with grad),
forms group-normalised advantages, takes an Adam step on the clipped-ratio loss, and hands the
new weights to the engine with `update_weights`. Printed per step: the largest
|rollout log p - trainer log p| with the mode (0 exactly) and without it (transformers'
ordinary forward: float rounding), the importance ratio's largest distance from 1, and the
mean reward.
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import exactspec as es

GOOD = 7  # the token the reward counts


def policy_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # less uniform text
    model.generation_config.eos_token_id = None
    return model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--group", type=int, default=4, help="completions per prompt")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per completion")
    ap.add_argument("--no-speculation", action="store_true", help="plain rollouts")
    a = ap.parse_args(argv)

    policy = policy_model().train()  # the trainer's model
    engine = es.Engine(copy.deepcopy(policy).eval(),  # the rollout engine's own copy
                       None if a.no_speculation else es.QuantizedDraft(8),
                       es.SamplingParams(temperature=1.0), max_new_tokens=a.tokens,
                       batch_invariant=True)
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15, 16]]
    print(f"{'step':>4} {'max|d| mode':>12} {'max|d| plain':>13} {'max|ratio-1|':>13} "
          f"{'reward':>7} {'accepted':>9}")
    for step in range(a.steps):
        out = engine.generate(prompts, n=a.group, params=es.SamplingParams(seed=step))
        gens = [g for row in out for g in row]
        rows = [p for p in prompts for _ in range(a.group)]
        seqs = [p + g.token_ids for p, g in zip(rows, gens, strict=True)]
        plens = [len(p) for p in rows]
        rollout = torch.zeros(len(gens), a.tokens)  # [B, C] the engine's log p
        for i, g in enumerate(gens):
            rollout[i, : len(g.logprobs)] = torch.tensor(g.logprobs)
        reward = torch.tensor([g.token_ids.count(GOOD) / len(g.token_ids) for g in gens])
        grouped = reward.view(len(prompts), a.group)  # GRPO: advantages within each group
        adv = ((grouped - grouped.mean(1, keepdim=True))
               / (grouped.std(1, keepdim=True) + 1e-4)).view(-1, 1)  # [B, 1]
        with es.batch_invariant():
            trainer = es.token_logprobs(policy, seqs, plens, engine.params)  # [B, C], grad
        with torch.no_grad():
            plain = es.token_logprobs(policy, seqs, plens, engine.params)  # ordinary forward
        ratio = torch.exp(trainer - rollout)  # the importance ratio: 1 exactly on-policy
        loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        engine.update_weights(policy.state_dict())  # the next rollouts follow the new policy
        accepted = sum(g.stats.accepted for g in gens)
        print(f"{step:>4} {(trainer - rollout).abs().max().item():>12.3g} "
              f"{(plain - rollout).abs().max().item():>13.3g} "
              f"{(ratio - 1).abs().max().item():>13.3g} {reward.mean().item():>7.3f} "
              f"{accepted:>9}")


if __name__ == "__main__":
    main()
