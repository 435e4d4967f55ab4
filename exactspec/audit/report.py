"""The audit: every verify method on every kind of world, and every pitfall, exactly and by sampling.

Cases: token / block / greedy on random p/q, zeros, point-mass drafts, disjoint supports,
sampling parameters folded into both p and q, ragged draft rows and float32 probabilities; then
every pitfall of `pitfalls.py`.
A lossless case passes when its exact TV distance from the target is ~0 (rounding only) and the
chi-square test at false-alarm rate alpha does not reject. A pitfall is caught when its exact
TV is clearly positive and the chi-square test rejects. The greedy method's target is argmax
decoding of p (a one-hot law). Worlds are fixed; `seed` only drives the statistical samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from exactspec.audit.exact import expected_accepted, output_law, tv_distance
from exactspec.audit.pitfalls import pitfalls
from exactspec.audit.samplers import Speculative, sequence_ids, simulate
from exactspec.audit.stats import (
    ALPHA,
    ChiSquare,
    bincount,
    chi_square,
    power,
    samples_for_power,
)
from exactspec.audit.world import World, folded_world, random_world, target_law
from exactspec.sampling import SamplingParams

EXACT_TV = 1e-9  # a lossless case's exact TV must be below this (float64 rounding only)
FLOAT32_TV = 1e-6  # the same for float32 probabilities (rounding p to float32 moves ~1e-8)
PITFALL_TV = 1e-6  # a pitfall's exact TV must be above this to count as caught


@dataclass(frozen=True)
class AuditConfig:
    """Sizes of the audit; the defaults run in well under a minute on 2 cores."""

    vocab: int = 4  # V
    num_draft: int = 3  # K
    length: int = 5  # L generated tokens compared with the target (> K + 1: several steps)
    samples: int = 200_000  # sequences drawn per sampled case
    greedy_samples: int = 10_000  # sequences per greedy case (its output is deterministic)
    alpha: float = ALPHA  # false-alarm rate of each chi-square test
    seed: int = 0  # seed of the statistical samples

    @property
    def depth(self) -> int:
        """World tables needed: contexts up to L - 1 + K tokens."""
        return self.length + self.num_draft


@dataclass
class AuditCase:
    """One (world, sampler) pair and what it must show."""

    case: str  # world or pitfall name
    world: World  # where it runs
    scheme: Speculative  # the sampler
    lossless: bool  # True: must match the target; False: a pitfall, must be caught
    greedy: bool = False  # the target is argmax decoding
    tolerance: float = EXACT_TV  # largest exact TV a lossless case may show (rounding)


@dataclass
class AuditRow:
    """The outcome of one case."""

    case: AuditCase  # what was run
    tv: float  # exact total-variation distance from the target over the first L tokens
    accepted: float  # exact expected number of accepted drafts in the first step
    test: ChiSquare  # chi-square test of the sampled sequences against the target
    power: float | None  # pitfalls: probability the test rejects at this sample size
    needed: int | None  # pitfalls: samples giving the test 99.9% power (to within 5%)

    @property
    def ok(self) -> bool:
        if self.case.lossless:
            return self.tv < self.case.tolerance and not self.test.rejected
        return self.tv > PITFALL_TV and self.test.rejected

    @property
    def verdict(self) -> str:
        if self.case.lossless:
            return "lossless" if self.ok else "FAIL"
        return "caught" if self.ok else "MISSED"


def folded_params() -> dict[str, SamplingParams]:
    """The standardized-sampling settings folded into both p and q."""
    return {
        "temperature 0.7": SamplingParams(temperature=0.7),
        "top-k 2": SamplingParams(top_k=2),
        "top-p 0.8": SamplingParams(top_p=0.8),
        "min-p 0.2": SamplingParams(min_p=0.2),
        "penalties + bias": SamplingParams(repetition_penalty=1.3, presence_penalty=0.5,
                                           frequency_penalty=0.3, logit_bias={0: 0.5}),
    }


def worlds(cfg: AuditConfig) -> list[World]:
    """The lossless cases' worlds: random, zeros, point mass, disjoint, folded parameters."""
    v, d = cfg.vocab, cfg.depth
    out = [random_world(v, d, 1), random_world(v, d, 2, zeros=0.4, name="zeros in p and q"),
           random_world(v, d, 3, draft="point_mass"), random_world(v, d, 4, draft="disjoint")]
    for i, (name, params) in enumerate(folded_params().items()):
        out.append(folded_world(v, d, params, 10 + i, name=name))
    return out


