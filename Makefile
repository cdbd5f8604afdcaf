# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv, install the package with its demo extra, train on digits
#   make test   create .venv, install the package with its test extra, the JavaScript trainer's
#               npm packages (js/, from its lockfile) and, when missing, nodejs, npm and Debian's
#               chromium system-wide with apt-get (it says so first), then ruff and mypy (`make lint`) and the whole suite
#               (the Node and headless-Chromium tests run inside it: tests/test_export_js.py;
#               the documentation site is built with `mkdocs build --strict`: tests/test_docs_site.py)
#   make test SKIP_BROWSER=1   the same without chromium: the browser tests are skipped, with the reason
#   make test TEST_WORKERS=N   the suite in N pytest-xdist processes, a test file each (default 2: a
#               2-core machine runs the suite in under 10 minutes; TEST_WORKERS=0 runs it in this process)
#   make lint   ruff over the whole tree and mypy over the package (pyproject.toml [tool.ruff], [tool.mypy];
#               the test extra installs both)
#   make docs   build the documentation site into site/ (mkdocs, Material, mkdocstrings)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
DEMO_OUT ?= out/demo
# SKIP_BROWSER=1: no chromium install, the browser tests skip (OTO_SKIP_BROWSER=1 for pytest alone)
SKIP_BROWSER ?=
TEST_WORKERS ?= 2

.PHONY: demo lint test test-js js-deps browser-deps docs test-min conformance bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.demo-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q -e '.[demo]'
	touch $@

$(VENV)/.test-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q -e '.[test]'
	touch $@

$(VENV)/.docs-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q -e '.[docs]'
	touch $@

demo: $(VENV)/.demo-installed
	$(PY) -m onnx_training_ops demo --out $(DEMO_OUT)

# js/: npm with the lockfile; --ignore-scripts: onnxruntime-node's install script downloads
# what its package already holds (the CPU binaries), which a closed network refuses
JS_INSTALLED := js/node_modules/.installed
$(JS_INSTALLED): js/package.json js/package-lock.json
	@command -v npm >/dev/null || { echo "make: npm is missing: installing nodejs and npm system-wide (apt-get install nodejs npm)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm; }
	cd js && npm ci --ignore-scripts --no-audit --no-fund
	touch $@

# the browser for the tests: Debian's chromium (puppeteer-core downloads none); SKIP_BROWSER=1: none
browser-deps:
ifeq ($(SKIP_BROWSER),)
	@[ -x "$${CHROMIUM:-/usr/bin/chromium}" ] || { echo "make: chromium is missing: installing Debian's chromium system-wide (apt-get install chromium) for the browser tests; skip them with: make test SKIP_BROWSER=1"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
else
	@echo "make: SKIP_BROWSER=1: no chromium, the browser tests are skipped"
endif

js-deps: $(JS_INSTALLED) browser-deps

# ruff over the whole tree and mypy over the package (pyproject.toml [tool.ruff], [tool.mypy]);
# `make test` runs both before pytest
lint: $(VENV)/.test-installed
	$(PY) -m ruff check .
	$(PY) -m mypy

test: $(VENV)/.test-installed js-deps lint
	$(if $(SKIP_BROWSER),OTO_SKIP_BROWSER=1 )$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# the documentation site (also built, strictly, by the test suite: tests/test_docs_site.py)
docs: $(VENV)/.docs-installed
	$(PY) -m mkdocs build --strict --site-dir site

# the JavaScript trainer alone: Python writes the fixtures, node --test and Chromium train them
test-js: $(VENV)/.test-installed js-deps
	$(if $(SKIP_BROWSER),OTO_SKIP_BROWSER=1 )$(PY) -m pytest tests/test_export_js.py tests/test_fault_js.py

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
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) $(MIN_VENV) out build site *.egg-info .pytest_cache .hypothesis .mypy_cache
