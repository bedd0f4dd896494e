# flare: the README's two commands are `make serve` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed-serve
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: serve test test-cuda lint typecheck bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Serving installs what flare needs to run; the tests add the dev extras.
$(SERVE_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[cuda]'
	touch $@

$(DEV_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev,cuda]'
	touch $@ $(SERVE_STAMP)

serve: $(SERVE_STAMP)
	$(BIN)/flare run $(ARGS)

test: $(DEV_STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# On a machine with a CUDA device: the cuda-marked tests, then every program timed on it.
test-cuda: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -m cuda tests
	$(BIN)/flare bench programs --backend cuda

lint: $(DEV_STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy policy actors

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
