# The two commands: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-unit lint typecheck bench clean

install: $(STAMP)

# Re-installs only when the project's metadata changed; quick otherwise.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(STAMP)

demo: install
	$(BIN)/calmq demo

test: install
	$(BIN)/python -m pytest tests

test-unit: install
	$(BIN)/python -m pytest tests/unit

lint: install
	$(BIN)/ruff check calmq producers relay processors tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

typecheck: install
	$(BIN)/mypy

bench: install
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) build *.egg-info

.PHONY: chaos
# The fault matrix in full (2,000 jobs, 20 s outages); `make test` runs a reduced form.
chaos: install
	CALMQ_CHAOS_FULL=1 $(BIN)/python -m pytest tests/chaos/test_fault_matrix.py --timeout 900
