# meshmq developer commands. Every target sets up what it needs itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: serve test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

## Start a broker with embedded defaults: MQTT on 0.0.0.0:1883, data under ./data.
serve: $(VENV)/.installed
	$(BIN)/meshmq serve

## Run the whole test suite (lint, then pytest on 2 workers).
test: $(VENV)/.installed
	@command -v mosquitto_pub >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto-clients) >/dev/null 2>&1; } || \
	  echo "note: mosquitto-clients not installed; interop tests will be skipped"
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -n 2 -q

lint: $(VENV)/.installed
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
