# swiftserve: `make serve` starts both applications on 127.0.0.1:8000 (DLRM gRPC: port 9000), `make test` runs
# lint + tests, `make loadtest` drives a running server with Locust (loadtests/README.md).
# Both set up .venv on first use (torch CPU wheel first, then the project, editable, with dev extras).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
SERVE_CONFIG ?= deploy/serve_config.yaml
# `make test`: unit tests in this many processes (pytest-xdist; none starts Ray), then the integration tests in one
# (they share one Ray cluster), then the benchmark scripts' smoke runs (one at a time). Each suite writes a JUnit
# file and its 50 slowest tests; a unit test may take UNIT_TIMEOUT_S (the others pyproject's 600 s), and an
# integration test's limit leaves out its fixtures (the session's cluster and deploy have timeouts of their own).
TEST_WORKERS ?= 2
UNIT_TIMEOUT_S ?= 300
CI_OUT ?= out/ci
PYTEST_REPORT = --durations=50 --junitxml=$(CI_OUT)

# `make loadtest`: headless Locust against $(HOST); reports under $(LOADTEST_OUT); extra options in LOADTEST_ARGS
HOST ?= http://127.0.0.1:8000
LOADTEST_USERS ?= 4
LOADTEST_SPAWN_RATE ?= 2
LOADTEST_TIME ?= 60s
LOADTEST_MAX_FAILURE_RATIO ?= 0.01
LOADTEST_MAX_P95_MS ?= 5000
LOADTEST_OUT ?= out/loadtest
LOADTEST_ARGS ?=

export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: install serve test lint check-config proto loadtest clean

install: $(INSTALLED)

$(INSTALLED): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(INSTALLED)

serve: install
	$(BIN)/serve run $(SERVE_CONFIG)

test: install
	$(BIN)/ruff check .
	rm -rf $(CI_OUT) && mkdir -p $(CI_OUT)
	$(BIN)/pytest tests/unit -n $(TEST_WORKERS) --timeout $(UNIT_TIMEOUT_S) $(PYTEST_REPORT)/unit.xml
	$(BIN)/pytest tests/integration -o timeout_func_only=true $(PYTEST_REPORT)/integration.xml
	$(BIN)/pytest tests/smoke $(PYTEST_REPORT)/smoke.xml

lint: install
	$(BIN)/ruff check .

check-config: install
	$(BIN)/autoconfig check $(SERVE_CONFIG)

proto: install
	$(BIN)/python scripts/gen_proto.py

loadtest: install
	mkdir -p $(LOADTEST_OUT)
	$(BIN)/locust -f loadtests/locustfile.py --headless --host $(HOST) \
		--users $(LOADTEST_USERS) --spawn-rate $(LOADTEST_SPAWN_RATE) --run-time $(LOADTEST_TIME) \
		--max-failure-ratio $(LOADTEST_MAX_FAILURE_RATIO) --max-p95-ms $(LOADTEST_MAX_P95_MS) \
		--csv $(LOADTEST_OUT)/report --html $(LOADTEST_OUT)/report.html $(LOADTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
