"""SamplingParams validation: every bad value is named, all at once."""

import pytest

from exactspec import SamplingParams


def test_defaults_are_plain_sampling():
    params = SamplingParams()
    assert not params.is_greedy and not params.uses_history
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(repetition_penalty=1.2).uses_history
    assert SamplingParams(frequency_penalty=0.5).uses_history


@pytest.mark.parametrize("kwargs, word", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": float("inf")}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"logit_bias": {-3: 1.0}}, "logit_bias key"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias[3]"),
    ({"logit_bias": [1, 2]}, "logit_bias must be a mapping"),
    ({"seed": 1.5}, "seed"),
])
def test_bad_values_are_named(kwargs, word):
    with pytest.raises(ValueError, match=word.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_all_problems_reported_at_once():
    with pytest.raises(ValueError) as info:
        SamplingParams(temperature=-1, top_p=2)
    assert "temperature" in str(info.value) and "top_p" in str(info.value)


def test_frozen_hashable_and_bias_copied():
    bias = {1: 2.0}
    params = SamplingParams(logit_bias=bias)
    bias[1] = 100.0
    assert params.logit_bias == {1: 2.0}
    assert hash(params) == hash(SamplingParams(logit_bias={1: 2.0}))
    with pytest.raises(AttributeError):
        params.temperature = 0.5  # type: ignore[misc]
