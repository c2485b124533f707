# Set-up and the two jobs. Each target builds the virtual environment first, so one command does
# everything on a fresh machine. Pins: torch 2.13.0 is the CPU build on disk; triton 3.6.0 is the
# GPU machine's; numpy<2.3 because the Triton interpreter breaks on newer numpy. megatron-core
# 0.16.1 (the newest for Python 3.11; it needs only torch, numpy and packaging) runs
# tests/test_megatron.py: its wheel installs in ~3 s.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test lint

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 triton==3.6.0 'numpy<2.3'
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q 'megatron-core==0.16.1'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m s2attn demo

test: setup
	$(PY) -m pytest -q -n 2 --durations=15

lint: setup
	$(VENV)/bin/ruff check s2attn tests benchmarks
