"""train_draft: build data, train an EagleHead with training-time test, checkpoint, evaluate.

Loss at chain depth d (1..depth, the head rolled forward on its own outputs exactly as in
decoding) is the cross-entropy of the head's draft-vocabulary distribution against the
target's p at temperature 1 (soft labels, computed on the fly from the recorded final feature:
p_v = exp(lm_head(final)_v - lse)), weighted by decay^(d-1); forward KL up to a constant, which
maximises the acceptance rate sum_x min(p, q) in the limit. Labels inside the prompt are
skipped (the drafter only drafts replies).
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from exactspec.drafters.eagle import save_head
from exactspec.drafters.eagle_head import EagleConfig, EagleHead, num_trainable
from exactspec.errors import InvalidValue
from exactspec.models.loading import progress_off
from exactspec.training.data import Sequence, batches, build_corpus, draft_vocab, read_prompts

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"  # resumable state in the output directory (tensors, no objects)
CONFIG = "train-config.json"  # the TrainConfig of the run in the output directory
HEAD_DIR = "head"  # the trained head (load_drafter(OUT / "head"))
# TrainConfig fields a resumed run may change: the budgets and the notes
BUDGET_FIELDS = ("minutes", "max_steps", "checkpoint_seconds", "extra")


@dataclass
class TrainConfig:
    """Everything that decides the trained head; written to OUT/train-config.json."""

    model: str = "smollm2-135m"  # target: embedded name or path
    minutes: float = 30.0  # wall-clock budget of the training loop (data building excluded)
    max_steps: int = 0  # stop after this many optimizer steps as well (0 = only the clock)
    hidden_layers: tuple[int, ...] = (4, 16, -1)  # target features the head reads
    draft_vocab_size: int = 8192  # tokens the head can propose (most target mass)
    depth: int = 3  # training-time-test unroll depth
    decay: float = 0.8  # loss weight of depth d is decay^(d-1)
    lr: float = 1e-3  # AdamW peak learning rate (cosine to lr/10 over the budget)
    warmup: int = 30  # linear warmup steps
    weight_decay: float = 0.0  # AdamW weight decay
    tokens_per_batch: int = 2048  # padded tokens per optimizer step
    init_from_target: bool = True  # start the head's layer from the target's last layer
    max_new_tokens: int = 192  # reply length of the generated training data
    replies: int = 2  # replies per training prompt (one greedy, the others sampled at T=1)
    data_batch: int = 128  # rows per generation batch
    data_batches: int = 0  # generation batches of training data (0 = every prompt)
    eval_new_tokens: int = 96  # reply length of the held-out generations
    eval_depth: int = 4  # K for the evaluation
    seed: int = 0  # data sampling, shuffling and init
    checkpoint_seconds: float = 60.0  # checkpoint at least this often
    prompts: list[str] | None = None  # training prompts (None: the shipped prompts.txt)
    heldout: list[str] | None = None  # eval prompts (None: the shipped heldout_prompts.txt)
    extra: dict = field(default_factory=dict)  # free-form notes copied into the head's meta

    def to_json(self) -> dict:
        d = asdict(self)
        d["hidden_layers"] = list(self.hidden_layers)
        return d


@dataclass
class TrainResult:
    """What train_draft produced."""

    head_dir: Path  # load_drafter(head_dir)
    steps: int  # optimizer steps taken
    train_seconds: float  # time in the training loop (all sessions, resumed included)
    data_seconds: float  # time building data in this call
    eval: dict  # evaluate_head's numbers
    loss_png: Path  # the loss curve


def _lr(cfg: TrainConfig, step: int, frac: float) -> float:
    warm = min(1.0, (step + 1) / max(cfg.warmup, 1))
    return cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def init_head(cfg: TrainConfig, target, vocab_ids: torch.Tensor) -> EagleHead:
    """A fresh head for `target` (transformers model).

    Init: g = the last listed target layer's feature, x = g (fc passes g, the embedding part
    starts near 0), and the layer copied from the target's last layer with its output
    projections scaled by 0.1, so the head starts near "predict from the last feature" with
    moderate logits instead of a random, very peaked distribution.
    """
    torch.manual_seed(cfg.seed)
    conf = EagleConfig.for_target(target.config, cfg.hidden_layers, int(vocab_ids.numel()))
    head = EagleHead(conf)
    head.set_vocab(vocab_ids)
    h = conf.hidden_size
    with torch.no_grad():
        head.fc_in.weight.zero_()
        head.fc_in.weight[:, -h:] = torch.eye(h)
        head.fc.weight.zero_()
        head.fc.weight[:, :h] = torch.eye(h)
        head.fc.weight[:, h:] = torch.randn(h, h) * 0.01
    if cfg.init_from_target:
        layer = target.get_decoder().layers[-1]
        pairs = {"q_proj": layer.self_attn.q_proj, "k_proj": layer.self_attn.k_proj,
                 "v_proj": layer.self_attn.v_proj, "o_proj": layer.self_attn.o_proj,
                 "gate": layer.mlp.gate_proj, "up": layer.mlp.up_proj,
                 "down": layer.mlp.down_proj, "norm_attn": layer.input_layernorm,
                 "norm_mlp": layer.post_attention_layernorm}
        with torch.no_grad():
            for name, src in pairs.items():
                getattr(head, name).weight.copy_(src.weight)
            head.o_proj.weight.mul_(0.1)
            head.down.weight.mul_(0.1)
    head.attach(target)
    return head


def step_loss(head: EagleHead, batch, cfg: TrainConfig, prompt_lens: torch.Tensor):
    """Weighted loss and per-depth (loss, alpha estimate) on one padded batch."""
    tokens, feats, final, lse, n = batch  # [B, T], [B, T, L*H], [B, T, H], [B, T], [B]
    b, t = tokens.shape
    with torch.no_grad():
        tl = final.float() @ head.lm_weight.float().T  # [B, T, Vd] target logits (final is normed)
        p = torch.exp(tl - lse[..., None])  # [B, T, Vd] target p (mass outside Vd dropped)
    outs = head.unroll(feats, tokens, cfg.depth)
    idx = torch.arange(t)[None, :]
    total, stats = 0.0, []
    for d, o in enumerate(outs, start=1):
        lab = (idx + d).expand(b, t)  # label position s+d
        mask = (lab < n[:, None]) & (lab >= prompt_lens[:, None])  # [B, T]
        if not mask.any():
            stats.append((0.0, 0.0))
            continue
        logq = torch.log_softmax(head.logits(o[mask]), -1)  # [M, Vd]
        lab_p = p[torch.arange(b)[:, None].expand(b, t)[mask], lab[mask]]  # [M, Vd]
        loss = -(lab_p * logq).sum(-1).mean()
        total = total + cfg.decay ** (d - 1) * loss
        with torch.no_grad():
            alpha = torch.minimum(lab_p, logq.exp()).sum(-1).mean()
        stats.append((float(loss.detach()), float(alpha)))
    return total, stats


def train_draft(cfg: TrainConfig, out_dir: str | Path, *, resume: bool = False,
                model=None) -> TrainResult:
    """Build the data (cached in OUT/data), train (resumable), save OUT/head, plot, evaluate.

    `model`: an exactspec Model to use instead of loading `cfg.model` (tests pass tiny ones).
    """
    from exactspec.models.loading import load
    from exactspec.training.evaluate import evaluate_head, plot_losses

    out = Path(out_dir)
    ckpt_path = out / CHECKPOINT
    if ckpt_path.exists() and not resume:
        raise InvalidValue(f"{ckpt_path} exists: pass --resume to continue it, or use a new --out")
    if resume and not ckpt_path.exists():
        raise InvalidValue(f"--resume: {out} holds no {CHECKPOINT} to continue; run without "
                           "--resume (data already built there is reused)")
    check_same_run(cfg, out)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
    target = model if model is not None else load(cfg.model)
    tm = target.model

    t0 = time.time()
    prompts = cfg.prompts if cfg.prompts is not None else read_prompts()
    heldout = cfg.heldout if cfg.heldout is not None else read_prompts("heldout_prompts.txt")
    seqs = build_corpus(target, prompts, out / "data" / "train", hidden_layers=cfg.hidden_layers,
                        max_new_tokens=cfg.max_new_tokens, replies=cfg.replies,
                        batch_size=cfg.data_batch, seed=cfg.seed, max_batches=cfg.data_batches,
                        desc="train data")
    # every held-out prompt twice: sampled at T=1 and greedy
    held = build_corpus(target, heldout, out / "data" / "heldout", replies=2,
                        hidden_layers=cfg.hidden_layers, max_new_tokens=cfg.eval_new_tokens,
                        batch_size=cfg.data_batch, seed=cfg.seed + 1, desc="held-out data")
    data_seconds = time.time() - t0
    n_tok = sum(len(s.tokens) for s in seqs)
    log.info("data: %d sequences, %d tokens (%.0f s)", len(seqs), n_tok, data_seconds)

    vocab_ids = draft_vocab(out / "data" / "train", cfg.draft_vocab_size, target.eos_token_ids)
    head = init_head(cfg, tm, vocab_ids)
    state = fit(head, tm, seqs, cfg, ckpt_path, resume=resume)
    head.eval()
    head.config.meta = {"target": cfg.model, "steps": state["step"],
                        "train_seconds": round(state["elapsed"], 1),
                        "train_tokens": n_tok, **cfg.extra}
    head_dir = out / HEAD_DIR
    save_head(head, head_dir)
    png = plot_losses(state["history"], out / "loss.png")
    result = evaluate_head(head, held, depth=cfg.eval_depth)
    result.update(steps=state["step"], train_seconds=round(state["elapsed"], 1),
                  data_seconds=round(data_seconds, 1), train_tokens=n_tok,
                  train_sequences=len(seqs), heldout_sequences=len(held),
                  trainable_params=num_trainable(head))
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return TrainResult(head_dir, state["step"], state["elapsed"], data_seconds, result, png)


def check_same_run(cfg: TrainConfig, out: Path) -> None:
    """InvalidValue if `out` holds data or a checkpoint of a run with other settings.

    Its data parts and checkpoint would be reused as they are, silently ignoring the new
    settings; only BUDGET_FIELDS may change between a run and its continuation.
    """
    saved_path = out / CONFIG
    if not saved_path.exists() or not ((out / CHECKPOINT).exists() or (out / "data").exists()):
        return
    try:
        saved = json.loads(saved_path.read_text())
    except ValueError as exc:
        raise InvalidValue(f"{saved_path} is not JSON ({exc}); use a new --out") from exc
    new = cfg.to_json()
    changed = [k for k in new if k not in BUDGET_FIELDS and saved.get(k) != new[k]]
    if changed:
        diffs = ", ".join(f"{k}={saved.get(k)!r} there, {new[k]!r} now" for k in changed)
        raise InvalidValue(f"{out} holds a run with other settings ({diffs}); its data and "
                           "checkpoint would be reused as they are: use a new --out, or the same "
                           "settings (only --minutes and --max-steps may change)")


def load_checkpoint(path: Path) -> dict:
    """The checkpoint dict, read with torch.load(weights_only=True): tensors and plain
    containers only, so a crafted file cannot run code; anything else is refused."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise InvalidValue(f"{path} holds more than tensors and plain values (refused: loading "
                           "it could run code); delete it or use a new --out") from exc
    except (EOFError, RuntimeError) as exc:
        raise InvalidValue(f"{path} is not a readable checkpoint ({exc}); delete it or use a "
                           "new --out") from exc


