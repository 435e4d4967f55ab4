"""Seeded generations pinned token for token: the sampler's and the engine's fast paths (greedy
shortcuts, one finiteness pass, no zero-filled q) must not change which token a seed draws.

The ids were recorded at 37d2047, before those fast paths, on tiny random Llamas (float32,
one thread): plain decoding at T=1, with every filter, a batch mixing greedy and T=1 rows, and
speculative decoding with the int8 self-draft (token and block verification, greedy, mixed
laws) and with a draft model at top-p 0.8. A sampler change that moves a single draw (a
different cumulative sum, a skipped uniform, a reordered stream) changes these lists.
"""

from __future__ import annotations

import pytest

from exactspec import SamplingParams as SP
from exactspec.drafters.draft_model import DraftModel
from exactspec.drafters.quantized import QuantizedDraft
from exactspec.engine import generate
from tests.engine.tiny import perturbed, tiny_llama

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 12, 3]]

# name -> (generate's arguments, drafter ("q8": int8 self-draft, "dm": a draft model), vocab)
CASES = {
    "plain_t1": (dict(params=SP(temperature=1, seed=7)), None, 49),
    "plain_filters": (dict(params=SP(temperature=0.8, top_p=0.9, top_k=20, min_p=0.02,
                                     repetition_penalty=1.2, seed=8)), None, 512),
    "plain_mixed": (dict(params=[SP(temperature=0, seed=1), SP(temperature=1, seed=2)]),
                    None, 512),
    "int8_t1": (dict(params=SP(temperature=1, seed=7)), "q8", 49),
    "int8_greedy": (dict(params=SP(temperature=0, seed=0)), "q8", 512),
    "int8_mixed": (dict(params=[SP(temperature=0, seed=1),
                                SP(temperature=0.9, presence_penalty=0.5, seed=2)]), "q8", 512),
    "int8_block": (dict(params=SP(temperature=1, seed=9), verify="block"), "q8", 512),
    "draft_model_t1": (dict(params=SP(temperature=1, top_p=0.8, seed=3)), "dm", 512),
}

PINNED = {
    "plain_t1": [[4, 10, 7, 30, 39, 19, 7, 30, 7, 44, 24, 14, 42, 47, 11, 47, 42, 14, 32, 33],
                 [38, 5, 24, 14, 18, 15, 34, 21, 30, 7, 30, 39, 1, 17, 7, 30, 39, 19, 7, 15]],
    "plain_filters": [[205, 5, 20, 182, 100, 293, 365, 434, 126, 296, 417, 148, 310, 309, 263,
                       6, 352, 311, 236, 491],
                      [31, 352, 316, 506, 344, 199, 458, 172, 401, 477, 1, 475, 239, 291, 207,
                       197, 66, 112, 168, 5]],
    "plain_mixed": [[319, 0, 258, 17, 319, 0, 126, 296, 270, 33, 211, 33, 211, 33, 211, 100,
                     368, 296, 270, 120],
                    [31, 485, 31, 78, 411, 156, 490, 260, 309, 157, 203, 142, 382, 18, 28, 138,
                     73, 100, 89, 298]],
    "int8_t1": [[30, 7, 30, 22, 37, 47, 11, 30, 39, 1, 25, 10, 3, 38, 48, 7, 33, 10, 43, 7],
                [2, 17, 7, 44, 24, 14, 42, 21, 30, 39, 1, 17, 14, 41, 38, 48, 37, 4, 2, 9]],
    "int8_greedy": [[319, 0, 258, 17, 319, 0, 126, 296, 270, 33, 211, 33, 211, 33, 211, 100,
                     368, 296, 270, 120],
                    [31, 352, 358, 242, 295, 288, 19, 78, 498, 470, 437, 78, 498, 92, 239, 226,
                     73, 507, 287, 328]],
    "int8_mixed": [[319, 0, 258, 17, 319, 0, 126, 296, 270, 33, 211, 33, 211, 33, 211, 100,
                    368, 296, 270, 120],
                   [31, 352, 75, 84, 340, 408, 498, 293, 401, 348, 498, 470, 310, 309, 217, 46,
                    333, 489, 142, 52]],
    "int8_block": [[258, 47, 319, 217, 258, 338, 120, 359, 341, 202, 171, 418, 403, 133, 350,
                    504, 384, 424, 268, 482],
                   [401, 118, 442, 265, 202, 310, 96, 118, 130, 78, 296, 380, 366, 159, 410,
                    142, 139, 456, 244, 29]],
    "draft_model_t1": [[406, 195, 31, 461, 403, 111, 423, 20, 182, 447, 34, 294, 142, 226, 368,
                        238, 300, 211, 408, 473],
                       [113, 423, 80, 7, 7, 7, 100, 121, 161, 465, 302, 273, 454, 298, 468, 32,
                        16, 136, 131, 382]],
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_seed_draws_the_pinned_tokens(name):
    kwargs, drafter, vocab = CASES[name]
    target = tiny_llama(0, vocab=vocab)
    if drafter == "q8":
        kwargs = {**kwargs, "drafter": QuantizedDraft(8, backend="torch"), "num_draft_tokens": 3}
    elif drafter == "dm":
        kwargs = {**kwargs, "drafter": DraftModel(perturbed(target, 0.3)), "num_draft_tokens": 3}
    gens = generate(target, PROMPTS, max_new_tokens=20, return_logprobs=True, **kwargs)
    assert [g.token_ids for g in gens] == PINNED[name]
    for g in gens:  # greedy rows' logprobs are exactly 0 (log 1), sampled rows' finite
        greedy = (kwargs["params"][gens.index(g)] if isinstance(kwargs["params"], list)
                  else kwargs["params"]).temperature == 0
        assert all(lp == 0.0 for lp in g.logprobs) if greedy else all(
            -1e4 < lp <= 0.0 for lp in g.logprobs)
