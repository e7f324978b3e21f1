# wrenmq build system. Every target works on a fresh clone: it creates .venv,
# installs what it needs (Python packages, Debian packages, mqload) and runs.
#
#   make run   [ARGS="--port 1884"]        start the broker (127.0.0.1:1883 by default)
#   make test  [PYTEST_ARGS="-k foo -x"]   install test deps, run the suite (2 workers; TEST_WORKERS=0: one)
#   make bench [ARGS="--repeat 5"]         benchmark suite vs Mosquitto (~20 min)
#   make bench-quick                       one pass of the main comparison (< 2 min)
#   make bench-cluster                     one node vs two nodes; QoS 1 replicated vs not (~5 min)
#   make bench-bridge                      wrenmq's bridge vs Mosquitto's, to a local Mosquitto (~3 min)
#   make soak  [ARGS="--minutes 10"]       client churn: does memory settle? (vs Mosquitto, ~13 min)
#   make fuzz  [EXAMPLES=20000]            the fuzz targets, long
#   make screenshots                       docs/dashboard*.png from a broker under load (~1.5 min) 
#   make sim   [SEEDS=5000] [SEED=n]       the replication simulator: many seeds, or replay one
#   make chaos [ROUNDS=3] [SEED=n]         faults on a 3-node cluster under load: a table per fault
#                                          (ARGS="--replicas 3": replicated, plus a node lost for good)
#   make demo  [ARGS="--devices 50"]       broker + simulated fleet + Spark jobs, for a minute
#   make clean                             remove .venv, .bench and build caches (not data)

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check

ARGS        ?=
PYTEST_ARGS ?=
# pytest-xdist workers for make test (0: one process); files stay whole on a worker (conftest.py)
TEST_WORKERS ?= 2

# Debian packages the tests need, as CMD:PKG (the package is installed only if
# CMD is missing). Add e.g. mosquitto:mosquitto, etcd:etcd-server,
# java:openjdk-17-jre-headless here as the suite grows.
TEST_DEBIAN_PKGS := \
	mosquitto_sub:mosquitto-clients \
	mosquitto:mosquitto \
	etcd:etcd-server \
	etcdctl:etcd-client \
	java:openjdk-17-jre-headless \
	chromium:chromium \
	chromedriver:chromium-driver \
	tmux:tmux \
	haproxy:haproxy \
	systemd-analyze:systemd

# npm packages the tests need, installed into $(NPM_PREFIX); their binaries are
# put on PATH for pytest (mqtt = MQTT.js, for the WebSocket/TCP interop tests).
TEST_NPM_PKGS := mqtt@5
NPM_PREFIX    := $(VENV)/npm

# Debian packages the benchmark needs.
BENCH_DEBIAN_PKGS := \
	mosquitto:mosquitto

ENSURE_DEB := bash scripts/ensure-debian-packages.sh

# What the install needs to compile the codec and the log's hot paths (setup.py): a C
# compiler and Python's headers. Without them the install still works (Python source),
# so `make run` only tries; `make test` requires them (a test checks the build).
PY_INCLUDE := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['include'])" 2>/dev/null)
BUILD_DEBIAN_PKGS := gcc:gcc $(PY_INCLUDE)/Python.h:python3-dev
COMPILED_SOURCES := setup.py src/wrenmq/mqtt/codec.py src/wrenmq/store/_encode.py \
                    src/wrenmq/store/_encode.pxd src/wrenmq/store/_epoch.py src/wrenmq/store/_epoch.pxd

.PHONY: help run test test-deps debian-test-deps npm-test-deps bench bench-quick bench-cluster bench-bridge bench-deps soak demo fuzz screenshots sim chaos clean

help:
	@sed -n '4,16p' Makefile | sed 's/^# \{0,1\}//'

# --- virtualenv --------------------------------------------------------------

$(PY):
	$(PYTHON) -m venv $(VENV)

# Stamp files live in .venv.
# Re-install also when the compiled source changed, so the extension is never stale.
$(VENV)/.stamp-install: pyproject.toml $(COMPILED_SOURCES) | $(PY)
	@$(ENSURE_DEB) $(BUILD_DEBIAN_PKGS) || echo "note: no C compiler; the log encoder stays pure Python"
	$(PIP) install -e .
	touch $@

$(VENV)/.stamp-test: pyproject.toml $(COMPILED_SOURCES) | $(PY)
	@$(ENSURE_DEB) $(BUILD_DEBIAN_PKGS)
	$(PIP) install -e '.[test]'
	touch $@ $(VENV)/.stamp-install

# --- run ---------------------------------------------------------------------

run: $(VENV)/.stamp-install
	exec $(VENV)/bin/wrenmq serve $(ARGS)

# --- test --------------------------------------------------------------------

debian-test-deps:
	@$(ENSURE_DEB) $(TEST_DEBIAN_PKGS)

npm-test-deps: | $(PY)
ifneq ($(strip $(TEST_NPM_PKGS)),)
	@if [ "$$(cat $(NPM_PREFIX)/.stamp 2>/dev/null)" != "$(strip $(TEST_NPM_PKGS))" ]; then \
		$(ENSURE_DEB) npm:npm && \
		npm install --prefix $(NPM_PREFIX) --no-audit --no-fund $(TEST_NPM_PKGS) && \
		echo "$(strip $(TEST_NPM_PKGS))" > $(NPM_PREFIX)/.stamp; \
	fi
