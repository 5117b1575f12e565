# Everything runs inside a project virtualenv ($(VENV)); `make install` creates it.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# torch 2.14.1 is what SGLang 0.5.23 pins; its CUDA 13.0 build also compiles our CUDA sources.
TORCH_SPEC ?= torch==2.14.1
export TORCH_CUDA_ARCH_LIST ?= 9.0

.PHONY: install test bench gpu-check lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip setuptools wheel ninja

install: $(PY)
	$(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install --no-build-isolation -e ".[test,bench]"

test:
	$(PY) -m pytest -q tests

bench:
	$(PY) bench/bench_ops.py

# On a GPU machine: build with CUDA, cuda tests, compute-sanitizer, kernel benchmark -> $$OUT.
gpu-check:
	bash bench/gpu_check.sh

lint:
	$(VENV)/bin/ruff check .

clean:
	rm -rf build sglang_dflash/_C*.so *.egg-info
