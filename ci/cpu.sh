#!/usr/bin/env bash
# CPU lane: exactly the README's test command (cpu and sim backends; cuda/npu tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
make test
