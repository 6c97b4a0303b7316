# One command each: `make run` (the console on embedded defaults) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-ci lint bench soak venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# `make run PORT=8001` serves on another port; `MQTT_PORT=1884` moves the embedded broker.
PORT ?= 8000
MQTT_PORT ?=

run: $(STAMP)
	$(if $(MQTT_PORT),REACH_EMBEDDED_MQTT_PORT=$(MQTT_PORT) )$(BIN)/python manage.py runconsole --port $(PORT) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python manage.py makemigrations --check --dry-run

bench: $(STAMP)
	$(BIN)/python bench/run.py

# One hour in production shape with a fault every ten minutes (bench/soak.py, docs/soak.md).
soak: $(STAMP)
	$(BIN)/python bench/soak.py --minutes 60

clean:
	rm -rf $(VENV) .run
