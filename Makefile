# Two entry points for a fresh machine: `make demo` and `make test`.
# Both build .venv on first use. torch is pinned here (not in pyproject); from PyPI on Linux
# that pin is the default build with its CUDA libraries (gigabytes): set TORCH_INDEX to
# PyTorch's CPU index for the CPU-only build (see the README's set-up).
PYTHON ?= python3
VENV ?= .venv
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=
BIN := $(VENV)/bin

.PHONY: demo test lint bench-replicate gpu-check clean-venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_PIN)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/longboat run -n 2 examples/digits.py

# The suite starts with the linter, the formatter's check and the type checker (strict on
# src/longboat, as pyproject.toml's [tool.mypy] says): a change that fails any fails CI.
test: lint
	$(BIN)/python -m pytest -q

lint: $(VENV)/.installed
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks
	$(BIN)/mypy

bench-replicate: $(VENV)/.installed
	$(BIN)/python benchmarks/replicate_vs_ddp.py

# longboat on a GPU (docs/gpu.md): equivalence, memory and step time in a few minutes, results in
# benchmarks/results/gpu/. GPU_CHECK_DRY=1: the same code on the CPU, tiny sizes, into a temporary
# folder. GPU_PYTHON=python3: that interpreter as it is, no .venv (a machine whose torch came with
# it, where building .venv would download torch); benchmarks/gpu_check.sh does that without make.
GPU_PYTHON ?=
gpu-check: $(if $(GPU_PYTHON),,$(VENV)/.installed)
	$(or $(GPU_PYTHON),$(BIN)/python) benchmarks/gpu_check.py $(if $(filter 1,$(GPU_CHECK_DRY)),--dry)

clean-venv:
	rm -rf $(VENV)
