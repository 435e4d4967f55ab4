"""The seeds' pitfalls, written as deliberately wrong samplers the audit must catch.

Each pitfall changes exactly one thing of the real sampler (a residual, the q handed to verify,
or where the uniforms come from) and is otherwise the library's own code. None of them is
lossless; the audit shows the exact TV distance is positive and the chi-square test rejects.

1. resample from p after a rejection (seed 000, section 8 Q1): P(x) = min(p, q) + Z p(x).
2. |p - q| as the residual (seed 000, Q2): adds mass where q > p.
3. temperature mismatch (seed 000, Q4 and section 10): the drafter samples at its own temperature
   T_q = 1.0 while verify is told q standardized with the target's T_p = 0.7, so the ratio
   p / q is taken against a distribution the draft never came from.
4. unfiltered q (the Hugging Face bug, docs/architecture.md): drafts come from top-k filtered probabilities
   but verify is told the softmax of the raw draft logits.
5. shared uniforms: draft x_i = inverse-CDF(q_i, u_i) and accept iff u_i < p_i(x_i) / q_i(x_i)
   with the same u_i, so acceptance is correlated with which token was drafted.

Apart from the list (too small for a statistical test to see, so only exact enumeration
catches it; `half_precision_world`): 6. half precision (seed 000, section 10): the draft
samples from q standardized from its logits rounded to bfloat16, while verify is told q
standardized in float32. exactspec standardizes every p and q in float32 from the logits the
tokens were drawn with, whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from exactspec.audit.exact import StepLaw, draft_blocks
from exactspec.audit.samplers import Drafted, Speculative, draw_from_law, emitted_tokens
from exactspec.audit.world import World, random_logits, random_world, standardize
from exactspec.sampling import (
    DOMAIN_RESAMPLE,
    AcceptanceLaw,
    SamplingParams,
    Verdict,
    acceptance_law,
    sample_from_weights,
    uniforms,
)


class ResidualFromTarget(AcceptanceLaw):
    """Wrong: after a rejection the extra token is drawn from p itself."""

    def residual(self, n: torch.Tensor) -> torch.Tensor:  # [B] -> [B, V]
        return self.target_probs[torch.arange(n.shape[0]), n].to(torch.float64)


class AbsoluteResidual(AcceptanceLaw):
    """Wrong: after a rejection the extra token is drawn from norm(|p - q|)."""

    def residual(self, n: torch.Tensor) -> torch.Tensor:  # [B] -> [B, V]
        assert self.draft_probs is not None, "the |p - q| pitfall needs a sampled draft"
        b = torch.arange(n.shape[0])
        k = self.draft_tokens.shape[1]
        p_n = self.target_probs[b, n].to(torch.float64)
        q_n = self.draft_probs[b, n.clamp(max=k - 1)].to(torch.float64)
        rejected = (n < self.lengths)[:, None]
        return torch.where(rejected, (p_n - q_n).abs(), super().residual(n))


def rewrap(law: AcceptanceLaw, law_class: type[AcceptanceLaw]) -> AcceptanceLaw:
    """The same law (accept_probs, tables) as an instance of `law_class` (another residual)."""
    return law_class(**{f.name: getattr(law, f.name) for f in fields(law)})


@dataclass
class WrongResidual(Speculative):
    """The real token/block acceptance law, with its residual replaced by `law_class`'s."""

    law_class: type[AcceptanceLaw]  # an AcceptanceLaw subclass overriding `residual`
    label: str  # pitfall name for reports

    @property
    def name(self) -> str:
        return self.label

    def law(self, target: torch.Tensor, tokens: torch.Tensor,
            claimed: torch.Tensor | None) -> AcceptanceLaw:
        return rewrap(super().law(target, tokens, claimed), self.law_class)

    def verdict(self, drafted: Drafted, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return draw_from_law(self.law(drafted.target, drafted.tokens, drafted.claimed), generator)


def wrong_verify(law_class: type[AcceptanceLaw], method: str = "token") -> Callable[..., Verdict]:
    """A function with `exactspec.verify`'s signature whose residual is `law_class`'s.

    Plug it into the engine (`generate(..., verify=wrong_verify(ResidualFromTarget))`) to show
    that an end-to-end test catches a wrong sampler.
    """
    def wrong(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
              draft_probs: torch.Tensor | None = None, *, generator=None, **_) -> Verdict:
        real = acceptance_law(target_probs, draft_tokens, draft_probs, method=method)
        tokens, n = draw_from_law(rewrap(real, law_class), generator)
        return Verdict(tokens=tokens, num_accepted=n)

    wrong.__name__ = f"wrong_verify_{law_class.__name__}"
    return wrong


def shared_uniform_accept(target: torch.Tensor, draft: torch.Tensor,
                          tokens: torch.Tensor) -> torch.Tensor:  # [..., K] float64
    """P(u < p(x) / q(x) | x) when x = inverse-CDF(q, u): u is uniform on x's CDF interval.

    target [..., K, V] (p at the draft positions), draft [..., K, V], tokens [..., K].
    """
    p_x = target.gather(-1, tokens[..., None])[..., 0]
    q_x = draft.gather(-1, tokens[..., None])[..., 0]
    hi = draft.cumsum(-1).gather(-1, tokens[..., None])[..., 0]  # CDF interval [hi - q_x, hi)
    ratio = p_x / q_x.clamp(min=1e-300)
    inside = (torch.minimum(hi, ratio) - (hi - q_x)).clamp(min=0.0)
    return torch.where(q_x > 0, inside / q_x.clamp(min=1e-300), torch.zeros_like(q_x))


@dataclass
class SharedUniforms(Speculative):
    """Wrong: the uniform that drew draft token i also decides whether it is accepted.

    Draft i is accepted iff u_i < p_i(x_i) / q_i(x_i), in order, up to the first rejection; the
    extra token then comes from the real residual. Token-level only.
    """

    label: str = "shared uniforms"  # pitfall name for reports

    @property
    def name(self) -> str:
        return self.label

    def step_law(self, world: World, length: int) -> StepLaw:
        assert not self.ragged and self.method == "token", "shared uniforms: full token rows only"
        real = super().step_law(world, length)  # for the residuals of the extra token
        k = self.num_draft
        blocks = draft_blocks(world, length, k)
        tokens = blocks.tokens[None].expand(blocks.prob.shape[0], -1, -1)  # [C, N, K]
        a = shared_uniform_accept(blocks.target[..., :k, :], blocks.draft, tokens)  # [C, N, K]
        ones = torch.ones_like(a[..., :1])
        reach = torch.cat([ones, a.cumprod(-1)], -1)  # P(the first i drafts pass) [C, N, K+1]
        stop = torch.cat([1.0 - a, ones], -1)  # P(draft i+1 fails | reached it)
        return StepLaw(real.tokens, blocks.prob[..., None] * reach * stop, real.extra)

    def verdict(self, drafted: Drafted, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
        k = drafted.tokens.shape[1]
        p_x = drafted.target[:, :k].gather(-1, drafted.tokens[..., None])[..., 0]  # [B, K]
        q_x = drafted.draft.gather(-1, drafted.tokens[..., None])[..., 0]  # [B, K]
        passed = drafted.uniforms * q_x < p_x  # u < p / q, with the drafting uniforms
        n = passed.long().cumprod(1).sum(1)  # [B]
        law = acceptance_law(drafted.target, drafted.tokens, drafted.claimed, method="token")
        v = uniforms(generator, len(n), 1, DOMAIN_RESAMPLE)[:, 0]
        return emitted_tokens(drafted.tokens, n, sample_from_weights(law.residual(n), v)), n


def temperature_mismatch_world(vocab: int, depth: int, seed: int, *,
                               target_temperature: float = 0.7,
                               draft_temperature: float = 1.0) -> World:
    """Drafts drawn at T_q, but verify told q at the target's T_p (p standardized at T_p)."""
    target_logits, draft_logits = random_logits(vocab, depth, seed)
    params = SamplingParams(temperature=target_temperature)
    drawn = standardize(draft_logits, vocab, depth, replace(params, temperature=draft_temperature))
    return World("temperature mismatch", vocab, depth,
                 standardize(target_logits, vocab, depth, params), drawn,
                 standardize(draft_logits, vocab, depth, params))


def unfiltered_q_world(vocab: int, depth: int, seed: int, *,
                       params: SamplingParams | None = None) -> World:
    """Drafts drawn from top-k filtered q, but verify told the softmax of the raw draft logits."""
    params = params or SamplingParams(top_k=2)
    target_logits, draft_logits = random_logits(vocab, depth, seed)
    return World("unfiltered q", vocab, depth,
                 standardize(target_logits, vocab, depth, params),
                 standardize(draft_logits, vocab, depth, params),
                 standardize(draft_logits, vocab, depth, SamplingParams()))


def half_precision_world(vocab: int, depth: int, seed: int, *,
                         dtype: torch.dtype = torch.bfloat16,
                         params: SamplingParams | None = None) -> World:
    """Drafts drawn from q standardized from `dtype`-rounded draft logits, verify told the
    float32 q of the same logits (p standardized in float32)."""
    params = params or SamplingParams(temperature=0.7)
    target_logits, draft_logits = random_logits(vocab, depth, seed)
    drawn = standardize(draft_logits.to(dtype).to(torch.float64), vocab, depth, params)
    return World(f"{dtype} q", vocab, depth, standardize(target_logits, vocab, depth, params),
                 drawn, standardize(draft_logits, vocab, depth, params))


@dataclass
class Pitfall:
    """A deliberately wrong sampler on the world where it is run."""

    name: str  # short label
    why: str  # one line: what is wrong
    world: World  # the world it runs on
    scheme: Speculative  # the sampler


def pitfalls(vocab: int, depth: int, num_draft: int, seed: int = 0) -> list[Pitfall]:
    """Every pitfall of the seeds, each on a world where it shows."""
    sampled = random_world(vocab, depth, seed + 101)
    return [
        Pitfall("resample from p", "extra token from p after a rejection, not norm(max(p-q,0))",
                sampled, WrongResidual("token", num_draft, ResidualFromTarget, "resample from p")),
        Pitfall("|p - q| residual", "extra token from norm(|p - q|): adds mass where q > p",
                sampled, WrongResidual("token", num_draft, AbsoluteResidual, "|p - q| residual")),
        Pitfall("temperature mismatch", "drafts drawn at T=1.0, verify told q at the target's T=0.7",
                temperature_mismatch_world(vocab, depth, seed + 103),
                Speculative("token", num_draft)),
        Pitfall("unfiltered q", "drafts drawn from top-k=2 q, verify told softmax of raw logits",
                unfiltered_q_world(vocab, depth, seed + 104), Speculative("token", num_draft)),
        Pitfall("shared uniforms", "one uniform draws draft x and decides u < p(x)/q(x)",
                sampled, SharedUniforms("token", num_draft)),
    ]
