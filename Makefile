# The two commands: `make demo` and `make test` (which also builds the docs site, `make docs`, into site/).
# Both create .venv if missing and are idempotent.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
CONSTRAINTS := constraints.txt

.PHONY: demo test lint docs venv clean

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev,tune,docs,mlflow,tensorboard,wandb]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/coretune demo

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports

docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

test: lint docs
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info
