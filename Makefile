# `make demo` and `make test` work on a fresh clone: they create .venv and install the project
# with torch pinned (constraints.txt) before running. `make demo` installs the runtime
# dependencies only; `make test` (and validate, bench) adds the extras: test (pytest,
# hypothesis), megatron (megatron-core, for validate --against megatron-core) and ray (fit
# --engine ray), and torchtitan 0.3.0 with what it imports (requirements-torchtitan.txt,
# --no-deps: the torchtitan front door). On a machine without a CPU wheel of torch nearby,
# PyPI's torch is a multi-GB CUDA build: give pip PyTorch's CPU index,
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make demo (README's first lines).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
EXTRAS := $(VENV)/.installed-extras

.PHONY: demo test validate bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(RUNTIME): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install --quiet -c constraints.txt -e .
	touch $(RUNTIME)

$(EXTRAS): $(RUNTIME) requirements-torchtitan.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,megatron,ray]'
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-torchtitan.txt
	touch $(EXTRAS)

# The main job: DeepSeek-V3 on 1024 GPUs (TP 2 + SP, PP 16, EP 8), b=1, s=4096, 16 microbatches,
# 1F1B, flash attention, ZeRO-1, Megatron precision; one row per pipeline stage, a verdict
# against 80 GiB and, with --what-fits, seven single changes re-estimated (about 4x the time).
# `make demo` is `tracemem estimate`; the small built-in transformer is `tracemem toy`.
DEMO_ARGS = --model deepseek-v3 --world-size 1024 --tp 2 --sp --pp 16 --ep 8 --etp 1 \
	--pp-first-stage-layers 4 --pp-last-stage-layers 1 \
	--micro-batch-size 1 --seq-length 4096 --num-microbatches 16 --schedule 1f1b \
	--recompute none --attention flash --zero 1 --precision megatron --hbm 80GiB --what-fits

demo: $(RUNTIME)
	$(BIN)/tracemem estimate $(DEMO_ARGS)

test: $(EXTRAS)
	$(BIN)/python -m pytest

validate: $(EXTRAS)
	$(BIN)/tracemem validate
	$(BIN)/tracemem validate --against megatron-ci

bench: $(EXTRAS)
	$(BIN)/python benchmarks/tracer_overhead.py
	$(BIN)/python benchmarks/tracer_vs_memtracker.py
	$(BIN)/python benchmarks/layer_trace.py
	$(BIN)/python benchmarks/estimate_demo.py
	$(BIN)/python benchmarks/allocator_replay.py
	$(BIN)/python benchmarks/fit_sweep.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
