"""Under load the "auto" policy decodes plain, and plain must cost the llama.cpp self-draft
nothing: a step at K = 0 feeds it no token, and a probe (one row, one draft token) feeds that
row alone. Counted: every token handed to llama_decode, per row. Exact all along: greedy rows
equal plain greedy."""

from __future__ import annotations

import pytest

from exactspec import SamplingParams
from exactspec.drafters.gguf_draft import llama_cpp_available
from exactspec.engine import generate
from exactspec.engine.loop import DecodeConfig, Decoder
from exactspec.engine.policy import AUTO_PROBE_EVERY
from tests.engine.test_rows import PROMPTS
from tests.engine.tiny import tiny_llama

pytestmark = pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python not installed")

STEPS = 3 * AUTO_PROBE_EVERY + 4  # at least two probes


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def _plain_costs(policy, rows: int) -> None:
    """Costs at which plain decoding wins at this load, held fixed (no timing in the test)."""
    policy.draft_cost = {1: 1.0, rows: 4.0}
    policy.target_cost = {(rows, 1): 0.1, (rows, 2): 0.2}
    policy.observe_costs = lambda *args, **kwargs: None


def test_plain_steps_feed_the_llama_cpp_draft_nothing_and_probes_one_row(target):
    import exactspec as es

    drafter = es.QuantizedDraft(8, backend="llama.cpp")
    greedy = SamplingParams(temperature=0)
    cfg = DecodeConfig(params=greedy, max_new_tokens=STEPS + 2, num_draft_tokens="auto",
                       verify="token", return_logprobs=False, eos_token_ids=[], stop=[],
                       tokenizer=None)
    dec = Decoder(target, drafter, cfg, on_fault="raise")
    rows = [dec.make_row(i, p, greedy, 0) for i, p in enumerate(PROMPTS)]
    dec.admit(rows)
    _plain_costs(dec.batch.policy, len(rows))
    gguf = drafter._gguf
    fed: list[set[int]] = []  # per llama_decode call: the rows it fed
    real = gguf._decode_chunk

    def counted(c, chunk, out):
        fed.append({i for i, _, _, _ in chunk})
        return real(c, chunk, out)

    gguf._decode_chunk = counted
    drafting_steps = 0
    for _ in range(STEPS):
        before = len(fed)
        want = sum(r.output.stats.drafted for r in rows)
        dec.step()
        drafted = sum(r.output.stats.drafted for r in rows) - want
        assert drafted in (0, 1)  # plain, or a probe's one token
        assert (len(fed) > before) == (drafted == 1)  # a plain step feeds llama.cpp nothing
        drafting_steps += drafted
    assert drafting_steps >= 4  # two probes of two steps each
    assert fed and all(len(rows_fed) == 1 for rows_fed in fed)  # a probe feeds one row
    for r in rows:
        plain = generate(target, [r.prompt], params=greedy, max_new_tokens=STEPS + 2)[0]
        assert r.output.tokens[:STEPS] == plain.token_ids[:STEPS]