def fit(head: EagleHead, target, seqs: list[Sequence], cfg: TrainConfig, ckpt_path: Path, *,
        resume: bool = False, desc: str = "train-draft") -> dict:
    """Train `head` (attached to `target`, a transformers model) on `seqs` until cfg.minutes of
    loop time or cfg.max_steps, checkpointing to `ckpt_path` (resumed from it when `resume`).
    Returns the state: step, elapsed (seconds in the loop), history (per-step loss and alpha)."""
    for p in target.parameters():  # the shared embedding, norm and LM head stay frozen
        p.requires_grad_(False)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    state = {"step": 0, "elapsed": 0.0, "history": [], "epoch": 0}
    if resume and ckpt_path.exists():
        ck = load_checkpoint(ckpt_path)
        head.load_state_dict(ck["head"])
        head.attach(target)
        opt.load_state_dict(ck["opt"])
        state = ck["state"]
        log.info("resumed at step %d (%.0f s trained)", state["step"], state["elapsed"])

    def save_checkpoint() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "state": state}, tmp)
        tmp.rename(ckpt_path)

    budget = cfg.minutes * 60.0
    head.train()
    # progress in seconds of the time budget, or in steps when only max_steps bounds the loop
    bar = tqdm(total=int(budget) if budget else cfg.max_steps,
               initial=int(min(state["elapsed"], budget)) if budget else state["step"],
               unit="s" if budget else " steps", desc=desc, disable=progress_off(),
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}{unit} {postfix}")
    last_ck = time.time()
    done = False
    while not done:
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + state["epoch"])
        order = list(batches(seqs, cfg.tokens_per_batch, gen))
        for i, (batch, prompt_lens) in enumerate(order):
            if i < state.get("batch_in_epoch", 0):
                continue  # resumed mid-epoch: the same shuffled order, skip what was done
            if (budget and state["elapsed"] >= budget) or (
                    cfg.max_steps and state["step"] >= cfg.max_steps):
                done = True
                break
            t_step = time.time()
            frac = max(state["elapsed"] / budget if budget else 0.0,
                       state["step"] / cfg.max_steps if cfg.max_steps else 0.0)
            for group in opt.param_groups:
                group["lr"] = _lr(cfg, state["step"], frac)
            loss, stats = step_loss(head, batch, cfg, prompt_lens)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            dt = time.time() - t_step
            state["step"] += 1
            state["elapsed"] += dt
            state["batch_in_epoch"] = i + 1
            state["history"].append({"step": state["step"], "t": state["elapsed"],
                                     "loss": float(loss.detach()), "depth": stats})
            bar.update(min(dt, max(budget - bar.n, 0)) if budget else 1)
            bar.set_postfix_str(f"step {state['step']} loss {float(loss.detach()):.3f} "
                                f"a1 {stats[0][1]:.2f}")
            if time.time() - last_ck > cfg.checkpoint_seconds:
                save_checkpoint()
                last_ck = time.time()
        else:
            state["epoch"] += 1
            state["batch_in_epoch"] = 0
    bar.close()
    save_checkpoint()
    return state


__all__ = ["CHECKPOINT", "CONFIG", "HEAD_DIR", "TrainConfig", "TrainResult", "batches",
           "check_same_run", "fit", "load_checkpoint", "train_draft"]
