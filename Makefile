# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv, install the package with its demo extra, train on digits
#   make test   create .venv, install the package with its test extra, run the whole suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
DEMO_OUT ?= out/demo

.PHONY: demo test conformance bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.demo-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q -e '.[demo]'
	touch $@

$(VENV)/.test-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q -e '.[test]'
	touch $@

demo: $(VENV)/.demo-installed
	$(PY) -m onnx_training_ops demo --out $(DEMO_OUT)

test: $(VENV)/.test-installed
	$(PY) -m pytest

conformance: $(VENV)/.demo-installed
	$(PY) -m onnx_training_ops conformance

bench: $(VENV)/.test-installed
	$(PY) benchmarks/bench_optimizers.py

clean:
	rm -rf $(VENV) out build *.egg-info .pytest_cache .hypothesis