endif

test-deps: $(VENV)/.stamp-test debian-test-deps npm-test-deps

test: test-deps
	PATH="$(abspath $(NPM_PREFIX))/node_modules/.bin:$$PATH" WRENMQ_TEST_NO_SKIP=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not chaos" $(PYTEST_ARGS)

# --- bench -------------------------------------------------------------------

bench-deps: $(VENV)/.stamp-install
	@$(ENSURE_DEB) $(BENCH_DEBIAN_PKGS)
	bash scripts/build-mqload.sh

# The whole suite: vs Mosquitto (log off), log on, durability, hostile load.
bench: bench-deps
	$(PY) -m wrenmq.bench.suite $(ARGS)

bench-quick: bench-deps
	$(PY) -m wrenmq.bench.suite --quick $(ARGS)

# Crossing nodes: the same QoS 0 load through one node and from node b to node a. Then
# replication: QoS 1 1 -> 1 on one node, a 3-node cluster with replicas 1, and with replicas 3.
bench-cluster: bench-deps
	@$(ENSURE_DEB) etcd:etcd-server
	$(PIP) install -q -e '.[cluster]'
	$(PY) -m wrenmq.bench.cluster $(ARGS)
	$(PY) -m wrenmq.bench.replicated $(REPLICATED_ARGS)

# QoS 1 through a bridge to a local Mosquitto: wrenmq's (fsync always, interval) and Mosquitto's own.
bench-bridge: bench-deps
	$(PY) -m wrenmq.bench.bridge $(ARGS)

# Minutes of connects, subscriptions, publishes and drops: wrenmq's RSS, then Mosquitto's.
soak: bench-deps
	$(PY) -m wrenmq.bench.soak $(ARGS)

# --- fuzz --------------------------------------------------------------------

# The fuzz targets of the test suite with many more examples (make test runs a few hundred),
# without the suite's 120 s per-test timeout: EXAMPLES=5000 sends about 6,700 hostile
# conversations to a live broker and takes about 23 minutes here (600: about 2).
fuzz: test-deps
	WRENMQ_FUZZ_EXAMPLES=$${EXAMPLES:-5000} $(PY) -m pytest -q -s --timeout=0 tests/test_fuzz.py $(PYTEST_ARGS)

# --- screenshots ---------------------------------------------------------------

# The dashboard's pictures in docs/: the dashboard test in headless Chromium, with a
# minute of `wrenmq bench` load so the charts have something to show.
screenshots: test-deps
	WRENMQ_SCREENSHOTS=docs WRENMQ_TEST_NO_SKIP=1 $(PY) -m pytest -q tests/test_admin_dashboard.py -k screenshot

# --- sim ---------------------------------------------------------------------

# The deterministic replication simulator (tests/replication_sim.py) over many more seeds
# than make test runs (300), without the suite's per-test timeout: SEEDS=5000 takes about
# 5 minutes here. A failing seed prints itself, its faults and its last events; SEED=N
# replays that seed alone and prints every event of it.
sim: $(VENV)/.stamp-install
	@if [ -n "$(SEED)" ]; then $(PY) tests/replication_sim.py --seed $(SEED) --trace; \
	else $(PY) tests/replication_sim.py --seeds $${SEEDS:-5000} $(ARGS); fi

# --- chaos -------------------------------------------------------------------

# Real faults (kill -9, SIGSTOP past the lease, a node cut from the others or from etcd, an
# etcd member killed) on 3 nodes and a 3-member etcd, in an order drawn from SEED, each under
# QoS 1/2 load with persistent subscribers on every node: a table per fault of what was
# acknowledged, lost, given twice at QoS 2, failovers and the longest unavailability.
# About a minute and a half a round here; ARGS="--replicas 3 --min-insync 2" once replication exists
# (adds the loss of a node for good), ARGS="--faults kill9,pause" for a subset.
chaos: test-deps
	$(PY) tests/chaos.py --rounds $${ROUNDS:-3} $(if $(SEED),--seed $(SEED)) $(ARGS)
	$(PY) -m pytest -m chaos tests/ || [ $$? -eq 5 ]  # (5: no test is marked chaos)

# --- demo --------------------------------------------------------------------

$(VENV)/.stamp-pipeline: pyproject.toml | $(PY)
	$(PIP) install -e '.[pipeline]'
	touch $@ $(VENV)/.stamp-install

demo: $(VENV)/.stamp-pipeline
	@$(ENSURE_DEB) java:openjdk-17-jre-headless
	$(VENV)/bin/wrenmq demo $(ARGS)

# --- clean -------------------------------------------------------------------

clean:
	rm -rf $(VENV) .bench build dist .pytest_cache .hypothesis src/*.egg-info src/wrenmq/store/_encode.c src/wrenmq/store/_epoch.c src/wrenmq/mqtt/codec.c
	find src tests -name __pycache__ -type d -prune -exec rm -rf {} + 2>/dev/null || true
	find src -name "*.so" -delete
