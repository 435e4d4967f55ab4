"""CrossVocabDraft (TLI / SLEM) on tiny models with two different tokenizers built here.

Exact: vocabulary matching by bytes (byte-level BPE against SentencePiece-style pieces with
byte fallback), merged duplicates, SLEM's re-tokenization at a token boundary, greedy ==
plain greedy bit for bit. Statistical: the chi-square of TLI sampling through `generate`
against the target's exact law (false-alarm rate 1e-6), and the same test failing on a draft
that forgets to renormalise q over the intersection.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from exactspec.audit import chi_square, target_law
from exactspec.audit.samplers import sequence_ids
from exactspec.audit.stats import bincount
from exactspec.audit.world import logits_table, model_world
from exactspec.drafters import CrossVocabDraft, DraftContext, TargetInfo
from exactspec.drafters.vocab_map import token_bytes, vocab_map
from exactspec.engine import generate
from exactspec.errors import InvalidValue
from exactspec.models import as_model
from exactspec.sampling import RowStreams, SamplingParams
from tests.audit.test_engine_lossless import FILTERED, V, tiny_llama
from tests.engine.tiny import ALPHABET, tiny_model
from tests.engine.tiny import tiny_llama as tiny_char_llama

TARGET_CHARS = "abcd .xy"  # the V = 8 target tokenizer: one token per character


def char_level(chars: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[-1]))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def bpe(vocab: dict[str, int], merges: list[tuple[str, str]]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


# the V = 8 draft: shares "a", "b", "c", " " with the target, has "ab", "ba", "zz" of its own
DRAFT_VOCAB = {"<unk>": 0, "b": 1, "a": 2, " ": 3, "ab": 4, "ba": 5, "c": 6, "zz": 7}
DRAFT_MERGES = [("a", "b"), ("b", "a")]


def test_bytes_match_across_byte_level_and_sentencepiece_pieces():
    byte_level = Tokenizer(models.BPE({"Ġthe": 0, "the": 1, "Ġ": 2, "t": 3, "Ã©": 4}, []))
    byte_level.decoder = decoders.ByteLevel()
    pieces = Tokenizer(models.BPE({"<0x20>": 0, "▁the": 1, "the": 2, "▁": 3, "é": 4,
                                   "<0xC3>": 5}, [], byte_fallback=True))
    pieces.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                        decoders.Fuse()])
    draft = PreTrainedTokenizerFast(tokenizer_object=byte_level)
    target = PreTrainedTokenizerFast(tokenizer_object=pieces)
    assert token_bytes(draft) == [b" the", b"the", b" ", b"t", "é".encode()]
    assert token_bytes(target) == [b" ", b" the", b"the", b" ", "é".encode(), b"\xc3"]
    m = vocab_map(draft, target, 6)
    # " " is held by "<0x20>" (0) and "▁" (3): the regular piece is the one drafted
    assert list(zip(m.draft_ids.tolist(), m.target_ids.tolist(), strict=True)) == [
        (0, 1), (1, 2), (2, 3), (4, 4)]
    assert m.overlap == 4 and not m.duplicates
    assert m.draft_for_target.tolist() == [-1, 0, 1, 2, 4, -1]
    back = vocab_map(target, draft, 5)  # two target pieces are the draft's "Ġ": merged
    assert back.duplicates and back.draft_for_target.tolist() == [1, 2, 0, -1, 4]


def _tiny_tli(draft_tok, target_tok, width: int) -> CrossVocabDraft:
    d = CrossVocabDraft(tiny_llama(1), tokenizer=draft_tok)
    d.map = vocab_map(draft_tok, target_tok, width)
    d._width = width
    return d


def test_q_is_the_draft_renormalised_over_the_intersection_with_duplicates_added():
    pieces = Tokenizer(models.BPE({"<0x20>": 0, "▁": 1, "x": 2, "y": 3}, [], byte_fallback=True))
    pieces.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                        decoders.Fuse()])
    draft = PreTrainedTokenizerFast(tokenizer_object=pieces)
    target = char_level(" xz")  # " " 0, "x" 1, "z" 2 (no "y")
    d = _tiny_tli(draft, target, 3)
    logits = torch.tensor([[0.5, -1.0, 2.0, 3.0]])
    q = torch.softmax(d.target_logits(logits), -1)[0]
    kept = torch.softmax(logits[0, :3], -1)  # "y" dropped, the rest renormalised
    assert torch.allclose(q, torch.tensor([kept[0] + kept[1], kept[2], 0.0]), atol=1e-6)
    assert float(q[2]) == 0.0


def test_slem_reads_the_drafts_text_as_the_target_tokenizes_it():
    target_tok, draft_tok = char_level(TARGET_CHARS), bpe(DRAFT_VOCAB, DRAFT_MERGES)
    d = CrossVocabDraft(tiny_llama(1), tokenizer=draft_tok)
    d._target_tok = target_tok
    ctx = target_tok("ab a", add_special_tokens=False)["input_ids"]
    # the draft's own tokens "ba", " ", "ab", "c": text "ba abc", 6 target tokens, the last
    # one (maybe cut) dropped
    got = d._slem(ctx, draft_tok("ab a", add_special_tokens=False)["input_ids"], [5, 3, 4, 6])
    assert got == target_tok("ba ab", add_special_tokens=False)["input_ids"]


def _context(rows):
    tokens = torch.tensor(rows)
    n = torch.full((len(rows),), tokens.shape[1])
    return DraftContext(tokens, n, n.clone(), SamplingParams(), RowStreams.from_seed(0, len(rows)))


def test_no_shared_token_is_an_error():
    d = CrossVocabDraft(tiny_llama(1), tokenizer=bpe({"<unk>": 0, "q": 1}, []))
    with pytest.raises(InvalidValue, match="share no token"):
        d.begin(_context([[0, 1]]), TargetInfo(V, char_level(TARGET_CHARS)))
    with pytest.raises(InvalidValue, match="target's tokenizer"):
        d.begin(_context([[0, 1]]), TargetInfo(V, None))


GREEDY = SamplingParams(temperature=0)
PROMPTS = ["the cat sat on the mat", "a", "hello there, then the thing", "ABC 123 the end"]
WORDS = {"<unk>": 0, **{c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}}
WORD_MERGES = [("t", "h"), ("h", "e"), ("th", "e"), ("a", "n"), ("i", "n"), ("e", " ")]


@pytest.fixture(scope="module")
def char_target():
    return tiny_model(0)


@pytest.mark.parametrize("draft", ["self", "other tokenizer"])
def test_greedy_equals_plain(char_target, draft):
    plain = [g.token_ids for g in generate(char_target, PROMPTS, params=GREEDY,
                                           max_new_tokens=30)]
    if draft == "self":  # the target as its own cross-vocabulary draft: always agrees
        drafter = CrossVocabDraft(char_target)
    else:
        vocab = dict(WORDS)
        for a, b in WORD_MERGES:
            vocab.setdefault(a + b, len(vocab))
        model = tiny_char_llama(3, vocab=len(vocab))
        drafter = CrossVocabDraft(model, tokenizer=bpe(vocab, WORD_MERGES))
    out = generate(char_target, PROMPTS, drafter=drafter, params=GREEDY, max_new_tokens=30,
                   num_draft_tokens=3)
    assert [g.token_ids for g in out] == plain
    drafted = sum(g.stats.drafted for g in out)
    assert drafted > 0
    if draft == "self":
        assert sum(g.stats.accepted for g in out) == drafted
        assert drafted > 0.5 * sum(len(g.token_ids) for g in out)
    assert len(ALPHABET) + 1 == char_target.vocab_size  # the two vocabularies really differ


def test_greedy_and_sampled_rows_in_one_batch(char_target):
    """Per-row params: the greedy rows (SLEM) still equal plain greedy, the sampled rows (TLI)
    equal the same rows drafted alone (their randomness is their own)."""
    hot = SamplingParams(temperature=1.0, seed=3)
    params = [GREEDY, hot, GREEDY, hot]
    plain = [g.token_ids for g in generate(char_target, PROMPTS, params=GREEDY,
                                           max_new_tokens=20)]
    mixed = generate(char_target, PROMPTS, drafter=CrossVocabDraft(char_target), params=params,
                     max_new_tokens=20, num_draft_tokens=3)
    assert [mixed[0].token_ids, mixed[2].token_ids] == [plain[0], plain[2]]
    alone = generate(char_target, PROMPTS, drafter=CrossVocabDraft(char_target),
                     params=[hot] * 4, max_new_tokens=20, num_draft_tokens=3)
    assert [mixed[1].token_ids, mixed[3].token_ids] == [alone[1].token_ids, alone[3].token_ids]


N, K, ROWS = 3, 2, 6000  # tokens compared (512 outcomes), drafts per step, rows
PROMPT = [0, 1, 4, 0, 1, 2, 4, 0]  # "ab abc a"


@pytest.fixture(scope="module")
def pair():
    target = as_model(tiny_llama(0), char_level(TARGET_CHARS))
    logits = logits_table(lambda ids: target.model(ids).logits, PROMPT, V, N + K)
    law = target_law(model_world(logits, logits, V, N + K, FILTERED, PROMPT), N)
    return target, law


class Unrenormalised(CrossVocabDraft):
    """Wrong: draws from q over the intersection, but reports the draft's probabilities of those
    tokens under its whole vocabulary, not renormalised; `leftover`: the rest of the mass is put
    on a target token outside the intersection (as if the draft's other tokens were "x")."""

    def __init__(self, *args, leftover: int | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.leftover = leftover

    def target_logits(self, logits):
        mass = torch.softmax(logits.float(), -1)[:, self.map.draft_ids].sum(-1)  # [B]
        self.masses.append(mass)
        return super().target_logits(logits)

    def propose(self, context, num_tokens):
        self.masses = []
        drafts, q = super().propose(context, num_tokens)
        for j in range(q.shape[1]):
            q[:, j] *= self.masses[j][:, None]
            if self.leftover is not None:
                q[:, j, self.leftover] += 1 - self.masses[j]
        return drafts, q


def _counts(target, drafter, seed, rows=ROWS):
    gens = generate(target, [PROMPT] * rows, drafter=drafter, params=replace(FILTERED, seed=seed),
                    max_new_tokens=N + K, num_draft_tokens=K, batch_size=rows)
    seqs = torch.tensor([g.token_ids[:N] for g in gens])  # [ROWS, N]
    return bincount(sequence_ids(seqs, V), V**N), sum(g.stats.accepted for g in gens)


def test_tli_sampling_matches_the_target(pair):
    target, law = pair
    drafter = CrossVocabDraft(tiny_llama(1), tokenizer=bpe(DRAFT_VOCAB, DRAFT_MERGES))
    counts, accepted = _counts(target, drafter, seed=5)
    assert drafter.map.overlap == 4
    assert accepted > ROWS // 10  # drafts were really used
    result = chi_square(counts, law)
    assert result.dof > 30 and not result.rejected, result


def test_a_draft_that_forgets_to_renormalise_is_caught(pair):
    target, law = pair
    unnormalised = Unrenormalised(tiny_llama(1), tokenizer=bpe(DRAFT_VOCAB, DRAFT_MERGES))
    with pytest.raises(InvalidValue, match="sum to 1"):  # the engine refuses such a q
        generate(target, [PROMPT], drafter=unnormalised, params=FILTERED, max_new_tokens=3)
    x = TARGET_CHARS.index("x")  # a target token the draft cannot produce
    wrong = Unrenormalised(tiny_llama(1), tokenizer=bpe(DRAFT_VOCAB, DRAFT_MERGES), leftover=x)
    # a q that sums to 1 but is not what was sampled; 2,000 rows suffice (statistic ~2,600
    # against a threshold of ~210 when this was written)
    counts, _ = _counts(target, wrong, seed=6, rows=2000)
    assert chi_square(counts, law).rejected
