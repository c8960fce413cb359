# make demo  - set up, migrate, start the lab, import it, run worker + beat, print the health table, stop.
# make test  - set up and run the default test tier against local PostgreSQL, Redis and Celery workers
#              (everything not marked slow, on two pytest workers; about 4 minutes on 2 cores).
# make test-all  - the default tier, then the slow tier alone (full chaos, browser, packaging, long e2e).
# make test-netns - the multi-node tier: magpie on several network namespaces (root; docs/multinode.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup services tools demo test test-slow test-all test-netns bench clean

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
	$(PY) -m magpie.lab.demo

# two pytest workers (pytest-xdist), a test file each at a time: every test has its own Redis key prefix and
# each worker its own PostgreSQL database, so they never meet
test: setup services tools
	$(PY) -m pytest -m "not slow" -n 2 --dist loadfile

# pytest exits 5 when a tier collects nothing: not a failure
test-slow: setup services tools
	$(PY) -m pytest -m slow || [ $$? -eq 5 ]

test-all: test test-slow

test-netns: setup services
	$(PY) -m pytest -m slow tests/netns -s

bench: setup services
	$(PY) benchmarks/queue_bench.py --routes 200000

clean:
	rm -rf $(VENV) .demo *.egg-info