def audit_cases(cfg: AuditConfig) -> list[AuditCase]:
    """Every method on every world, then every pitfall."""
    methods = ("token", "block", "greedy")
    cases = [AuditCase(w.name, w, Speculative(m, cfg.num_draft), True, greedy=m == "greedy")
             for w in worlds(cfg) for m in methods]
    ragged = random_world(cfg.vocab, cfg.depth, 6, zeros=0.2)  # rows padded with -1
    cases += [AuditCase("ragged drafts (0..K)", ragged,
                        Speculative(m, cfg.num_draft, ragged=True), True, greedy=m == "greedy")
              for m in methods]
    # float32 p and q, as the engine's models give them: lossless up to float32 rounding of p
    single = random_world(cfg.vocab, cfg.depth, 7, zeros=0.2)
    cases += [AuditCase("float32 p and q", single,
                        Speculative(m, cfg.num_draft, dtype=torch.float32), True,
                        greedy=m == "greedy", tolerance=FLOAT32_TV)
              for m in methods]
    cases += [AuditCase(p.name, p.world, p.scheme, False)
              for p in pitfalls(cfg.vocab, cfg.depth, cfg.num_draft)]
    return cases


def run_case(case: AuditCase, cfg: AuditConfig, generator: torch.Generator) -> AuditRow:
    """Exact TV and one batched statistical test for one case."""
    v, length = case.world.vocab, cfg.length
    reference = target_law(case.world, length, greedy=case.greedy)  # [V**L]
    law = output_law(case.world, case.scheme, length)  # [V**L]
    rows = cfg.greedy_samples if case.greedy else cfg.samples
    seqs = simulate(case.world, case.scheme, length, rows, generator)  # [rows, L]
    test = chi_square(bincount(sequence_ids(seqs, v), v**length), reference, alpha=cfg.alpha)
    tv = tv_distance(law, reference)
    accepted = float(expected_accepted(case.world, case.scheme)[0])
    if case.lossless or tv <= PITFALL_TV:
        return AuditRow(case, tv, accepted, test, None, None)
    return AuditRow(case, tv, accepted, test, power(reference, law, rows, alpha=cfg.alpha),
                    samples_for_power(reference, law, alpha=cfg.alpha))


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread, then restore the previous setting.

    The audit's tensors are small ([B, K+1, V] with V = 4): thread synchronisation costs more
    than it saves, and on a busy 2-core machine it made the audit ten times slower.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def run_audit(cfg: AuditConfig | None = None, *, progress: bool = True) -> list[AuditRow]:
    """Run every case; the progress bar goes to stderr."""
    cfg = cfg or AuditConfig()
    rows = []
    with one_thread():
        cases = audit_cases(cfg)
        for i, case in enumerate(tqdm(cases, desc="audit", unit="case", disable=not progress)):
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)
            rows.append(run_case(case, cfg, gen))
    return rows


def format_table(rows: list[AuditRow], cfg: AuditConfig) -> str:
    """One line per case: case, method, exact TV, chi-square statistic, threshold, verdict."""
    head = ("case", "method", "E[acc]", "exact TV", "chi2", "dof", "threshold", "power",
            "n(99.9%)", "verdict")
    body = []
    for r in rows:
        t = r.test
        body.append((r.case.case, r.case.scheme.method, f"{r.accepted:.3f}", f"{r.tv:.2e}",
                     "inf" if t.statistic == float("inf") else f"{t.statistic:.1f}",
                     str(t.dof), f"{t.threshold:.1f}" if t.dof else "-",
                     "-" if r.power is None else f"{r.power:.6f}",
                     "-" if r.needed is None else str(r.needed), r.verdict))
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [
        f"exactspec audit: V={cfg.vocab} tokens, K={cfg.num_draft} drafts, first L={cfg.length} "
        f"generated tokens; {cfg.samples} sequences per case ({cfg.greedy_samples} for greedy), "
        f"chi-square false-alarm rate {cfg.alpha:g}, seed {cfg.seed}",
        "lossless: exact TV < 1e-9 (1e-6 for float32) and the test accepts; caught: exact TV > 1e-6 and the test "
        "rejects (pitfalls run the token method with one deliberate bug); power: chance the "
        "test catches the pitfall at this sample size, n(99.9%): samples needed for 99.9%; "
        "E[acc]: exact expected accepted drafts per step (block >= token)",
        "",
        fmt.format(*head),
        fmt.format(*("-" * w for w in widths)),
    ]
    lines += [fmt.format(*row) for row in body]
    bad = [r for r in rows if not r.ok]
    lines.append("")
    lines.append(f"{len(rows) - len(bad)}/{len(rows)} cases as expected"
                 + ("" if not bad else "; FAILED: " + ", ".join(
                     f"{r.case.case}/{r.case.scheme.method}" for r in bad)))
    return "\n".join(lines)
