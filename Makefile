# Two entry points for a fresh machine: `make demo` and `make test`.
# Both build .venv on first use. torch is pinned here (not in pyproject); from PyPI on Linux
# that pin is the default build with its CUDA libraries (gigabytes): set TORCH_INDEX to
# PyTorch's CPU index for the CPU-only build (see the README's set-up).
PYTHON ?= python3
VENV ?= .venv
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=
BIN := $(VENV)/bin

.PHONY: demo test lint deepspeed-compare bench-replicate gpu-check clean-venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_PIN)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e ".[dev,deepspeed-compare]"
	touch $@

# Real DeepSpeed for tests/test_deepspeed_side_by_side.py, in its own folder that only those
# tests put on a PYTHONPATH: --no-deps, so that its "torch>=2.0.0" can never bring another torch
# (its light dependencies are the deepspeed-compare extra above); DS_BUILD_OPS=0 builds none of
# its compiled ops (the tests pass a torch optimizer).
DS_PIN ?= deepspeed==0.19.8
DS_HOME ?= .deepspeed
$(DS_HOME)/.installed: $(VENV)/.installed
	rm -rf $(DS_HOME)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q --no-deps --no-build-isolation --target $(DS_HOME) "$(DS_PIN)"
	touch $@

deepspeed-compare: $(DS_HOME)/.installed

demo: $(VENV)/.installed
	$(BIN)/longboat run -n 2 examples/digits.py

# The suite starts with the linter, the formatter's check and the type checker (strict on
# src/longboat, as pyproject.toml's [tool.mypy] says): a change that fails any fails CI.
test: lint $(DS_HOME)/.installed
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
	rm -rf $(VENV) $(DS_HOME)
