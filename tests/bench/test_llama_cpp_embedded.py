"""llama.cpp f32 on the embedded model: greedy ids equal exactspec plain's (slow: the real model,
and a 538 MB F32 GGUF exported once into the user's cache, shared with later bench runs)."""

from __future__ import annotations

import pytest

from exactspec.bench import MODES
from exactspec.bench.engines import Engines
from exactspec.bench.llama_cpp import llama_cpp_engines
from exactspec.drafters.gguf_draft import llama_cpp_available, llama_cpp_why
from exactspec.engine import generate
from exactspec.models import load
from exactspec.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not llama_cpp_available(),
                                                   reason=llama_cpp_why())]


def test_llama_cpp_f32_greedy_equals_exactspec_plain_on_smollm2():
    model = load("smollm2-135m")
    prompts = [model.encode(p, chat=True) for p in
               ("Why is the sky blue?", "Write a haiku about the sea.")]
    f32 = llama_cpp_engines()[0]
    got = Engines(model).run(f32, prompts, MODES["greedy"], 24, seed=0).texts
    plain = generate(model, prompts, params=SamplingParams(temperature=0), max_new_tokens=24)
    assert got == [g.token_ids for g in plain]
