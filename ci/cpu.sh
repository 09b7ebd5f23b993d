#!/usr/bin/env bash
# CPU lane: the main suite of `make test` (cpu and sim backends; cuda/npu tests skip;
# the verl lane, ci/verl.sh, runs on its own).
set -euo pipefail
cd "$(dirname "$0")/.."
make test-cpu
