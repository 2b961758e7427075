# meshmq developer commands. Every target sets up what it needs itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check

# One stamp per set of extras, so that each target installs only what it needs and switching
# between targets, in any order, installs nothing twice. A stamp is redone when pyproject.toml
# changes. A larger set also stamps the sets it contains.
BROKER := $(VENV)/.installed-broker
SPARK := $(VENV)/.installed-spark
TEST := $(VENV)/.installed-test

.PHONY: serve demo test lint clean

# The modules that setup.py compiles with mypyc (meshmq/compiled.py's HOT_PATH): the install
# builds them in place, so a change to one must install again, or the tests would run the old
# compiled code.
HOT_PATH := $(shell sed -n 's|^    "\(meshmq\.[a-z_.]*\)",$$|\1|p' src/meshmq/compiled.py 2>/dev/null)
COMPILED := $(wildcard $(patsubst %,src/%.py,$(subst .,/,$(HOT_PATH))))
BUILD_INPUTS := pyproject.toml $(wildcard setup.py src/meshmq/compiled.py) $(COMPILED)

# The virtualenv, made once.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The broker and the pub/sub clients: meshmq and its pinned dependencies, no extras.
$(BROKER): $(BUILD_INPUTS) | $(BIN)/python
	$(PIP) -e .
	touch $@

# The data pipeline (meshmq pipeline ...): pyspark, pyarrow, numpy, matplotlib.
$(SPARK): $(BUILD_INPUTS) | $(BIN)/python
	$(PIP) -e '.[spark]'
	touch $@ $(BROKER)

# The test suite, which includes the pipeline's tests: the test tools and the spark extra.
$(TEST): $(BUILD_INPUTS) | $(BIN)/python
	$(PIP) -e '.[test,spark]'
	touch $@ $(SPARK) $(BROKER)

## Start a broker with embedded defaults: MQTT on 127.0.0.1:1883 (anonymous, so loopback only;
## docs/configuration.md says how to open it), data under ./data.
serve: $(BROKER)
	$(BIN)/meshmq serve

## Run the pipeline demo (needs Java 17): a broker, simulated devices, the Spark jobs, a report.
demo: $(SPARK)
	$(BIN)/meshmq pipeline demo

## Run the whole test suite: lint, type check, then pytest on 2 workers. The mosquitto clients are needed
## by the interop tests, Node.js with npm (and MQTT.js, installed by tests/mqttjs.py) by the MQTT.js
## tests, Chromium and its driver by the dashboard's browser tests (each skips without them,
## saying why); installing them is best effort.
test: $(TEST)
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
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium chromium-driver"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends chromium chromium-driver; } \
	      >/dev/null 2>&1 \
	    || echo "note: could not install chromium; dashboard browser tests will be skipped"; \
	  else \
	    echo "note: chromium not installed; dashboard browser tests will be skipped"; \
	  fi; \
	}
	@{ command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; } || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing nodejs npm"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends nodejs npm; } >/dev/null 2>&1 \
	    || echo "note: could not install nodejs and npm; MQTT.js tests will be skipped"; \
	  else \
	    echo "note: node and npm not installed; MQTT.js tests will be skipped"; \
	  fi; \
	}; { command -v npm >/dev/null 2>&1 && $(BIN)/python tests/mqttjs.py; } || true
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy
	@# bytecode for every process the tests start (brokers, nodes, the CLI), even where
	@# PYTHONDONTWRITEBYTECODE is set: each would otherwise compile the sources again (0.5 s)
	@$(BIN)/python -m compileall -q src tests >/dev/null
	@$(BIN)/meshmq --version
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q
	@# The compiled modules' tests again with those modules as plain Python (an install
	@# without a C compiler, or with MESHMQ_PURE_PYTHON=1): a copy of src/ without the .so files
	@rm -rf build/pure && mkdir -p build/pure
	@(cd src && tar --exclude='*.so' --exclude=__pycache__ -cf - meshmq) | tar -xf - -C build/pure
	@$(BIN)/python -m compileall -q build/pure >/dev/null
	@PYTHONPATH=build/pure $(BIN)/python -m meshmq --version
	PYTHONPATH=build/pure $(BIN)/python -m pytest -n 2 --dist loadgroup -q \
	  tests/mqtt tests/log tests/broker/test_persistence_turns.py tests/broker/test_durability.py \
	  tests/broker/test_accept.py tests/broker/test_connect_sessions.py \
	  tests/broker/test_deadlines.py tests/broker/test_streams.py tests/security/test_admission.py

## Lint and type check only (in the test environment, where ruff and mypy are).
lint: $(TEST)
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy

## Remove the virtualenv and build/test caches (not ./data).
clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis .ruff_cache .mypy_cache
