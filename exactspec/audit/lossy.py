"""The price of each lossy verify rule: exact drift on the audit's worlds, measured drift on a
tiny model, and what it buys in acceptance length (`exactspec audit --lossy`).

For every rule string of a grid ("lenient:L", "typical:EPS", with "token" as the exact baseline):
- on the audit's worlds (V = 4, K = 3): the exact TV from the target of one step's first
  token ("step TV") and of the first L tokens ("sequence TV"), and the exact expected tokens
  emitted by one step (E[accepted] + 1), all by enumeration through the rule's AcceptanceLaw;
- on a tiny random Llama pair (V = 8, built from a config, no download): the exact TV of the
  first N generated tokens, and the same drift measured from `generate(..., verify=rule)`
  with its error bound, and the measured mean acceptance length.
The bound: the measured TV differs from the exact one by at most TV(empirical, exact lossy
law) <= E + sqrt(ln(1 / alpha) / (2 n)) with probability >= 1 - alpha (McDiarmid: one sample
moves the empirical TV by at most 1 / n), where E = 1/2 sum sqrt(pi (1 - pi) / n) >= its mean
(Jensen), computed from the exact lossy law pi.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from exactspec.audit.exact import expected_accepted, output_law, tv_distance
from exactspec.audit.samplers import Speculative, sequence_ids
from exactspec.audit.stats import ALPHA, bincount
from exactspec.audit.world import World, folded_world, logits_table, model_world, random_world
from exactspec.audit.world import target_law as exact_target_law
from exactspec.sampling import SamplingParams, parse_lossy

DEFAULT_RULES = ("token", "lenient:0.9", "lenient:0.7", "lenient:0.5", "lenient:0.3",
                 "lenient:0.1", "typical:0.01", "typical:0.05", "typical:0.09", "typical:0.2",
                 "typical:0.4")
MODEL_PROMPT = (1, 2, 3, 1, 2)  # the tiny model's prompt


@dataclass(frozen=True)
class LossyConfig:
    """Sizes of the lossy audit; the defaults run in a few minutes on 2 cores."""

    rules: tuple[str, ...] = DEFAULT_RULES  # verify methods compared ("token" is the baseline)
    vocab: int = 4  # V of the audit worlds
    num_draft: int = 3  # K on the worlds
    length: int = 4  # L: tokens of the worlds' sequence-level law
    model_vocab: int = 8  # V of the tiny model
    model_draft: int = 2  # K on the tiny model
    model_tokens: int = 2  # N: generated tokens whose law is compared on the tiny model
    model_new_tokens: int = 10  # max_new_tokens of the generations (>= N + K: K drafts always)
    rows: int = 20_000  # sequences generated per rule on the tiny model
    params: SamplingParams = field(default_factory=SamplingParams)  # tiny model's sampling (T=1)
    alpha: float = ALPHA  # the bound on measured drift holds with probability 1 - alpha
    seed: int = 0  # seed of the generations


@dataclass
class LossyRow:
    """One rule's price and gain."""

    rule: str  # the verify method string
    step_tv: float  # exact TV of one step's first token, mean over the worlds
    sequence_tv: float  # exact TV of the first L tokens, mean over the worlds
    step_tokens: float  # exact tokens per step (E[accepted] + 1), mean over the worlds
    model_tv: float  # exact TV of the tiny model's first N tokens
    model_step_tokens: float  # exact tokens per step of the tiny model's first step
    measured_tv: float  # TV of the generated first N tokens from the target's exact law
    bound: float  # |measured_tv - model_tv| <= bound with probability >= 1 - alpha
    acceptance_length: float  # measured tokens per target step on the tiny model (whole rows)
    gain: float  # acceptance_length / that of the exact "token" rule

    @property
    def lossless(self) -> bool:
        return parse_lossy(self.rule) is None


