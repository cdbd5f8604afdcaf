# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv, install the package with its demo extra, train on digits
#   make test   create .venv, install the package with its test extra, run the whole suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
DEMO_OUT ?= out/demo

.PHONY: demo test test-min conformance bench clean

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

# the declared minimum versions (pyproject.toml) in a venv of their own: conformance + a
# training smoke test (under a minute once the wheels are cached; not part of `make test`).
# MIN_PYTHON=python3.10 also tests the minimum interpreter (requires-python).
MIN_PYTHON ?= $(PYTHON)
MIN_VENV ?= .venv-min
MIN_PY = $(abspath $(MIN_VENV))/bin/python
MIN_PINS := onnx==1.22.0 onnxruntime==1.17.0 onnxruntime-extensions==0.12.0 numpy==1.26.4 numba==0.60.0
test-min:
	$(MIN_PYTHON) -m venv $(MIN_VENV)
	$(MIN_PY) -m pip --disable-pip-version-check install -q $(MIN_PINS)
	$(MIN_PY) -m pip --disable-pip-version-check install -q --no-deps -e .
	cd /tmp && $(MIN_PY) -m onnx_training_ops conformance
	cd /tmp && $(MIN_PY) $(CURDIR)/.ci/min_versions_smoke.py

conformance: $(VENV)/.demo-installed
	$(PY) -m onnx_training_ops conformance
	$(PY) -m onnx_training_ops conformance --portable

bench: $(VENV)/.test-installed
	$(PY) benchmarks/bench_optimizers.py

clean:
	rm -rf $(VENV) $(MIN_VENV) out build *.egg-info .pytest_cache .hypothesis
