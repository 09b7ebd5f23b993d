"""verl's checkpoint-engine correctness flow with backend "hal" on GPUs or NPUs.

The hardware counterpart of test_flow.py, as verl's `test_correctness_on_gpu.py` /
`test_correctness_on_npu.py` run it: verl's own `create_trainer_worker_group` (no CPU
stand-ins: verl's FSDP engine runs there), verl's rollout group, one device per worker,
three `update_weights()` each checked by verl's `check_weights()`. The sync group joins
trainer rank 0 and the rollout workers over the device's collective library (NCCL, HCCL),
which refuses two ranks on one device: it needs 3 devices (2 trainer ranks, 1 or more
rollout workers). Selected by the `cuda` / `npu` markers, in an environment with verl and
that device's torch (docs/verl.md, "On GPUs and NPUs").
"""

from __future__ import annotations

import asyncio

import pytest

from hal.device import backend_class

pytestmark = [pytest.mark.verl, pytest.mark.ray, pytest.mark.multiprocess, pytest.mark.timeout(900)]

pytest.importorskip("verl", reason="needs verl 0.9.1 and this device's torch (docs/verl.md, 'On GPUs and NPUs')")

from tests.verl import flow  # noqa: E402

NUM_TRAINER = 2


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.cuda), pytest.param("npu", marks=pytest.mark.npu)])
def test_verl_flow_three_updates_on_the_device(device, tmp_path):
    cls = backend_class(device)
    reason = cls.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no usable {device} device here: {reason}")
    count = cls().device_count()
    if count < NUM_TRAINER + 1:
        pytest.skip(f"{count} {device} device(s): the flow needs {NUM_TRAINER + 1} (one per worker; NCCL/HCCL take one rank per device)")
    from hal.integrations import ray as hal_ray

    with pytest.MonkeyPatch.context() as patch:
        for key, value in flow.worker_env(device).items():
            patch.setenv(key, value)
        hal_ray.init_loopback(num_cpus=count)
        import ray

        try:
            model_path = flow.build_model(tmp_path / "model")
            started = asyncio.run(flow.start(model_path, num_rollout=count - NUM_TRAINER, device=device, failing=False))
            for step in (1, 2, 3):
                started.manager.update_weights(global_steps=step)
                started.rollouts.check_weights()  # verl's check: every weight received and allclose
        finally:
            ray.shutdown()
