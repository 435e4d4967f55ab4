"""The native draft step (`exactspec::draft_step`) against the Python path, bit for bit.

The Python path: the final RMSNorm and the head product on our kernels (as the lean forward's
last lines), `probs_from_logits`, then the inverse-CDF draw of `sample_from_weights` (greedy:
the argmax). The native step must give the same q (torch.equal) and the same tokens, for every
law it takes and every head format; a variant that skips the standardization is shown to fail
the same comparison (so it can fail).
"""

from __future__ import annotations

import pytest
import torch

from exactspec import kernels
from exactspec.kernels import draft_step
from exactspec.sampling import SamplingParams, probs_from_logits, sample_from_weights

B, H, V = 3, 64, 1000

LAWS = {
    "greedy": SamplingParams(temperature=0.0),
    "t1": SamplingParams(temperature=1.0),
    "t0.7": SamplingParams(temperature=0.7),
    "top-k": SamplingParams(temperature=0.9, top_k=20),
    "top-p": SamplingParams(temperature=1.3, top_p=0.8),  # the cut inside the 256 largest
    "top-p wide": SamplingParams(temperature=3.0, top_p=0.999),  # past them: the full sort
    "min-p": SamplingParams(temperature=0.8, min_p=0.05),
    "all": SamplingParams(temperature=0.6, top_k=50, top_p=0.9, min_p=0.02),
}


def make(kind: str, seed: int = 0):
    """x [B, H], the final norm, the head's kernel arguments (weights, scales) of `kind`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, generator=g)
    norm = (1.0 + 0.1 * torch.randn(H, generator=g), 1e-5)
    w = torch.randn(V, H, generator=g) * 0.5  # logits with a spread: std ~4
    w[1] = w[0]  # a tie at the top of some rows is broken to the lower id
    if kind == "float32":
        return x, norm, ([w[:300].contiguous(), w[300:].contiguous()], None)  # two parts
    if kind == "bfloat16":
        return x, norm, ([w.bfloat16()], None)
    scales = w.abs().amax(1) / 127  # [V]
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return x, norm, ([kernels.pack_int8(q)], scales.float())


def python_path(x, norm, head, params, u):
    """The lean forward's last lines, probs_from_logits and the draw, as the draft loop ran
    them before the native step."""
    weights, scales = head
    h = kernels.rms_norm(x, norm[0], norm[1])
    if weights[0].dim() == 4:
        logits = kernels.linear_w8a16(h, weights[0], scales)
    else:
        logits = kernels.linear(h, weights, scales)
    q = probs_from_logits(logits, params)
    tokens = q.argmax(-1) if params.is_greedy else sample_from_weights(q, u)
    return tokens, q


def uniforms(seed: int = 1) -> torch.Tensor:  # [B] float64
    return torch.rand(B, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("law", list(LAWS))
def test_the_native_step_is_the_python_path(isa, kind, law):
    x, norm, head = make(kind)
    params = LAWS[law]
    for seed in range(4):  # several uniforms: draws across the vocabulary
        u = uniforms(seed)
        want_tokens, want_q = python_path(x, norm, head, params, u)
        tokens, q = draft_step.draft_step(x, norm, head, params, u)
        assert torch.equal(q, want_q), law
        assert torch.equal(tokens, want_tokens), (law, tokens, want_tokens)
        assert bool((q.gather(1, tokens[:, None]) > 0).all())  # never a token of q = 0


def test_greedy_breaks_ties_to_the_lower_id():
    x, norm, head = make("float32")
    weights, _ = head
    for w in weights:
        w.zero_()  # every logit 0: a tie over the whole vocabulary
    tokens, q = draft_step.draft_step(x, norm, head, LAWS["greedy"], None)
    assert tokens.tolist() == [0] * B
    assert torch.equal(q, probs_from_logits(torch.zeros(B, V), LAWS["greedy"]))


def skipped(x, norm, head, params, u):
    """Wrong: the step without the standardization (softmax of the raw logits)."""
    return draft_step.draft_step(x, norm, head, SamplingParams(temperature=1.0), u)


@pytest.mark.parametrize("law", ["t0.7", "top-k", "top-p", "min-p", "all"])
def test_a_step_that_skips_the_standardization_fails_the_comparison(law):
    x, norm, head = make("float32")
    u = uniforms()
    _, want_q = python_path(x, norm, head, LAWS[law], u)
    _, q = skipped(x, norm, head, LAWS[law], u)
    assert not torch.equal(q, want_q)


def test_non_finite_logits_are_refused_as_the_python_path_refuses_them():
    x, norm, head = make("float32")
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        draft_step.draft_step(x, norm, head, LAWS["t1"], uniforms())
    with pytest.raises(ValueError, match="NaN"):
        python_path(x, norm, head, LAWS["t1"], uniforms())


def test_laws_reading_more_than_the_logits_are_refused():
    x, norm, head = make("float32")
    for params in (SamplingParams(repetition_penalty=1.2), SamplingParams(logit_bias={3: 1.0}),
                   SamplingParams(presence_penalty=0.5)):
        assert not draft_step.supports(params)
        with pytest.raises(ValueError, match="Python path"):
            draft_step.draft_step(x, norm, head, params, uniforms())
    assert all(draft_step.supports(p) for p in LAWS.values())


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_the_operator_passes_torch_library_opcheck(kind):
    """Schema, fake implementation and dispatch agree with the CPU kernel."""
    assert draft_step.available()
    x, norm, head = make(kind)
    weights, scales = head
    for law in ("greedy", "all"):
        p = LAWS[law]
        args = (x, norm[0], norm[1], weights, scales, p.temperature, p.top_k, p.top_p, p.min_p,
                None if p.is_greedy else uniforms())
        result = torch.library.opcheck(torch.ops.exactspec.draft_step.default, args)
        assert set(result.values()) == {"SUCCESS"}, (law, result)
