# swiftserve: `make serve` starts both applications on 127.0.0.1:8000, `make test` runs lint + tests.
# Both set up .venv on first use (torch CPU wheel first, then the project, editable, with dev extras).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
SERVE_CONFIG ?= deploy/serve_config.yaml

export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: install serve test lint check-config proto clean

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
	$(BIN)/pytest

lint: install
	$(BIN)/ruff check .

check-config: install
	$(BIN)/autoconfig check $(SERVE_CONFIG)

proto: install
	$(BIN)/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
