"""Training data for a draft head: the target's own generations with its features, offline.

For each chat prompt (the shipped `prompts.txt`, held-out `heldout_prompts.txt`) the target
generates a reply (half the prompts sampled at temperature 1, half greedy) with
`output_hidden_states`, and every fed token's features are recorded on the way: the layers the
head reads, the final normed feature (from which the LM head gives the target's p, the soft
label) and the log-normaliser of p over the full vocabulary. No second, teacher-forced pass is
needed. The data are written in parts, so an interrupted build resumes where it stopped.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    """One prompt + reply as the target saw it."""

    tokens: torch.Tensor  # [N] long, every token fed to the target
    feats: torch.Tensor  # [N, L*H] float16, the head's input features at each token
    final: torch.Tensor  # [N, H] float16, the final normed feature (p = softmax(lm_head(final)))
    lse: torch.Tensor  # [N] float32, logsumexp of the target's full-vocabulary logits
    prompt_len: int  # leading tokens that are the (chat-templated) prompt
    greedy: bool  # whether the reply was generated greedily


def read_prompts(name: str = "prompts.txt") -> list[str]:
    """The shipped prompt list (`prompts.txt` for training, `heldout_prompts.txt` for eval)."""
    text = resources.files("exactspec.training").joinpath(name).read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


@torch.inference_mode()
def generate_batch(
    model,  # transformers causal LM
    prompts: list[list[int]],
    *,
    hidden_layers: tuple[int, ...],
    max_new_tokens: int,
    greedy: bool | list[bool],
    eos: list[int],
    generator: torch.Generator,
    mass: torch.Tensor | None = None,  # [V] float64: += the target's p at every position
) -> list[Sequence]:
    """Generate replies for a batch (left-padded) and record features of every fed token.

    `greedy`: for all rows, or one flag per row (the others sample at temperature 1).
    """
    dev = next(model.parameters()).device
    b = len(prompts)
    flags = [greedy] * b if isinstance(greedy, bool) else list(greedy)
    is_greedy = torch.tensor(flags, device=dev)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(b, width, dtype=torch.long)
    attn = torch.zeros(b, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    ids, attn = ids.to(dev), attn.to(dev)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    rec: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in range(b)]
    out_tokens: list[list[int]] = [list(p) for p in prompts]
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    eos_t = torch.tensor(eos or [-1], device=dev)
    step_ids, step_pos, live = ids, pos, attn.bool()  # live: [B, W] positions to record
    for step in range(max_new_tokens + 1):
        out = model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos, cache=cache,
                    use_cache=True, output_hidden_states=True)
        hs = out.hidden_states
        feats = torch.cat([hs[i] for i in hidden_layers], -1).to(torch.float16)  # [B, W, L*H]
        final = hs[-1].to(torch.float16)  # [B, W, H]
        logits = out.logits.float()  # [B, W, V]
        lse = torch.logsumexp(logits, -1)  # [B, W]
        if mass is not None:
            w = torch.exp(logits - lse[..., None]) * live[..., None]
            mass += w.sum((0, 1)).double().cpu()
        for i in range(b):
            sel = live[i]
            if sel.any():
                rec[i].append((feats[i, sel].cpu(), final[i, sel].cpu(), lse[i, sel].cpu()))
        if step == max_new_tokens or bool(done.all()):
            break
        last = logits[:, -1]  # [B, V]
        drawn = torch.multinomial(torch.softmax(last, -1).cpu(), 1, generator=generator)[:, 0]
        nxt = torch.where(is_greedy, last.argmax(-1), drawn.to(dev))
        finished = torch.isin(nxt, eos_t)
        # a token is fed (and recorded) only if the row was still going and it is not an EOS
        feed = ~done & ~finished
        for i in range(b):
            if bool(feed[i]):
                out_tokens[i].append(int(nxt[i]))
        done |= finished
        step_ids = nxt[:, None]
        attn = torch.cat([attn, torch.ones(b, 1, dtype=attn.dtype, device=dev)], 1)
        step_pos = step_pos[:, -1:] + 1
        live = feed[:, None]
    seqs = []
    for i in range(b):
        f, fin, ls = (torch.cat(parts) for parts in zip(*rec[i], strict=True))
        n = len(out_tokens[i])
        assert f.shape[0] == n, (f.shape, n)
        seqs.append(Sequence(torch.tensor(out_tokens[i]), f, fin, ls, len(prompts[i]), flags[i]))
    return seqs


def build_corpus(
    model,  # exactspec Model (with tokenizer)
    prompts: list[str],
    out_dir: Path,
    *,
    hidden_layers: tuple[int, ...],
    max_new_tokens: int,
    batch_size: int = 16,
    seed: int = 0,
    max_batches: int = 0,
    mixed: bool = False,
    desc: str = "data",
) -> list[Sequence]:
    """Generations for the prompts (even index: T=1, odd: greedy), cached in `out_dir` parts.

    Batches of similar-length prompts alternate sampled / greedy, shortest first;
    `max_batches` > 0 keeps only the first that many batches (a data budget). `mixed`: one
    batch per `batch_size` prompts in order, even rows sampled and odd rows greedy (held-out).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tm = model.model
    enc = [model.encode(p, chat=True) for p in prompts]
    per_mode = []  # (part name, greedy, prompt indices), similar lengths together
    for greedy in (False, True):
        idx = sorted(range(int(greedy), len(enc), 2), key=lambda i: len(enc[i]))
        per_mode.append([(f"part-{'g' if greedy else 's'}{start // batch_size:03d}.pt", greedy,
                          idx[start : start + batch_size])
                         for start in range(0, len(idx), batch_size)])
    jobs = [job for pair in itertools.zip_longest(*per_mode) for job in pair if job is not None]
    if mixed:
        jobs = [(f"part-m{start // batch_size:03d}.pt", None,
                 list(range(start, min(start + batch_size, len(enc)))))
                for start in range(0, len(enc), batch_size)]
    if max_batches > 0:
        jobs = jobs[:max_batches]
    seqs: list[Sequence] = []
    mass_path = out_dir / "mass.pt"
    mass = torch.load(mass_path) if mass_path.exists() else torch.zeros(tm.config.vocab_size,
                                                                       dtype=torch.float64)
    for name, greedy, idx in tqdm(jobs, desc=desc, unit="batch"):
        path = out_dir / name
        if path.exists():
            seqs.extend(torch.load(path, weights_only=False))
            continue
        gen = torch.Generator().manual_seed(seed * 100003 + len(seqs))  # depends on the order
        flags = greedy if greedy is not None else [i % 2 == 1 for i in idx]
        part = generate_batch(tm, [enc[i] for i in idx], hidden_layers=hidden_layers,
                              max_new_tokens=max_new_tokens, greedy=flags,
                              eos=model.eos_token_ids, generator=gen, mass=mass)
        torch.save(part, path.with_suffix(".tmp"))
        torch.save(mass, mass_path)
        path.with_suffix(".tmp").rename(path)
        seqs.extend(part)
    return seqs