def audit_worlds(cfg: LossyConfig) -> list[World]:
    """The worlds the exact columns average over: random p/q, point mass, folded temperature."""
    v, d = cfg.vocab, cfg.length + cfg.num_draft
    return [random_world(v, d, 1), random_world(v, d, 3, draft="point_mass"),
            folded_world(v, d, SamplingParams(temperature=0.7, top_k=3), 10)]


def tiny_pair(vocab: int, seed: int = 0):
    """A tiny random Llama target and draft (float32, eval) with a spread of probabilities."""
    from transformers import LlamaConfig, LlamaForCausalLM

    models = []
    for s in (seed, seed + 1):
        torch.manual_seed(s)
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64, bos_token_id=None, pad_token_id=None,
                          eos_token_id=None, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(5.0)
        model.generation_config.eos_token_id = None  # every row makes its tokens
        models.append(model)
    return models[0], models[1]


def drift_bound(law: torch.Tensor, rows: int, alpha: float) -> float:
    """Bound on TV(empirical law of `rows` draws, law) holding with probability >= 1 - alpha."""
    law = law.to(torch.float64).clamp(min=0)
    mean = 0.5 * float(torch.sqrt(law * (1 - law) / rows).sum())
    return mean + math.sqrt(math.log(1 / alpha) / (2 * rows))


def measure(target, draft, rule: str, cfg: LossyConfig, seed: int
            ) -> tuple[torch.Tensor, float]:  # counts [V**N], tokens per target step
    """Generate cfg.rows sequences with `rule`; counts of their first N tokens."""
    from exactspec.drafters import DraftModel
    from exactspec.engine import generate

    n, k = cfg.model_tokens, cfg.model_draft
    assert cfg.model_new_tokens >= n + k, "steps within the first N tokens must draft K"
    gens = generate(target, [list(MODEL_PROMPT)] * cfg.rows, drafter=DraftModel(draft),
                    params=replace(cfg.params, seed=seed), max_new_tokens=cfg.model_new_tokens,
                    num_draft_tokens=k, verify=rule, batch_size=cfg.rows)
    seqs = torch.tensor([g.token_ids[:n] for g in gens])  # [rows, N]
    steps = sum(g.stats.steps for g in gens)
    emitted = sum(g.stats.emitted for g in gens)
    return bincount(sequence_ids(seqs, cfg.model_vocab), cfg.model_vocab**n), emitted / steps


def model_tables(cfg: LossyConfig):
    """The tiny pair and its exact world (p and q after every context the test can reach)."""
    target, draft = tiny_pair(cfg.model_vocab)
    depth = cfg.model_tokens + cfg.model_draft
    tables = [logits_table(lambda ids, m=m: m(ids).logits, MODEL_PROMPT, cfg.model_vocab, depth)
              for m in (target, draft)]
    world = model_world(tables[0], tables[1], cfg.model_vocab, depth, cfg.params, MODEL_PROMPT)
    return target, draft, world


def run_lossy(cfg: LossyConfig | None = None, *, progress: bool = True) -> list[LossyRow]:
    """One row per rule of cfg.rules (exact baseline "token" first if absent)."""
    from exactspec.audit.report import one_thread

    cfg = cfg or LossyConfig()
    rules = cfg.rules if "token" in cfg.rules else ("token", *cfg.rules)
    for r in rules:
        parse_lossy(r)  # every rule string valid before any work
    rows: list[LossyRow] = []
    with one_thread():
        worlds = audit_worlds(cfg)
        refs = [(exact_target_law(w, 1), exact_target_law(w, cfg.length)) for w in worlds]
        target, draft, mworld = model_tables(cfg)
        mref = exact_target_law(mworld, cfg.model_tokens)
        base_len = None
        for i, rule in enumerate(tqdm(rules, desc="lossy audit", unit="rule",
                                      disable=not progress)):
            step, seq, toks = [], [], []
            for w, (ref1, ref_l) in zip(worlds, refs, strict=True):
                scheme = Speculative(rule, cfg.num_draft)
                step.append(tv_distance(output_law(w, scheme, 1), ref1))
                seq.append(tv_distance(output_law(w, scheme, cfg.length), ref_l))
                toks.append(float(expected_accepted(w, scheme)[0]) + 1.0)
            mscheme = Speculative(rule, cfg.model_draft)
            law = output_law(mworld, mscheme, cfg.model_tokens)
            counts, acc_len = measure(target, draft, rule, cfg, cfg.seed * 1_000_003 + i)
            base_len = acc_len if rule == "token" else base_len
            rows.append(LossyRow(
                rule=rule, step_tv=sum(step) / len(step), sequence_tv=sum(seq) / len(seq),
                step_tokens=sum(toks) / len(toks), model_tv=tv_distance(law, mref),
                model_step_tokens=float(expected_accepted(mworld, mscheme)[0]) + 1.0,
                measured_tv=tv_distance(counts / counts.sum(), mref),
                bound=drift_bound(law, cfg.rows, cfg.alpha), acceptance_length=acc_len,
                gain=acc_len / base_len if base_len else float("nan")))
    return rows


