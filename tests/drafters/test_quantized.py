"""QuantizedDraft: arguments, targets it refuses, and its copy following the target's weights."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from exactspec import SamplingParams
from exactspec.drafters.quantized import QuantizedDraft
from exactspec.engine import generate
from exactspec.models.lean import lean_forward_for
from tests.engine.tiny import tiny_llama

GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"bits": 3}, ValueError, "bits=3"),
    ({"bits": "8"}, TypeError, "bits must be an int"),
    ({"bits": True}, TypeError, "bits must be an int"),
    ({"layers": [2, 1]}, ValueError, "increasing"),
    ({"layers": [1, 1]}, ValueError, "increasing"),
    ({"layers": "0,1"}, TypeError, "layers must be a list"),
    ({"layers": [0.5]}, TypeError, "layers must hold ints"),
    ({"group_size": 48}, ValueError, "group_size=48"),
])
def test_bad_arguments_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        QuantizedDraft(**kwargs)


def test_layers_outside_the_target_are_refused_at_begin():
    target = tiny_llama(0)  # 2 layers
    with pytest.raises(ValueError, match=r"layers=\[0, 5\] must lie in 0..1"):
        generate(target, [[1, 2, 3]], drafter=QuantizedDraft(8, layers=[0, 5]), params=GREEDY,
                 max_new_tokens=4)


def test_a_target_without_the_lean_forward_is_refused():
    cfg = GPT2Config(vocab_size=16, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    target = GPT2LMHeadModel(cfg).eval()
    with pytest.raises(ValueError, match="Llama-architecture"):
        generate(target, [[1, 2, 3]], drafter=QuantizedDraft(8), params=GREEDY,
                 max_new_tokens=4)


def test_the_copy_is_cached_and_rebuilt_after_a_weight_update():
    target = tiny_llama(0)
    drafter = QuantizedDraft(8)
    generate(target, [[1, 2, 3]], drafter=drafter, params=GREEDY, max_new_tokens=4)
    first = drafter.forward
    generate(target, [[4, 5]], drafter=drafter, params=GREEDY, max_new_tokens=4)
    assert drafter.forward is first  # built once per target, not per call
    assert lean_forward_for(target, "int8") is first
    with torch.no_grad():  # an in-place policy update, as an RL step makes
        for p in target.parameters():
            p.mul_(-1.0)
    out = generate(target, [[1, 2, 3]], drafter=drafter, params=GREEDY, max_new_tokens=12)
    assert drafter.forward is not first
    plain = generate(target, [[1, 2, 3]], params=GREEDY, max_new_tokens=12)
    assert out[0].token_ids == plain[0].token_ids
    # the rebuilt copy drafts the new weights: it agrees with the new target
    assert out[0].stats.accepted > out[0].stats.drafted // 2
