"""drafters/frequent_tokens.py: the kept tokens of a reduced draft head, from the mass the target
puts on each token along text it generates, cached on disk and in memory.

Exact: the mass of one generated position is the target's own p there (twice for two samples),
bit for bit on the kernels; the kept set is the top of the mass with the special tokens forced
in and ties to the lower id; a second process reads the cached file without generating; other
weights or another survey generate again.
"""

from __future__ import annotations

import pytest
import torch

from exactspec import kernels
from exactspec.drafters import frequent_tokens as ft
from exactspec.models.adapter import TargetAdapter
from exactspec.sampling import SamplingParams, probs_from_logits
from tests.engine.tiny import VOCAB, char_tokenizer, tiny_llama

SURVEY = ft.Survey(prompts=((5, 6, 7), (9,), (1, 2, 3, 4)), samples=2, max_new_tokens=6, rows=4)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A private cache directory, and nothing held in memory from another test."""
    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(ft, "_MASS", type(ft._MASS)())
    return tmp_path


@pytest.mark.skipif(not kernels.enabled(), reason="bit-equality needs the kernels")
def test_one_position_mass_is_the_targets_p():
    target = tiny_llama(0)
    survey = ft.Survey(prompts=((5, 6, 7), (9, 3)), samples=2, max_new_tokens=1)
    mass = ft.token_mass(target, None, survey=survey, progress=False)
    want = torch.zeros(VOCAB, dtype=torch.float64)
    for prompt in ([5, 6, 7], [9, 3]):
        ad = TargetAdapter(target)
        ad.prefill([prompt[:-1]])
        p = probs_from_logits(ad.extend(torch.tensor([[prompt[-1]]]))[:, -1], SamplingParams())
        want += 2 * p[0].double()
    assert torch.equal(mass, want)


def test_the_mass_counts_every_generated_position():
    """Each position's p sums to 1 (float32 rounding: V * 2^-24 per position at most)."""
    target = tiny_llama(0, eos=0)
    mass = ft.token_mass(target, None, survey=SURVEY, progress=False)
    files = list((ft.cache_root() / "frequent-tokens").glob("*.safetensors"))
    assert len(files) == 1
    from safetensors import safe_open

    with safe_open(str(files[0]), framework="pt") as f:
        generated = int(f.metadata()["tokens"])
    assert 0 < generated <= 6 * 6
    assert abs(float(mass.sum()) - generated) <= generated * VOCAB * 2.0**-24


def test_the_kept_set_is_the_top_of_the_mass_with_the_special_tokens(monkeypatch):
    target = tiny_llama(0, eos=0)
    mass = torch.zeros(VOCAB, dtype=torch.float64)
    mass[[7, 3, 12, 40]] = torch.tensor([5.0, 9.0, 1.0, 5.0], dtype=torch.float64)
    monkeypatch.setattr(ft, "token_mass", lambda *a, **k: mass)
    tok = char_tokenizer()  # <eos> = 0
    assert ft.frequent_tokens(target, tok, 4).tolist() == [0, 3, 7, 40]  # 7 and 40 tie: both
    assert ft.frequent_tokens(target, tok, 3).tolist() == [0, 3, 7]  # the tie to the lower id
    assert ft.frequent_tokens(target, tok, 7).tolist() == [0, 1, 2, 3, 7, 12, 40]  # then ids
    assert mass[0] == 0  # the caller's mass is not changed


def test_the_cache_is_read_back_and_keyed_by_weights_and_survey(monkeypatch):
    target = tiny_llama(0)
    first = ft.token_mass(target, None, survey=SURVEY, progress=False)
    assert ft.token_mass(target, None, survey=SURVEY) is first  # memory
    monkeypatch.setattr(ft, "_MASS", type(ft._MASS)())  # a new process: the disk only

    def refuse(*args, **kwargs):
        raise AssertionError("generated again")

    survey_fn = ft._survey
    monkeypatch.setattr(ft, "_survey", refuse)
    assert torch.equal(ft.token_mass(target, None, survey=SURVEY), first)
    monkeypatch.setattr(ft, "_survey", survey_fn)
    other = ft.token_mass(target, None, survey=ft.Survey(**{**SURVEY.__dict__, "seed": 1}),
                         progress=False)
    assert not torch.equal(other, first)
    with torch.no_grad():
        target.lm_head.weight.mul_(-1.0)
    assert ft._digest(target, None, SURVEY) != ft._digest(tiny_llama(0), None, SURVEY)


def test_text_prompts_need_the_tokenizer_and_use_its_chat_template():
    target = tiny_llama(0, eos=0)
    with pytest.raises(ValueError, match="needs its tokenizer; pass the kept token ids"):
        ft.frequent_tokens(target, None, 8, progress=False)
    survey = ft.Survey(prompts=("abc", "hello"), samples=1, max_new_tokens=3)
    kept = ft.frequent_tokens(target, char_tokenizer(), 8, survey=survey, progress=False)
    assert kept.numel() == 8 and 0 in kept.tolist()


@pytest.mark.skipif(not kernels.enabled(), reason="batch invariance needs the kernels")
def test_the_text_does_not_depend_on_how_rows_are_batched():
    """A random stream per continuation and batch-invariant p: the same tokens whatever the
    batching; the masses differ only by float64 summation order (tokens x 2^-52 per entry)."""
    target = tiny_llama(0, eos=0)
    prompts = [list(p) for p in SURVEY.prompts]
    one, n1 = ft._survey(target, prompts, ft.Survey(**{**SURVEY.__dict__, "rows": 1}), False)
    six, n6 = ft._survey(target, prompts, ft.Survey(**{**SURVEY.__dict__, "rows": 6}), False)
    assert n1 == n6
    assert float((one - six).abs().max()) <= n1 * 2.0**-52


def test_the_cache_key_is_the_weights_not_the_directory(tmp_path):
    """fingerprint (the GGUF drafts' and this survey's cache key): the same weights loaded from
    two directories give one key; a changed weight another."""
    from exactspec.drafters.quantized_llama_cpp import fingerprint
    from exactspec.models import load
    from tests.batch.tiny_dir import save_tiny

    a, b = load(str(save_tiny(tmp_path / "a"))), load(str(save_tiny(tmp_path / "b")))
    assert a.model.config._name_or_path != b.model.config._name_or_path
    assert fingerprint(a.model) == fingerprint(b.model)
    with torch.no_grad():
        next(b.model.parameters()).view(-1)[0] += 1.0
    assert fingerprint(a.model) != fingerprint(b.model)
