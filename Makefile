# `make train`: set up .venv, train the quickstart model, print a sample.  `make test`: set up, run the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= runs/quickstart

.PHONY: train test mutation clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) launch/train.py --config=configs/quickstart.py --workdir=$(WORKDIR)
	$(PY) launch/sample.py --workdir=$(WORKDIR)

test: $(STAMP)
	$(PY) -m pytest -q --durations=40 tests

# Mutation testing (mutmut; not part of CI): the modules and tests named in pyproject.toml [tool.mutmut].
mutation: $(STAMP)
	$(PY) -m pip install -q mutmut
	rm -rf mutants
	$(VENV)/bin/mutmut run || true
	$(VENV)/bin/mutmut results > mutation-report.txt || true
	@echo "surviving mutants: mutation-report.txt (mutmut show NAME prints one)"

clean:
	rm -rf runs .pytest_cache mutants mutation-report.txt
