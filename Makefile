# meshmq developer commands. Every target sets up what it needs itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: serve test lint clean

# The virtualenv, made once.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# meshmq and its pinned dependencies; redone only when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,spark]'
	touch $@

## Start a broker with embedded defaults: MQTT on 0.0.0.0:1883, data under ./data.
serve: $(VENV)/.installed
	$(BIN)/meshmq serve

## Run the whole test suite: lint, then pytest on 2 workers. The mosquitto clients are needed
## by the interop tests (which skip without them); installing them is best effort.
test: $(VENV)/.installed
	@command -v mosquitto_pub >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing mosquitto-clients"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends mosquitto-clients; } >/dev/null 2>&1 \
	    || echo "note: could not install mosquitto-clients; interop tests will be skipped"; \
	  else \
	    echo "note: mosquitto-clients not installed; interop tests will be skipped"; \
	  fi; \
	}
	$(BIN)/ruff check src tests bench
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q

## Lint only.
lint: $(VENV)/.installed
	$(BIN)/ruff check src tests bench

## Remove the virtualenv and build/test caches (not ./data).
clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis .ruff_cache
