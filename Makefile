# The two commands: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-unit lint typecheck bench clean browser promtool helm kustomize \
	manifests image lock pgbouncer fish typescript actionlint release-check

install: $(STAMP)

# Re-installs only when the project's metadata changed; quick otherwise. calmq-client first:
# calmq requires it, and it is built from clients/python, not fetched from an index.
$(STAMP): pyproject.toml clients/python/pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ./clients/python
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(STAMP)

demo: install
	$(BIN)/calmq demo

test: install browser promtool helm kustomize pgbouncer typescript fish examples
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
# fish for the fish completion test (tests/unit/test_cli.py), from Debian's package.
fish:
	@command -v fish >/dev/null \
	  || apt-get install -y --no-install-recommends fish \
	  || { apt-get update && apt-get install -y --no-install-recommends fish; } \
	  || echo "make fish: the fish package could not be installed; the fish completion test fails under CI"

pgbouncer:
	@test -x /usr/sbin/pgbouncer || command -v pgbouncer >/dev/null \
	  || apt-get install -y --no-install-recommends pgbouncer \
	  || { apt-get update && apt-get install -y --no-install-recommends pgbouncer; } \
	  || echo "make pgbouncer: the pgbouncer package could not be installed; the PgBouncer test will be skipped"

# The TypeScript client (clients/typescript): its devDependencies from the npm registry, as
# pinned by package-lock.json (installed again only when the lock changed), then the
# package, its node tests and its React example compiled (tsc -b: a no-op when nothing
# changed). tests/integration/test_typescript_client.py runs the node tests against the
# stack. Without npm they are skipped with the reason (and fail under CI=true).
typescript:
	@command -v npm >/dev/null || { echo "make typescript: no npm; the TypeScript client's tests will be skipped"; exit 0; }; \
	  cd clients/typescript && \
	  { test node_modules/.package-lock.json -nt package-lock.json || npm ci --no-audit --no-fund; } && \
	  npm run build \
	  || echo "make typescript: the build failed; tests/integration/test_typescript_client.py will show why"

# The Node.js consumer example (examples/consumers/node): its packages from the npm registry
# as pinned by its package-lock.json, installed again only when the lock changed (an offline
# re-run needs nothing). tests/integration/test_consumer_examples.py runs it against the
# stack (and installs the same way itself when this did not run). Without npm it is skipped
# with the reason (and fails under CI=true).
.PHONY: examples
examples:
	@command -v npm >/dev/null || { echo "make examples: no npm; the Node.js consumer example's test will be skipped"; exit 0; }; \
	  cd examples/consumers/node && \
	  { test node_modules/.package-lock.json -nt package-lock.json || npm ci --no-audit --no-fund; } \
	  || echo "make examples: npm ci failed; tests/integration/test_consumer_examples.py will show why"

test-unit: install
	$(BIN)/python -m pytest tests/unit

