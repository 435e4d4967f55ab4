"""Training data for a draft head: the target's own generations with its features, offline.

For each chat prompt (the shipped `prompts.txt`, held-out `heldout_prompts.txt`) the target
generates one or more replies (sampled at temperature 1 or greedy, see `reply_is_greedy`) on
the engine's adapter, and every fed token's features are recorded on the way: the layers the
head reads, the final normed feature (from which the LM head gives the target's p, the soft
label) and the log-normaliser of p over the full vocabulary. No second, teacher-forced pass is
needed. The data are written in parts, so an interrupted build resumes where it stopped.
Parts are safetensors with JSON metadata, never pickle: a run directory from someone else
must not be able to run code when it is resumed.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from exactspec.errors import InvalidValue
from exactspec.models.loading import progress_off

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
    model,  # transformers causal LM (or exactspec Model)
    prompts: list[list[int]],
    *,
    hidden_layers: tuple[int, ...],
    max_new_tokens: int,
    greedy: bool | list[bool],
    eos: list[int],
    generator: torch.Generator,
    mass: torch.Tensor | None = None,  # [V] float64: += the target's p at every labelled position
) -> list[Sequence]:
    """Generate replies for a batch and record the features of every fed token.

    Runs on the engine's `TargetAdapter` (lean forward, per-row lengths, finished rows
    dropped), so a batch of 128 replies decodes at several hundred tokens/s on 2 cores.
    `greedy`: for all rows, or one flag per row (the others sample at temperature 1).
    The soft label p (through `lse`) is recorded from the last prompt token on: the positions
    whose next token is part of the reply; earlier prompt positions get lse = NaN.
    """
    from exactspec.models.adapter import TargetAdapter, unwrap_model
    from exactspec.sampling.streams import sample

    tm = unwrap_model(model)
    dev = next(tm.parameters()).device
    b = len(prompts)
    flags = [greedy] * b if isinstance(greedy, bool) else list(greedy)
    n_states = tm.config.num_hidden_layers + 1
    # the final normed feature gives p; request it too when the head does not read it
    has_final = any(j % n_states == n_states - 1 for j in hidden_layers)
    layers = tuple(hidden_layers) + (() if has_final else (-1,))
    h = tm.config.hidden_size
    n_head = len(hidden_layers) * h
    lm = tm.get_output_embeddings().weight  # [V, H]
    adapter = TargetAdapter(tm)
    feats0 = adapter.prefill(prompts, capacity=max(len(p) for p in prompts) + max_new_tokens + 1,
                             hidden_layers=layers)  # [B, W, F]
    plen = [len(p) for p in prompts]
    rows = torch.arange(b, device=dev)
    last = feats0[rows, torch.tensor(plen, device=dev) - 1, -h:]  # [B, H] final feature
    logits = last.float() @ lm.float().T  # [B, V] the distribution of the first reply token
    labels: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step: rows [R], their lse [R]
    fed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # rows, tokens, feats
    is_greedy = torch.tensor(flags, device=dev)
    eos_t = torch.tensor(eos or [-1], device=dev)
    for step in range(max_new_tokens + 1):
        lse = torch.logsumexp(logits, -1)  # [R] the label's normaliser at the row's last token
        labels.append((rows.cpu(), lse.cpu()))
        p = torch.exp(logits - lse[:, None])  # [R, V]
        if mass is not None:
            mass += p.sum(0).double().cpu()
        if step == max_new_tokens:
            break
        drawn = sample(p, generator)  # inverse CDF: torch.multinomial took 18% of the time here
        nxt = torch.where(is_greedy[rows], logits.argmax(-1), drawn)  # [R]
        go = ~torch.isin(nxt, eos_t)  # an EOS ends the row and is not fed (nor recorded)
        if not bool(go.all()):
            keep = go.nonzero()[:, 0]
            adapter.select(keep)
            rows, nxt = rows[keep], nxt[keep]
        if rows.numel() == 0:
            break
        out, f = adapter.extend(nxt[:, None], hidden_layers=layers)  # [R, 1, V], [R, 1, F]
        adapter.commit(torch.ones_like(nxt))
        logits = out[:, 0].float()
        fed.append((rows.cpu(), nxt.cpu(), f[:, 0].to(torch.float16).cpu()))
    # stitch per row: a step's lse belongs to the row's last token, its feats to the fed token
    lse_rows, lse_all = (torch.cat(parts) for parts in zip(*labels, strict=True))
    if fed:
        fed_rows, fed_tok, fed_f = (torch.cat(parts) for parts in zip(*fed, strict=True))
    else:
        fed_rows = fed_tok = torch.zeros(0, dtype=torch.long)
        fed_f = torch.zeros(0, feats0.shape[-1], dtype=torch.float16)
    seqs = []
    for i in range(b):
        sel = fed_rows == i
        toks = torch.cat([torch.tensor(prompts[i], dtype=torch.long), fed_tok[sel]])
        f = torch.cat([feats0[i, : plen[i]].to(torch.float16).cpu(), fed_f[sel]])  # [N, F]
        n = len(toks)
        assert f.shape[0] == n, (f.shape, n)
        lse = torch.full((n,), float("nan"))
        lse[plen[i] - 1 :] = lse_all[lse_rows == i]
        seqs.append(Sequence(toks, f[:, :n_head].contiguous(), f[:, -h:].contiguous(), lse,
                             plen[i], flags[i]))
    return seqs


def reply_is_greedy(prompt_index: int, reply: int, replies: int) -> bool:
    """Which replies are greedy: with one reply per prompt, odd prompts; with several, the
    second reply of every prompt (the others sample at temperature 1)."""
    return prompt_index % 2 == 1 if replies == 1 else reply == 1


def build_corpus(
    model,  # exactspec Model (with tokenizer)
    prompts: list[str],
    out_dir: Path,
    *,
    hidden_layers: tuple[int, ...],
    max_new_tokens: int,
    replies: int = 1,
    batch_size: int = 16,
    seed: int = 0,
    max_batches: int = 0,
    desc: str = "data",
) -> list[Sequence]:
    """`replies` generations per prompt (see `reply_is_greedy`), cached in `out_dir` parts.

    Rows are sorted by prompt length and cut into batches of `batch_size`; each batch is one
    part file, a deterministic function of its rows and `seed`, so an interrupted build resumes
    at the first missing part. `max_batches` > 0 keeps only the first that many (a data budget).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    enc = [model.encode(p, chat=True) for p in prompts]
    rows = sorted(((i, r) for i in range(len(enc)) for r in range(replies)),
                  key=lambda ir: (len(enc[ir[0]]), ir[0], ir[1]))
    jobs = [rows[start : start + batch_size] for start in range(0, len(rows), batch_size)]
    if max_batches > 0:
        jobs = jobs[:max_batches]
    seqs: list[Sequence] = []
    mass_path = out_dir / MASS
    vocab = model.model.config.vocab_size
    mass = (read_tensors(mass_path)["mass"] if mass_path.exists()
            else torch.zeros(vocab, dtype=torch.float64))
    if any(out_dir.glob("part-*.pt")):
        log.warning("ignoring pickle data parts (part-*.pt) in %s, written by an older exactspec "
                    "and unsafe to load; rebuilding them as safetensors", out_dir)
    for k, job in enumerate(tqdm(jobs, desc=desc, unit="batch", disable=progress_off())):
        path = out_dir / f"part-{k:04d}.safetensors"
        if path.exists():
            seqs.extend(read_part(path))
            continue
        gen = torch.Generator().manual_seed(seed * 100003 + k)
        flags = [reply_is_greedy(i, r, replies) for i, r in job]
        part = generate_batch(model.model, [enc[i] for i, _ in job], hidden_layers=hidden_layers,
                              max_new_tokens=max_new_tokens, greedy=flags,
                              eos=model.eos_token_ids, generator=gen, mass=mass)
        write_tensors(mass_path, {"mass": mass})
        write_part(path, part)  # last: a part on disk means its mass is counted
        seqs.extend(part)
    return seqs


