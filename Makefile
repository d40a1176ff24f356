# AgentGrove — two commands on a fresh clone: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The suite runs in two pytest workers (pytest-xdist): most tests wait on their own stack, so
# two share two cores well. `make test PYTEST_ARGS=` runs it in one process.
PYTEST_ARGS ?= -n 2

.PHONY: run test lint schemas check-schemas asyncapi check-asyncapi install clean up bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) ## create the virtual environment and install everything

run: $(STAMP) ## start the local stack, run the demonstration tree, stop
	$(BIN)/grove demo

up: $(STAMP) ## start the local stack in the foreground (Ctrl-C stops it)
	$(BIN)/grove up

test: $(STAMP) ## lint, check generated files, run the whole suite
	$(MAKE) lint
	$(MAKE) check-schemas
	$(MAKE) check-asyncapi
	$(BIN)/pytest $(PYTEST_ARGS)

lint: $(STAMP) ## ruff and mypy --strict
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

schemas: $(STAMP) ## write docs/schemas/<kind>.json
	$(BIN)/python -m grove_core.schemas docs/schemas

check-schemas: $(STAMP) ## fail when docs/schemas is stale
	$(BIN)/python -m grove_core.schemas docs/schemas --check

bench: $(STAMP) ## measure the control plane against raw NATS (writes bench/results.json)
	$(BIN)/python -m bench

SERVICES := governor spawner router artifacts

asyncapi: $(STAMP) ## write docs/asyncapi/<service>.json from the services' contracts
	$(BIN)/python -m grove_core.asyncapi docs/asyncapi $(SERVICES)

check-asyncapi: $(STAMP) ## fail when docs/asyncapi is stale
	$(BIN)/python -m grove_core.asyncapi docs/asyncapi $(SERVICES) --check

clean:
	rm -rf $(VENV) .grove .pytest_cache .mypy_cache .ruff_cache

.PHONY: chaos
chaos: $(STAMP) ## kill services and nats-server under a load of 5,000 agents; check every promise
	$(BIN)/python -m chaos $(CHAOS_ARGS)

.PHONY: compose-up validate-deploy
compose-up: ## build the image and start the Compose stack (needs a Docker engine)
	docker compose up -d --build

validate-deploy: $(STAMP) ## validate Compose, Kubernetes and NATS files offline
	bash scripts/validate-deploy.sh
