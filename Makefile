# flare: the README's two commands are `make serve` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test test-cuda lint typecheck bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,cuda]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/flare run $(ARGS)

test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# On a machine with a CUDA device: the cuda-marked tests, then every program timed on it.
test-cuda: $(STAMP)
	$(BIN)/python -m pytest -q -m cuda tests
	$(BIN)/flare bench programs --backend cuda

lint: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy policy actors

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
