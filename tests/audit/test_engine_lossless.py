"""End to end: `exactspec.generate` with a drafter emits exactly the target's distribution.

Statistical test (alpha = 1e-6 per check, fixed seeds). Tiny random Llama models with an
8-token vocabulary are built here from a config (no downloads). The exact law of the first
N generated tokens comes from full forward passes of the target over every continuation of the
prompt, standardized by probs_from_logits with the same SamplingParams; one batched generate
call over many copies of the prompt is tested against it. The same test fails when a wrong
sampler (residual = p) is plugged in as a callable verify; its power at this sample size is
computed from the wrong sampler's exact law on the same models.
"""

from dataclasses import replace

import pytest
import torch
from transformers import LlamaForCausalLM

from exactspec.audit import Speculative, output_law, power, target_law
from exactspec.audit.pitfalls import ResidualFromTarget, WrongResidual, wrong_verify
from exactspec.audit.samplers import sequence_ids
from exactspec.audit.stats import bincount, chi_square
from exactspec.audit.world import World, logits_table, model_world, standardize
from exactspec.drafters import DraftModel, PromptLookup
from exactspec.drafters.eagle import EagleDrafter
from exactspec.drafters.eagle_head import EagleConfig, EagleHead
from exactspec.drafters.gguf_draft import llama_cpp_available, llama_cpp_why
from exactspec.drafters.quantized import QuantizedDraft
from exactspec.engine import generate
from exactspec.models.adapter import TargetAdapter
from exactspec.models.lean import lean_forward_for
from exactspec.sampling import SamplingParams
from tests.engine.tiny import tiny_llama as tiny

V, N, K = 8, 3, 2  # vocabulary, generated tokens compared (512 outcomes), drafts per step
ROWS = 8000  # copies of the prompt in one generate call
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so prompt lookup finds something to copy
FILTERED = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
NEEDS_LLAMA_CPP = pytest.mark.skipif(not llama_cpp_available(),
                                     reason=llama_cpp_why())
PENALISED = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                           min_p=0.05)


def tiny_llama(seed: int) -> LlamaForCausalLM:
    """8-token vocabulary, a spread of probabilities (neither flat nor one-hot), no EOS: every
    row makes N tokens."""
    return tiny(seed, vocab=V, max_pos=64, head_scale=5.0)


@pytest.fixture(scope="module")
def models():
    target, draft = tiny_llama(0), tiny_llama(1)
    depth = N + K  # contexts up to N - 1 + K generated tokens

    def table(model):
        return logits_table(lambda ids: model(ids).logits, PROMPT, V, depth)

    return target, draft, table(target), table(draft)


def _world(models, params):
    _, _, target_logits, draft_logits = models
    return model_world(target_logits, draft_logits, V, N + K, params, PROMPT)


def _counts(models, drafter, params, verify, seed):
    """Counts [V**N] of the first N tokens of ROWS generations, and the accepted drafts."""
    target = models[0]
    gens = generate(target, [PROMPT] * ROWS, drafter=drafter, params=replace(params, seed=seed),
                    max_new_tokens=N + K,  # so no step near the first N tokens drafts fewer
                    num_draft_tokens=K, verify=verify, batch_size=ROWS)
    seqs = torch.tensor([g.token_ids[:N] for g in gens])  # [ROWS, N]
    return bincount(sequence_ids(seqs, V), V**N), sum(g.stats.accepted for g in gens)


def eagle(target, vocab_ids: torch.Tensor | None = None) -> EagleDrafter:
    """An EAGLE-style head with random (sharpened) weights over the target's features."""
    torch.manual_seed(2)
    head = EagleHead(EagleConfig.for_target(target.config, (1, -1)))
    with torch.no_grad():
        for w in head.parameters():
            w.mul_(3.0)
    if vocab_ids is not None:  # a reduced draft vocabulary: q = 0 outside it
        head.set_vocab(vocab_ids)
    return EagleDrafter(head, target)


