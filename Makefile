# The two commands: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-unit lint typecheck bench clean browser promtool pgbouncer

install: $(STAMP)

# Re-installs only when the project's metadata changed; quick otherwise.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(STAMP)

demo: install
	$(BIN)/calmq demo

test: install browser promtool pgbouncer
	$(BIN)/python -m pytest tests

# The console's browser tests (tests/e2e/test_console.py) drive Debian's Chromium, never a
# browser Playwright downloads. Where the package cannot be installed they are skipped
# with the reason (and fail under CI=true).
browser:
	@test -x /usr/bin/chromium || apt-get install -y --no-install-recommends chromium \
	  || { apt-get update && apt-get install -y --no-install-recommends chromium; } \
	  || echo "make browser: the chromium package could not be installed; the console's browser tests will be skipped"

# Prometheus' own checker for the shipped alert rules (tests/unit/test_alerts.py), from
# Debian's prometheus package (its service is not started). Skipped where it cannot be
# installed, as above.
promtool:
	@command -v promtool >/dev/null || apt-get install -y --no-install-recommends prometheus \
	  || { apt-get update && apt-get install -y --no-install-recommends prometheus; } \
	  || echo "make promtool: the prometheus package could not be installed; the alert-rule check will be skipped"

# PgBouncer in transaction mode for tests/integration/test_pgbouncer.py (`calmq dev up
# --pgbouncer`), from Debian's pgbouncer package (its service is not started). Skipped where
# it cannot be installed; under CI=true the test fails instead.
pgbouncer:
	@test -x /usr/sbin/pgbouncer || command -v pgbouncer >/dev/null \
	  || apt-get install -y --no-install-recommends pgbouncer \
	  || { apt-get update && apt-get install -y --no-install-recommends pgbouncer; } \
	  || echo "make pgbouncer: the pgbouncer package could not be installed; the PgBouncer test will be skipped"

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
# The fault matrix in full (2,000 jobs, 20 s outages), and the broker-loss and PostgreSQL
# failover runs (3,000 jobs each on three brokers and a primary with a standby); `make test`
# runs a reduced form of each.
chaos: install
	CALMQ_CHAOS_FULL=1 $(BIN)/python -m pytest tests/chaos/test_fault_matrix.py --timeout 900
	CALMQ_CHAOS_FULL=1 $(BIN)/python -m pytest -rA tests/chaos/test_broker_loss.py \
	  tests/chaos/test_postgres_failover.py --timeout 1800
