# The two commands: `make demo` and `make test`. Both create .venv if missing and are idempotent.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
CONSTRAINTS := constraints.txt

.PHONY: demo test lint venv clean

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev,tune]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/coretune demo

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