def load_parts(out_dir: Path) -> list[Sequence]:
    """Every sequence `build_corpus` wrote to `out_dir`, in part order."""
    return [s for path in sorted(Path(out_dir).glob("part-*.safetensors")) for s in read_part(path)]


# --- files: safetensors + JSON metadata, never pickle (a run directory may come from anyone) ---

MASS = "mass.safetensors"  # the target's p mass per token over the labelled positions
_FIELDS = ("tokens", "feats", "final", "lse")  # Sequence's tensors, stored per sequence


def write_tensors(path: Path, tensors: dict[str, torch.Tensor],
                  meta: dict[str, str] | None = None) -> None:
    """Write a safetensors file atomically (tmp + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
    os.replace(tmp, path)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; InvalidValue naming the file if it is not one."""
    return _read(path)[0]


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())  # safe_open is not iterable
            return {k: f.get_tensor(k) for k in names}, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as exc:
        raise InvalidValue(f"{path} is not a readable safetensors file ({exc}); delete it to "
                           "rebuild it") from exc


def write_part(path: Path, part: list[Sequence]) -> None:
    """One data part: each sequence's tensors as `i.tokens` ..., the rest as JSON metadata."""
    tensors = {f"{i}.{name}": getattr(s, name) for i, s in enumerate(part) for name in _FIELDS}
    rows = [{"prompt_len": s.prompt_len, "greedy": s.greedy} for s in part]
    write_tensors(path, tensors, {"sequences": json.dumps(rows)})


def read_part(path: Path) -> list[Sequence]:
    """The sequences `write_part` stored in `path`."""
    tensors, meta = _read(path)
    try:
        rows = json.loads(meta["sequences"])
        return [Sequence(*(tensors[f"{i}.{name}"] for name in _FIELDS),
                         prompt_len=int(r["prompt_len"]), greedy=bool(r["greedy"]))
                for i, r in enumerate(rows)]
    except (KeyError, ValueError, TypeError) as exc:
        raise InvalidValue(f"{path} is not a data part written by exactspec ({exc!r}); delete it "
                           "to rebuild it") from exc


def draft_vocab(out_dir: Path, size: int, must: list[int]) -> torch.Tensor:  # [size] long
    """The `size` tokens carrying most of the target's mass over the training data (+ `must`)."""
    mass = read_tensors(out_dir / MASS)["mass"]
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