@pytest.mark.parametrize(("drafter", "params", "method"), [
    pytest.param("draft model", FILTERED, "token", id="draft-filtered-token"),
    pytest.param("draft model", FILTERED, "block", id="draft-filtered-block"),
    pytest.param("draft model", PENALISED, "block", id="draft-penalised-block"),
    pytest.param("eagle", FILTERED, "token", id="eagle-filtered-token"),
    pytest.param("eagle", PENALISED, "block", id="eagle-penalised-block"),
    pytest.param("eagle-5", FILTERED, "block", id="eagle-reduced-vocab-block"),
    pytest.param("prompt lookup", FILTERED, "token", id="lookup-filtered-token"),
    pytest.param("prompt lookup", PENALISED, "block", id="lookup-penalised-block"),
    pytest.param("int8", FILTERED, "token", id="quantized-int8-filtered-token"),
    pytest.param("int8", PENALISED, "block", id="quantized-int8-penalised-block"),
    pytest.param("int4", FILTERED, "block", id="quantized-int4-filtered-block"),
    pytest.param("int4", PENALISED, "token", id="quantized-int4-penalised-token"),
    pytest.param("int8-layer1", FILTERED, "token", id="quantized-int8-one-layer-token"),
    pytest.param("q8_0", FILTERED, "token", id="quantized-llama.cpp-q8-filtered-token",
                 marks=NEEDS_LLAMA_CPP),
    pytest.param("q4_0", PENALISED, "block", id="quantized-llama.cpp-q4-penalised-block",
                 marks=NEEDS_LLAMA_CPP),
])
def test_generate_matches_the_target(models, drafter, params, method):
    make = {"draft model": lambda: DraftModel(models[1]), "prompt lookup": PromptLookup,
            "eagle": lambda: eagle(models[0]),
            "eagle-5": lambda: eagle(models[0], torch.tensor([0, 1, 2, 3, 5])),
            "int8": lambda: QuantizedDraft(8, backend="torch"),
            "int4": lambda: QuantizedDraft(4, backend="torch"),
            "q8_0": lambda: QuantizedDraft(8, backend="llama.cpp"),
            "q4_0": lambda: QuantizedDraft(4, backend="llama.cpp"),
            "int8-layer1": lambda: QuantizedDraft(8, layers=[1], backend="torch")}[drafter]
    counts, accepted = _counts(models, make(), params, method, seed=5)
    assert accepted > ROWS // 10  # drafts were really used, not only bonus tokens
    result = chi_square(counts, target_law(_world(models, params), N))
    assert result.dof > 30 and not result.rejected, result


def test_a_wrong_verify_in_the_engine_is_caught(models):
    world = _world(models, FILTERED)
    target = target_law(world, N)
    wrong = output_law(world, WrongResidual("token", K, ResidualFromTarget, "from p"), N)
    assert power(target, wrong, ROWS) > 1 - 1e-6  # ROWS suffices to see it
    counts, _ = _counts(models, DraftModel(models[1]), FILTERED,
                        wrong_verify(ResidualFromTarget), seed=6)
    assert chi_square(counts, target).rejected
    assert not chi_square(counts, wrong).rejected  # the engine did run the modelled sampler


TEMPERATURE = SamplingParams(temperature=0.5)  # the target's; the wrong drafter draws at 1.0


class HotDrafter:
    """Wrong drafter: samples at temperature 1.0, but reports q at the target's temperature.

    q at T is recovered from the T = 1 draw as q1^(1/T) normalised (no filters are active), so
    the reported q is the draft model's standardized distribution, but not the one it drew from.
    """

    hidden_layers = None  # needs no target features

    def __init__(self, inner: DraftModel) -> None:
        self.inner = inner

    def begin(self, context, target) -> None:
        self.inner.begin(context, target)

    def select(self, rows) -> None:
        self.inner.select(rows)

    def propose(self, context, num_tokens):
        hot = replace(context, params=replace(context.params, temperature=1.0))
        drafts, q1 = self.inner.propose(hot, num_tokens)  # [B, K], [B, K, V] at T = 1
        claimed = q1.double() ** (1.0 / context.params.temperature)
        return drafts, (claimed / claimed.sum(-1, keepdim=True)).to(q1.dtype)


def _hot_drafter_is_caught(models, draft_logits, drafter, seed: int) -> None:
    """HotDrafter(drafter) through generate is rejected against the target's law, and its
    draws follow its own exact wrong law (computed from `draft_logits`, the inner draft's)."""
    target_logits = models[2]
    depth = N + K
    good = model_world(target_logits, draft_logits, V, depth, TEMPERATURE, PROMPT)
    drawn = standardize(draft_logits, V, depth, SamplingParams(), tuple(PROMPT))
    bad = World("hot drafter", V, depth, good.target, drawn, good.claimed)
    target = target_law(good, N)
    wrong = output_law(bad, Speculative("token", K), N)
    assert power(target, wrong, ROWS) > 1 - 1e-6
    counts, accepted = _counts(models, HotDrafter(drafter), TEMPERATURE, "token", seed=seed)
    assert accepted > ROWS // 10
    assert chi_square(counts, target).rejected
    assert not chi_square(counts, wrong).rejected


def test_a_wrong_drafter_in_the_engine_is_caught(models):
    """The temperature-mismatch pitfall through a real drafter: caught end to end."""
    _hot_drafter_is_caught(models, models[3], DraftModel(models[1]), seed=7)

def lean_logits(model, fmt: str, layers=None, rows=None):
    """forward(ids [N, T]) -> logits [N, T, V] of `model`'s lean forward in weight format `fmt`
    (over `layers`, with its head over `rows`; None: all)."""
    lean = lean_forward_for(model, fmt, layers=layers, head_rows=rows)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        ad = TargetAdapter(model, forward=lean)
        ad.prefill([[] for _ in range(ids.shape[0])])
        return ad.extend(ids)

    return forward


@pytest.mark.parametrize("bits", [8, 4])
def test_a_wrong_quantized_drafter_in_the_engine_is_caught(models, bits):
    """The quantized self-draft reporting q at the target's temperature while drawing at 1.0:
    its exact wrong law (from the quantized forward's own logits) is rejected end to end."""
    drafter = QuantizedDraft(bits, backend="torch")
    q_logits = logits_table(lean_logits(models[0], drafter.fmt), PROMPT, V, N + K)
    _hot_drafter_is_caught(models, q_logits, drafter, seed=8)
