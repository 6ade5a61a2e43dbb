# Two entry points (see README): `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
# torch: the lowest supported release by default; CI also runs the tests that lean on torch's
# APIs (the delay's optimizer protocol, the runtime, DCP checkpoints) on the newest release
# pyproject.toml allows, in a venv of its own (`make test-newest`).
TORCH ?= 2.13.0
NEWEST_TORCH := 2.14.1
NEWEST_TESTS := tests/delay tests/dist/test_runtime.py tests/dist/test_dcp_checkpoints.py tests/train/test_train.py
TESTS ?=
# pytest processes (pytest-xdist): the suite's tests are independent; 2 fits a 2-core machine
TEST_WORKERS ?= 2
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-newest lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/stalepipe demo

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(TESTS)

test-newest:
	$(MAKE) test TORCH=$(NEWEST_TORCH) VENV=.venv-torch-$(NEWEST_TORCH) TESTS="$(NEWEST_TESTS)"

# mypy checks the public API's modules and a user's view of them ([tool.mypy] in pyproject.toml)
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .venv-torch-* build *.egg-info