def draft_vocab(out_dir: Path, size: int, must: list[int]) -> torch.Tensor:  # [size] long
    """The `size` tokens carrying most of the target's mass over the training data (+ `must`)."""
    mass = torch.load(out_dir / "mass.pt")
    mass[torch.tensor(must, dtype=torch.long)] = float("inf")
    size = min(size, mass.numel())
    return mass.topk(size).indices.sort().values


def batches(seqs: list[Sequence], tokens_per_batch: int, gen: torch.Generator):
    """Padded batches of similar-length sequences, shuffled: (collate(rows), prompt_lens [B])."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].tokens))
    groups, cur, width = [], [], 0
    for i in order:
        n = len(seqs[i].tokens)
        if cur and max(width, n) * (len(cur) + 1) > tokens_per_batch:
            groups.append(cur)
            cur, width = [], 0
        cur.append(i)
        width = max(width, n)
    if cur:
        groups.append(cur)
    for g in torch.randperm(len(groups), generator=gen).tolist():
        rows = [seqs[i] for i in groups[g]]
        yield collate(rows), torch.tensor([r.prompt_len for r in rows])


def collate(seqs: list[Sequence]):
    """Right-pad: tokens [B, T] (-1), feats [B, T, L*H], final [B, T, H], lse [B, T], n [B]."""
    n = torch.tensor([len(s.tokens) for s in seqs])
    b, t = len(seqs), int(n.max())
    tokens = torch.full((b, t), -1, dtype=torch.long)
    feats = torch.zeros(b, t, seqs[0].feats.shape[1], dtype=torch.float16)
    final = torch.zeros(b, t, seqs[0].final.shape[1], dtype=torch.float16)
    lse = torch.zeros(b, t)
    for i, s in enumerate(seqs):
        m = len(s.tokens)
        tokens[i, :m], feats[i, :m], final[i, :m], lse[i, :m] = s.tokens, s.feats, s.final, s.lse
    return tokens, feats, final, lse, n

