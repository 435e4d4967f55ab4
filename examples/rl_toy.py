"""A toy policy-gradient loop (GRPO-style) on exact speculative rollouts, with es.Engine.

Each step: the engine samples n completions per prompt from the *current* policy, drafted by
the policy's own int8 copy (es.QuantizedDraft) and verified, so they are distributed exactly as
the policy samples, with its log-probabilities; a toy reward scores them (the share of the
letter "a"); group-normalised advantages weight the trainer's log-likelihood; one optimiser
step; `engine.update_weights(trainer.state_dict())` copies the new weights into the engine's
model in place, and the int8 draft rebuilds itself from them, so acceptance stays high.
The rollouts' logprobs are checked against the trainer's own forward at every step: the
sampler and the learner agree on the policy, which is what makes the update on-policy.

    python examples/rl_toy.py [--steps 8] [--n 8] [--threads 2]

Runs in about a minute on a 2-core CPU: a tiny random Llama over a 49-character vocabulary,
built here (no downloads).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import exactspec as es

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,!?'-0123456789ABCDEFGHIJKLMN"  # + <eos> at id 0
PROMPTS = ["say a", "go", "tell me", "abc", "hello", "x"]
TEMPERATURE = 1.0  # the policy samples at T=1 with no filters: p = softmax(logits)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; id 0 is <eos>."""
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(ALPHABET)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_policy(seed: int) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights (sharpened head, so text is not uniform noise)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(ALPHABET) + 1, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=None, pad_token_id=None,
                      eos_token_id=0, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.generation_config.eos_token_id = 0
    return model


def reward(text: str) -> float:
    """Toy reward: the share of the letter "a" in the completion."""
    return text.count("a") / max(1, len(text))


def sequence_logprob(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(tokens | prompt) under `model` at TEMPERATURE: [len(tokens)] (with gradient)."""
    ids = torch.tensor([prompt + tokens])  # [1, T]
    logits = model(ids).logits[0, len(prompt) - 1:-1] / TEMPERATURE  # [n, V]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    tok = char_tokenizer()
    trainer = tiny_policy(args.seed).train()  # the learner's copy, with gradients
    policy = copy.deepcopy(trainer).eval()  # the engine's copy, updated in place each step
    engine = es.Engine(es.Model(policy, tok, "tiny-policy"), es.QuantizedDraft(8),
                       es.SamplingParams(temperature=TEMPERATURE),
                       max_new_tokens=args.max_new_tokens, num_draft_tokens=4)
    opt = torch.optim.Adam(trainer.parameters(), lr=args.lr)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    means = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        params = es.SamplingParams(temperature=TEMPERATURE, seed=args.seed * 1000 + step)
        groups = engine.generate(prompts, n=args.n, params=params, return_logprobs=True)
        loss = torch.zeros(())
        gap = 0.0  # largest |engine logprob - trainer logprob| over the step's tokens
        rewards = []
        for prompt, group in zip(prompts, groups, strict=True):
            r = torch.tensor([reward(g.text) for g in group])
            rewards += r.tolist()
            adv = (r - r.mean()) / (r.std() + 1e-6)  # group-normalised advantage (GRPO)
            for a, g in zip(adv, group, strict=True):
                if not g.token_ids:
                    continue
                lp = sequence_logprob(trainer, prompt, g.token_ids)
                gap = max(gap, float((lp.detach() - torch.tensor(g.logprobs)).abs().max()))
                loss = loss - a * lp.sum() / len(PROMPTS) / args.n
        opt.zero_grad()
        loss.backward()
        opt.step()
        engine.update_weights(trainer.state_dict())  # in place; the int8 draft rebuilds
        drafted = sum(g.stats.drafted for grp in groups for g in grp)
        accepted = sum(g.stats.accepted for grp in groups for g in grp)
        means.append(statistics.mean(rewards))
        print(f"step {step}: mean reward {means[-1]:.3f}, draft acceptance "
              f"{accepted / max(1, drafted):.2f}, max |logprob gap| {gap:.1e}, "
              f"{time.perf_counter() - t0:.1f} s")
        assert gap < 1e-3, "the engine's logprobs disagree with the trainer's forward"
    return means


if __name__ == "__main__":
    main()