lint: install actionlint
	$(BIN)/ruff check calmq producers relay processors tests bench clients/python
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	@if test -x $(ACTIONLINT); then $(ACTIONLINT) .github/workflows/*.yml && echo "actionlint: the workflows pass"; \
	  elif test "$$CI" = true; then echo "make lint: actionlint is not built (make actionlint)"; exit 1; \
	  else echo "make lint: actionlint is not built; the workflows are not checked"; fi

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
	CALMQ_CHAOS_FULL=1 $(BIN)/python -m pytest -rA tests/chaos/test_cluster_faults.py --timeout 1800

# Helm and kustomize for the chart tests (tests/unit/test_chart.py), built once from their Go
# modules with the machine's Go toolchain and cached per user, like the Kafka jars. Where
# they cannot be built their tests are skipped with the reason (and fail under CI=true).
TOOLS := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/calmq/tools
HELM_VERSION := v4.3.2
KUSTOMIZE_VERSION := v5.8.1
HELM := $(TOOLS)/helm-$(HELM_VERSION)/helm
KUSTOMIZE := $(TOOLS)/kustomize-$(KUSTOMIZE_VERSION)/kustomize

ACTIONLINT_VERSION := v1.7.12
ACTIONLINT := $(TOOLS)/actionlint-$(ACTIONLINT_VERSION)/actionlint

helm: $(HELM)
$(HELM):
	@command -v go >/dev/null || { echo "make helm: no Go toolchain; the chart tests will be skipped"; exit 0; }; \
	  GOTOOLCHAIN=local GOBIN=$(dir $@) nice go install helm.sh/helm/v4/cmd/helm@$(HELM_VERSION) \
	  || echo "make helm: helm $(HELM_VERSION) could not be built; the chart tests will be skipped"

# actionlint checks .github/workflows in `make lint`, built like helm.
actionlint: $(ACTIONLINT)
$(ACTIONLINT):
	@command -v go >/dev/null || { echo "make actionlint: no Go toolchain; make lint will not check the workflows"; exit 0; }; \
	  GOTOOLCHAIN=local GOBIN=$(dir $@) nice go install github.com/rhysd/actionlint/cmd/actionlint@$(ACTIONLINT_VERSION) \
	  || echo "make actionlint: actionlint $(ACTIONLINT_VERSION) could not be built; make lint will not check the workflows"

# What the release workflow does short of pushing (.ci/release-check): sdists and wheels,
# the chart packaged and rendered, the wheels in a clean venv running `calmq --version` and
# `calmq dev up`/`down`. A few minutes; .ci/run runs it.
release-check: install helm
	HELM=$(HELM) PYTHON=$(PYTHON) .ci/release-check

kustomize: $(KUSTOMIZE)
$(KUSTOMIZE):
	@command -v go >/dev/null || { echo "make kustomize: no Go toolchain; the Kustomize test will be skipped"; exit 0; }; \
	  GOTOOLCHAIN=local GOBIN=$(dir $@) nice go install sigs.k8s.io/kustomize/kustomize/v5@$(KUSTOMIZE_VERSION) \
	  || echo "make kustomize: kustomize $(KUSTOMIZE_VERSION) could not be built; the Kustomize test will be skipped"

# Everything written from the one renderer (calmq/tooling/kubernetes.py): the packaged copies
# of the alert rules and the dashboard, the Helm chart, the Kustomize base and the KEDA
# subset. Run after changing the renderer, deploy/prometheus/alerts.yml or the dashboard;
# tests/unit/test_kubernetes.py and test_chart.py fail until you do.
manifests: install
	cp deploy/prometheus/alerts.yml calmq/tooling/monitoring/alerts.yml
	cp deploy/grafana/calmq-dashboard.json calmq/tooling/monitoring/calmq-dashboard.json
	env $$(env | grep -o '^CALMQ_[A-Z0-9_]*' | sed 's/^/-u /') sh -c '\
	  $(BIN)/calmq k8s chart && \
	  $(BIN)/calmq k8s render --settings deploy/kubernetes/settings.yaml -f deploy/kubernetes/values.yaml && \
	  $(BIN)/calmq k8s render --only workers --settings deploy/kubernetes/settings.yaml -o deploy/keda'

# The image (docs/how-to/deploy-kubernetes.md, "What a release contains"): needs a Docker engine.
VERSION = $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' calmq/__init__.py)
IMAGE ?= ghcr.io/calmq/calmq:$(VERSION)
image:
	@command -v docker >/dev/null || { echo "make image: no docker here; CI's release workflow builds the image"; exit 1; }
	docker build --pull -t $(IMAGE) .

# requirements.lock: the wheel's dependencies and the extras the image ships (otel: tracing,
# msk-iam: Amazon MSK's IAM auth), pinned, that the Dockerfile installs. Run after changing
# [project] dependencies in pyproject.toml (tests/integration/test_image.py checks it).
lock: install
	rm -rf build/lock-venv && $(PYTHON) -m venv build/lock-venv
	build/lock-venv/bin/pip install --quiet --upgrade pip
	build/lock-venv/bin/pip install --quiet ./clients/python '.[otel,msk-iam]'
	build/lock-venv/bin/pip freeze --exclude calmq --exclude calmq-client > build/lock-pins.txt
	# The wheels the image's pip picks (glibc 2.36: manylinux_2_36 down to 2014), per arch.
	rm -rf build/lock-wheels && for arch in x86_64 aarch64; do \
	  build/lock-venv/bin/pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
	    --implementation cp --abi cp311 --abi abi3 --abi none \
	    $$(for v in $$(seq 36 -1 17); do echo --platform manylinux_2_$${v}_$$arch; done) \
	    --platform manylinux2014_$$arch --platform any \
	    -r build/lock-pins.txt -d build/lock-wheels/$$arch || exit 1; done
	{ echo "# The wheel's dependencies with its otel and msk-iam extras, pinned with the sha256 of the"; \
	  echo "# wheel the image installs on amd64 and on arm64: \`make lock\` installed calmq into a clean venv of"; \
	  echo "# Python $$(build/lock-venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])') (the image's), froze it and hashed what pip downloads for both. The Dockerfile installs exactly these (--require-hashes)."; \
	} | build/lock-venv/bin/python .ci/lock_hashes.py build/lock-pins.txt build/lock-wheels/x86_64 build/lock-wheels/aarch64 > requirements.lock
