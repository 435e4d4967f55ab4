"""`generate` takes a verify method by name or as an object (exactspec.sampling.methods),
parses it once, and the two give the same text; what the object declares is what the engine
enforces."""

from __future__ import annotations

import pytest

from exactspec import SamplingParams
from exactspec.drafters import DraftModel, PromptLookup
from exactspec.engine import generate
from exactspec.engine.arguments import check_verify
from exactspec.errors import InvalidValue
from exactspec.sampling import parse_method
from tests.engine.tiny import GREEDY_PROMPTS, greedy_target, perturbed

target = greedy_target  # the module fixture of tests/engine/tiny.py
T1 = SamplingParams(temperature=1.0, seed=5)


@pytest.mark.parametrize("name", ["token", "block", "traversal", "lenient:0.5"])
def test_a_name_and_its_object_give_the_same_text(target, name):
    drafter = DraftModel(perturbed(target, 0.3))
    by_name = generate(target, GREEDY_PROMPTS, drafter=drafter, params=T1, max_new_tokens=24,
                       verify=name)
    by_object = generate(target, GREEDY_PROMPTS, drafter=drafter, params=T1,
                         max_new_tokens=24, verify=parse_method(name))
    assert [g.token_ids for g in by_name] == [g.token_ids for g in by_object]
    assert all(g.lossless == parse_method(name).lossless for g in by_object)


def test_check_verify_parses_once_and_enforces_the_declarations():
    assert check_verify("block", [T1]) is parse_method("block")
    assert check_verify(parse_method("greedy"), [SamplingParams(temperature=0)]).greedy_only
    with pytest.raises(InvalidValue, match=r"verify=.greedy. with temperature=1\.0"):
        check_verify(parse_method("greedy"), [T1])
    with pytest.raises(InvalidValue, match=r"unknown verify method.*or a callable"):
        check_verify("tokens", [T1])
    with pytest.raises(InvalidValue, match="L must be a number") as err:
        check_verify("lenient:2", [T1])
    assert "callable" not in str(err.value)  # a known rule with a bad value: no callable hint


def test_a_chain_only_method_is_refused_for_a_tree_drafter(target):
    for name in ("block", "lenient:0.5"):
        with pytest.raises(InvalidValue, match="cannot verify token trees"):
            generate(target, GREEDY_PROMPTS[:1], drafter=PromptLookup(branches=2, depth=2),
                     params=T1, max_new_tokens=4, verify=parse_method(name))
