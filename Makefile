# swiftserve: `make serve` starts both applications on 127.0.0.1:8000 (DLRM gRPC: port 9000), `make test` runs
# lint + tests, `make loadtest` drives a running server with Locust (loadtests/README.md).
# Both set up .venv on first use (torch CPU wheel first, then the project, editable, with dev extras, at the versions
# constraints.txt pins). `make constraints` refreshes those pins; `make lower-bounds` runs the unit tests with every
# direct dependency at the lowest version pyproject.toml allows.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
SERVE_CONFIG ?= deploy/serve_config.yaml
TORCH_PIN := torch==2.13.0
LOWEST_VENV ?= out/lowest-venv
# uv resolves for every platform, from Python 3.10 (the CUDA image's) up; torch stays at TORCH_PIN, installed first
COMPILE = $(BIN)/uv pip compile pyproject.toml --no-python-downloads --constraint $(VENV)/torch-pin.txt \
	--no-emit-package torch
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

.PHONY: install serve test lint check-config proto loadtest constraints lower-bounds clean

install: $(INSTALLED)

$(INSTALLED): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	echo "$(TORCH_PIN)" > $(VENV)/torch-pin.txt
	touch $(INSTALLED)

# Needs only uv (the version pyproject.toml pins), not the install, which refuses a pyproject.toml and a
# constraints.txt that disagree: what this target is for.
constraints:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -x $(BIN)/uv || $(BIN)/python -m pip install --quiet "$$(grep -o 'uv==[0-9.]*' pyproject.toml)"
	echo "$(TORCH_PIN)" > $(VENV)/torch-pin.txt
	$(COMPILE) --all-extras --universal --python-version 3.10 --custom-compile-command "make constraints" -o constraints.txt

lower-bounds: install
	rm -rf $(LOWEST_VENV) && $(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LOWEST_VENV)/bin/python -m pip install --quiet $(TORCH_PIN)
	$(COMPILE) --extra dev --resolution lowest-direct --python $(LOWEST_VENV)/bin/python -o $(LOWEST_VENV)/lowest.txt
	$(LOWEST_VENV)/bin/python -m pip install --quiet -r $(LOWEST_VENV)/lowest.txt
	$(LOWEST_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(LOWEST_VENV)/bin/pytest tests/unit -n $(TEST_WORKERS) --timeout $(UNIT_TIMEOUT_S) -p no:cacheprovider

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
