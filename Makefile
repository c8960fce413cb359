# make demo  - set up, migrate, start the lab, import it, run worker + beat, print the health table, stop.
# make test  - set up and run the whole test suite against local PostgreSQL, Redis and Celery workers.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup services tools demo test test-all bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,lab,dev,flower]"
	touch $@

services:
	@bash scripts/services.sh

tools:
	@bash scripts/test_tools.sh

demo: setup services
	$(PY) -m magpie.demo

test: setup services tools
	$(PY) -m pytest -m "not slow"

test-all: setup services tools
	$(PY) -m pytest

bench: setup services
	$(PY) benchmarks/queue_bench.py --routes 200000

clean:
	rm -rf $(VENV) .demo *.egg-info
