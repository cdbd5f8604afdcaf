# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv, install the package with its demo extra, train on digits
#   make test   create .venv, install the package with its test extra, the JavaScript trainer's
#               npm packages (js/, from its lockfile) and Debian's chromium, run the whole suite
#               (the Node and headless-Chromium tests run inside it: tests/test_export_js.py)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
DEMO_OUT ?= out/demo

.PHONY: demo test test-js js-deps test-min conformance bench clean

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

# js/: npm with the lockfile; --ignore-scripts: onnxruntime-node's install script downloads
# what its package already holds (the CPU binaries), which a closed network refuses
JS_INSTALLED := js/node_modules/.installed
$(JS_INSTALLED): js/package.json js/package-lock.json
	@command -v npm >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm; }
	cd js && npm ci --ignore-scripts --no-audit --no-fund
	touch $@

# the browser for the tests: Debian's chromium (puppeteer-core downloads none)
js-deps: $(JS_INSTALLED)
	@[ -x "$${CHROMIUM:-/usr/bin/chromium}" ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

test: $(VENV)/.test-installed js-deps
	$(PY) -m pytest

# the JavaScript trainer alone: Python writes the fixtures, node --test and Chromium train them
test-js: $(VENV)/.test-installed js-deps
	$(PY) -m pytest tests/test_export_js.py tests/test_fault_js.py

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
