#!/usr/bin/env bash
# Shared body of the hardware lanes: ci/cuda.sh and ci/npu.sh call it with the backend name.
#   HAL_PYTHON   interpreter whose environment has torch for this hardware (and torch_npu
#                for npu) plus `pip install -e ".[test]"`; default .venv/bin/python, made
#                here with pip's default torch when missing.
# No usable device: print why and exit 0, so the lane is green on machines without one.
set -euo pipefail
lane="$1"
cd "$(dirname "$0")/.."

PY="${HAL_PYTHON:-.venv/bin/python}"
if [[ -z "${HAL_PYTHON:-}" && ! -x "$PY" ]]; then
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[test]"
fi

reason="$("$PY" -c "
from hal.device import backend_class
print(backend_class('$lane').unavailable_reason() or '')
")"
if [[ -n "$reason" ]]; then
    echo "ci/$lane.sh: skipped: no usable $lane device here: $reason"
    exit 0
fi

export VERL_DEVICE="$lane"
echo "ci/$lane.sh: tests marked '$lane' (VERL_DEVICE=$lane)"
# Exit code 5 means no test carried the marker: not a failure of the lane.
"$PY" -m pytest -q -p no:cacheprovider -m "$lane" || [[ $? -eq 5 ]]
echo "ci/$lane.sh: conformance suite (VERL_DEVICE=$lane)"
"$PY" -m pytest -q -p no:cacheprovider tests/backends/test_conformance.py
