# `make train`: set up .venv, train the quickstart model, print a sample.  `make test`: set up, run the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= runs/quickstart

.PHONY: train test clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) launch/train.py --config=configs/quickstart.py --workdir=$(WORKDIR)
	$(PY) launch/sample.py --workdir=$(WORKDIR)

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf runs .pytest_cache
