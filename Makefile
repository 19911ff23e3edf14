# The two commands: `make demo` and `make test` (which also builds the docs site, `make docs`, into site/).
# Both create .venv if missing and are idempotent.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
CONSTRAINTS := constraints.txt

.PHONY: demo test test-fast lint docs venv clean

# make test's environment: every extra (dev brings demo, bench, tune, tune-postgres, cluster, onnx, robust) and the docs' and loggers' packages.
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev,docs,mlflow,tensorboard,wandb]'
	@command -v g++ >/dev/null || echo "note: no C++ compiler (g++): torch.compile (--model.compile) falls back to eager on CPU and its tests are skipped; install g++ (apt-get install g++) to run them"
	touch $@

# make demo's: the core and the demo extra only (scikit-learn's digits), unless make test's is already there.
$(VENV)/.demo-installed: pyproject.toml $(CONSTRAINTS) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -f $(VENV)/.installed || $(PIP) install -q -c $(CONSTRAINTS) -e '.[demo]'
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.demo-installed
	$(VENV)/bin/coretune demo

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports

docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The suite in worker processes, one per core up to 4 (pytest-xdist): about half the time on this 2-core machine.
# (A third worker on 2 cores gave no gain on a fresh clone: pytest 594 s at stop 63 against 584 s with two at stop 62,
# whose code had 6 more fits: not side by side.)
# worksteal: a worker that runs out of tests takes some of another's queue, so a long test near the end of one
# worker's share does not leave the other idle.
PYTEST_WORKERS := -n auto --maxprocesses 4 --dist worksteal

test: lint docs
	$(PY) -m pytest -q $(PYTEST_WORKERS)

# The inner loop (< 3 min on 2 cores): the maths, objectives, data, models and sweep tables, no end-to-end fit.
# Run `make test` (every test, lint, contracts, docs) before a commit lands.
FAST_TESTS := tests/objectives tests/data tests/models tests/test_losses.py tests/test_mining.py tests/test_memory.py \
	tests/test_attacks.py tests/test_atomicfile.py tests/test_runclaim.py tests/test_stopfile.py tests/test_arguments.py \
	tests/test_version.py tests/test_reliability_catalogue.py tests/test_rundir.py tests/test_fuzz.py \
	tests/sweeps/test_sweeps_records.py tests/sweeps/test_sweeps_report.py tests/sweeps/test_sweeps_spec.py \
	tests/sweeps/test_sweeps_stats.py tests/sweeps/test_sweeps_status.py tests/sweeps/test_sweeps_golden.py \
	tests/sweeps/test_sweeps_compare_choice.py \
	tests/sweeps/test_sweeps_table6.py tests/sweeps/test_sweeps_table7.py tests/sweeps/test_sweeps_table8.py

test-fast: venv
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest -q $(PYTEST_WORKERS) -m "not ddp" $(FAST_TESTS)

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info
