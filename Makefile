# `make demo` and `make test` work on a fresh clone: they create .venv and install the project
# with torch pinned (constraints.txt) before running.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test validate bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tracemem demo

test: $(STAMP)
	$(BIN)/python -m pytest

validate: $(STAMP)
	$(BIN)/tracemem validate

bench: $(STAMP)
	$(BIN)/python benchmarks/tracer_overhead.py
	$(BIN)/python benchmarks/tracer_vs_memtracker.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