def format_lossy(rows: list[LossyRow], cfg: LossyConfig) -> str:
    """One line per rule: exact drift on the worlds, exact and measured drift on the tiny model."""
    head = ("rule", "step TV", "seq TV", "tok/step", "model TV", "tok/step", "measured TV",
            "tok/step", "gain", "within bound")
    body = [(r.rule, f"{r.step_tv:.4f}", f"{r.sequence_tv:.4f}", f"{r.step_tokens:.3f}",
             f"{r.model_tv:.4f}", f"{r.model_step_tokens:.3f}",
             f"{r.measured_tv:.4f} +- {r.bound:.4f}",
             f"{r.acceptance_length:.3f}", f"{r.gain:.3f}x",
             "yes" if abs(r.measured_tv - r.model_tv) <= r.bound else "NO") for r in rows]
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [
        f"exactspec audit --lossy: worlds V={cfg.vocab}, K={cfg.num_draft} (exact, mean over "
        f"{len(audit_worlds(cfg))} worlds: TV of one step's token, TV of the first "
        f"L={cfg.length} tokens, tokens per step); tiny Llama V={cfg.model_vocab}, "
        f"K={cfg.model_draft}: exact TV of the first N={cfg.model_tokens} tokens and exact "
        f"tokens per step, then the TV measured over {cfg.rows} generations of "
        f"{cfg.model_new_tokens} tokens (+- its bound at false-alarm rate {cfg.alpha:g}; "
        "the measured TV includes sampling noise of up to that size), their measured tokens "
        "per target step and its gain over 'token'",
        "", fmt.format(*head), fmt.format(*("-" * w for w in widths)),
    ]
    return "\n".join(lines + [fmt.format(*b) for b in body])


def plot_lossy(rows: list[LossyRow], path: str | Path) -> Path:
    """Drift on the tiny model against its exact acceptance length, one line per rule family
    (measured with the error bound, and exact), written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    base = next((r for r in rows if r.rule == "token"), None)
    for family, marker in (("lenient", "o"), ("typical", "s")):
        fam = [r for r in rows if r.rule.startswith(family + ":")]
        if base is not None and family == "lenient":
            fam = [base, *fam]  # lenient:1 is the exact rule
        if not fam:
            continue
        xs = [r.model_step_tokens for r in fam]
        line = ax.errorbar(xs, [r.measured_tv for r in fam], yerr=[r.bound for r in fam],
                           marker=marker, capsize=3, label=f"{family}: measured (tiny model)")
        ax.plot(xs, [r.model_tv for r in fam], marker=marker, linestyle="--", alpha=0.6,
                color=line[0].get_color(), label=f"{family}: exact (tiny model)")
        for r in fam:
            ax.annotate(r.rule.split(":")[-1], (r.model_step_tokens, r.model_tv), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("acceptance length: tokens per target step (exact, first step)")
    ax.set_ylabel("TV from the target, first N tokens (measured +- bound)")
    ax.set_title("lossy verify rules: drift against acceptance length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out = Path(path)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
