#!/usr/bin/env bash
# Everything a lent CUDA machine should run, in one call, most valuable first: the cuda
# lane, then the device benchmarks, then the 16-core CPU benchmarks. Each step has its own
# time limit, so a slow or hung step costs its limit and no more; the log and every JSON
# record land in OUT_DIR as they are made (docs/ci.md, "A lent machine in one call").
#   bash ci/hardware/lent-machine.sh [OUT_DIR] [STEPS]
#   STEPS: comma-separated subset of install,lane,kernels,d2d,d2d-moe,graphs,profile,moe-cpu,mn
#          (default: all, in that order)
#   HAL_PYTHON: the interpreter with a CUDA build of torch (default python3, as on the
#               lent machines, where torch is installed system-wide and there is no network)
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-${OUT:-/tmp/hal-lent}}"
steps=",${2:-install,lane,kernels,d2d,d2d-moe,graphs,profile,moe-cpu,mn},"
PY="${HAL_PYTHON:-python3}"
# Like the cuda lane: on a machine without a usable GPU, say why and stop, installing nothing.
reason="$("$PY" -c "
from hal.device import backend_class
print(backend_class('cuda').unavailable_reason() or '')
" 2>&1 | tail -n 1)" || true
if [[ -n "$reason" ]]; then
    echo "ci/hardware/lent-machine.sh: skipped: no usable cuda device here ($PY): $reason"
    exit 0
fi
mkdir -p "$out"
log="$out/lent-machine.log"
failed=()

# step NAME SECONDS CMD...: runs CMD under `timeout`, its output into the log and on screen.
step() {
    local name="$1" limit="$2"
    shift 2
    [[ "$steps" == *",$name,"* ]] || return 0
    echo "== $name: start $(date -u +%H:%M:%S), limit ${limit}s: $*" | tee -a "$log"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$log"
    [[ $rc -eq 0 ]] || failed+=("$name(rc=$rc)")
}

{
    echo "== machine: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    nproc
    "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
} 2>&1 | tee -a "$log"

step install 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
step install 30 env VERL_DEVICE=cuda "$PY" -m hal info
step lane 200 env HAL_PYTHON="$PY" PYTEST_ADDOPTS="-n 8" bash ci/cuda.sh
step kernels 60 env VERL_DEVICE=cuda "$PY" -m hal bench --delta-kernels --json "$out/kernels-cuda.json"
step d2d 90 env VERL_DEVICE=cuda "$PY" -m hal bench --device-transfer --json "$out/d2d.json"
step d2d-moe 120 env VERL_DEVICE=cuda "$PY" -m hal bench --device-transfer --preset moe-16k --json "$out/d2d-moe.json"
# Experimental: prepared copies recorded as CUDA graphs (VERL_HAL_COPY_GRAPHS=1, docs/design.md,
# "Copies recorded as a graph"): the conformance copies on the GPU (bit for bit, replayed over
# new bytes), then moe-16k's device transfer (every receiver's bytes checked), against d2d-moe.
step graphs 150 env VERL_DEVICE=cuda VERL_HAL_COPY_GRAPHS=1 bash -c "\"$PY\" -m pytest -q -p no:cacheprovider tests/backends/test_conformance.py -k 'copies or checksums' && \"$PY\" -m hal bench --device-transfer --preset moe-16k --device-methods floor_ipc,hal_ipc,hal_ipc_verified --json \"$out/d2d-moe-graphs.json\""
# Where a device sync's host time goes (16,384 tensors; and the verified sync's checksums):
# 8 files at most come back from a lent machine's call, so this is one record.
step profile 120 env VERL_DEVICE=cuda "$PY" -m hal bench --device-transfer --preset split-16384-1g --device-methods floor_ipc,hal_ipc,hal_ipc_verified --repeats 3 --profile --json "$out/d2d-profile.json"
# Issue 30's CPU targets with a core per process (on 2 cores the two processes and gloo contend).
step moe-cpu 80 "$PY" -m hal bench --preset moe-16k --methods floor,floor_with_copy,floor_pipelined,hal_bucketed,hal_shm --json "$out/moe-cpu.json"
step mn 120 "$PY" -m hal bench --senders 4 --receivers 4 --preset qwen2.5-0.5b --json "$out/mn-4x4.json"

if [[ ${#failed[@]} -gt 0 ]]; then
    echo "== failed: ${failed[*]}" | tee -a "$log"
    exit 1
fi
echo "== all steps passed" | tee -a "$log"
