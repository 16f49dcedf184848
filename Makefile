# `make demo` and `make test` work on a fresh clone: they create .venv and install the project
# with torch pinned (constraints.txt) before running.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test validate bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,megatron,ray]'
	touch $(STAMP)

# The main job: DeepSeek-V3 on 1024 GPUs (TP 2 + SP, PP 16, EP 8), b=1, s=4096, 16 microbatches,
# 1F1B, flash attention, ZeRO-1, Megatron precision; one row per pipeline stage, a verdict
# against 80 GiB and, with --what-fits, six single changes re-estimated (about 3x the time).
# `make demo` is `tracemem estimate`; the small built-in transformer is `tracemem toy`.
DEMO_ARGS = --model deepseek-v3 --world-size 1024 --tp 2 --sp --pp 16 --ep 8 --etp 1 \
	--pp-first-stage-layers 4 --pp-last-stage-layers 1 \
	--micro-batch-size 1 --seq-length 4096 --num-microbatches 16 --schedule 1f1b \
	--recompute none --attention flash --zero 1 --precision megatron --hbm 80GiB --what-fits

demo: $(STAMP)
	$(BIN)/tracemem estimate $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest

validate: $(STAMP)
	$(BIN)/tracemem validate
	$(BIN)/tracemem validate --against megatron-ci

bench: $(STAMP)
	$(BIN)/python benchmarks/tracer_overhead.py
	$(BIN)/python benchmarks/tracer_vs_memtracker.py
	$(BIN)/python benchmarks/layer_trace.py
	$(BIN)/python benchmarks/estimate_demo.py
	$(BIN)/python benchmarks/allocator_replay.py
	$(BIN)/python benchmarks/fit_sweep.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
