# Two entry points (see README): `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
# torch: the lowest supported release by default; CI also runs the suite on the newest one
# (.ci/run: make test TORCH=2.14.1 VENV=.venv-torch-2.14.1), the range pyproject.toml allows.
TORCH ?= 2.13.0
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/stalepipe demo

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

# mypy checks the public API's modules and a user's view of them ([tool.mypy] in pyproject.toml)
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .venv-torch-* build *.egg-info
