"""verl's checkpoint-engine correctness flow, with backend "hal", on the CPU.

The same steps as verl 0.9.1's `tests/checkpoint_engine/test_correctness_on_gpu.py`,
with verl's own helpers from the wheel's `test_utils.py` (`TrainingWorkerTest`, FSDP
`TrainingWorker`s on Ray; `create_rollout_worker_group` with `CheckpointEngineWorkerTest`
and its `MockServerAdapter`; `MockReplica`) and verl's `CheckpointEngineManager`; what
differs is the configuration:

- backend "hal" (VERL_PLATFORM=hal, VERL_DEVICE=cpu for every worker) instead of "nccl";
- a tiny model saved locally in bfloat16 (no hub) instead of Qwen3-8B;
- Ray started on 127.0.0.1 only (`hal.integrations.ray.init_loopback`);
- `RayResourcePool(process_on_nodes=[...])`: one CPU node;
- the two stand-ins of tests/verl/standins.py for what verl cannot run on the CPU.

Beside verl's rollout group, a second one (`standins.rollout_worker_class()`: verl's
`CheckpointEngineWorker` and `MockServerAdapter` with a switch that kills the worker
mid-update) gets the same trainer group through a second `CheckpointEngineManager`: the
failure tests use it, and the trainer processes are started once for both.

Everything runs on the process that calls it; Ray must be running (loopback only).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

# Where verl-hal lives, for Ray workers that start in another directory.
REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def build_model(out_dir: Path) -> Path:
    """A two-layer Llama saved in bfloat16 with its tokenizer: verl's `MockServerAdapter`
    compares against `from_pretrained(..., torch_dtype=bfloat16)`, and verl's FSDP engine
    loads bf16 when forward-only (fp32 to train: the same values, widened exactly)."""
    from hal.tools.tiny_model import TinyModelSpec, build_model, build_tokenizer

    spec = TinyModelSpec(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    if not (out_dir / "config.json").exists():
        model = build_model(spec).to(torch.bfloat16)
        model.save_pretrained(out_dir, safe_serialization=True)
        build_tokenizer(spec.vocab_size).save_pretrained(out_dir)
    return out_dir


def worker_env(device: str = "cpu") -> dict[str, str]:
    """What the driver and every Ray worker of the flow need in their environment."""
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {
        "VERL_PLATFORM": "hal",
        "VERL_DEVICE": device,
        "PYTHONPATH": pythonpath,
    }


def trainer_worker_group(resource_pool: Any, model_config: Any, checkpoint_engine_config: Any) -> Any:
    """verl's `create_trainer_worker_group` (test_utils.py) with `TrainingWorkerOnHal` in
    place of `TrainingWorkerTest` (tests/verl/standins.py says why): an FSDP forward-only
    `TrainingWorker` per rank, over every rank of the pool."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from verl.workers.config import FSDPEngineConfig
    from verl.workers.engine_workers import TrainingWorkerConfig

    from tests.verl import standins

    standins.register_by_value()
    trainer_config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=model_config,
        engine_config=FSDPEngineConfig(forward_only=True, fsdp_size=resource_pool.world_size, strategy="fsdp"),
    )
    worker = RayClassWithInitArgs(
        cls=ray.remote(standins.TrainingWorkerOnHal), config=trainer_config, checkpoint_engine_config=checkpoint_engine_config
    )
    return RayWorkerGroup(resource_pool=resource_pool, ray_cls_with_init=worker, device_name="cpu")


@dataclass
class Flow:
    """The worker groups and managers of one run (for the tests to poke at)."""

    manager: Any
    """verl's manager: the trainer group and verl's own rollout group (`rollouts`)."""
    trainers: Any
    rollouts: Any
    failing_manager: Any
    """A second manager: the same trainer group and the rollout group that can die (`failing`); None without it."""
    failing: Any
    resource_pool: Any
    model_path: Path | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def actors(self) -> list[Any]:
        return [*self.trainers.workers, *self.rollouts.workers, *(self.failing.workers if self.failing else [])]

    def placement_groups(self) -> list[Any]:
        return list(self.resource_pool.pgs or [])


async def start(
    model_path: Path,
    *,
    num_trainer: int = 2,
    num_rollout: int = 2,
    bucket_megabytes: int = 2048,
    hal_settings: dict[str, Any] | None = None,
    device: str = "cpu",
    failing: bool = True,
) -> Flow:
    """Build verl's trainer group, verl's rollout group and (with `failing`) the failing
    one, and a `CheckpointEngineManager` for each rollout group (see the module doc).

    `device`: the VERL_DEVICE of the run (the caller sets it in the environment, with
    `worker_env`). On "cpu" the trainer group is `trainer_worker_group` (the stand-ins);
    on a device verl runs on, verl's own `create_trainer_worker_group`, one device per worker."""
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from verl.single_controller.ray.base import RayResourcePool, split_resource_pool
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

    from tests.verl import standins
    from tests.verl.shipped import test_utils

    verl_tests = test_utils()
    started = time.monotonic()
    checkpoint_engine_config = CheckpointEngineConfig(
        backend="hal",
        update_weights_bucket_megabytes=bucket_megabytes,
        engine_kwargs={"hal": dict(hal_settings or {})},
    )
    # verl's default attention is flash_attention_2 (verl/workers/config/model.py:185), which
    # has no CPU build: ask transformers for its own SDPA kernel instead (a setting of verl's).
    model_config = HFModelConfig(
        path=str(model_path), use_remove_padding=True, override_config={"attn_implementation": "sdpa"}
    )
    rollout_config = RolloutConfig(name="vllm", checkpoint_engine=checkpoint_engine_config)

    sizes = [num_trainer, num_rollout] + ([num_rollout] if failing else [])
    resource_pool = RayResourcePool(process_on_nodes=[sum(sizes)], max_colocate_count=3)
    trainer_pool, rollout_pool, *failing_pool = split_resource_pool(resource_pool, sizes)
    if device == "cpu":
        trainers = trainer_worker_group(trainer_pool, model_config, checkpoint_engine_config)
    else:
        trainers = verl_tests.create_trainer_worker_group(trainer_pool, model_config, checkpoint_engine_config)
    trainers.reset()
    rollouts, replicas = await verl_tests.create_rollout_worker_group(rollout_pool, model_config, rollout_config)
    manager = CheckpointEngineManager(config=checkpoint_engine_config, actor_wg=trainers, replicas=replicas)
    failing_group = failing_manager = None
    if failing:  # placed and wrapped as verl's helper does it
        failing_group = RayWorkerGroup(
            resource_pool=failing_pool[0],
            ray_cls_with_init=RayClassWithInitArgs(
                cls=ray.remote(standins.rollout_worker_class()), model_config=model_config, rollout_config=rollout_config
            ),
            device_name=device,
        )
        failing_replicas = [
            verl_tests.MockReplica(replica_rank=i, config=rollout_config, model_config=model_config)
            for i in range(failing_group.world_size)
        ]
        await asyncio.gather(*[r.init_hybrid(failing_group) for r in failing_replicas])
        failing_manager = CheckpointEngineManager(config=checkpoint_engine_config, actor_wg=trainers, replicas=failing_replicas)
    flow = Flow(
        manager=manager,
        trainers=trainers,
        rollouts=rollouts,
        failing_manager=failing_manager,
        failing=failing_group,
        resource_pool=resource_pool,
        model_path=model_path,
    )
    flow.timings["start_s"] = time.monotonic() - started
    return flow


@contextlib.contextmanager
def running(model_dir: Path, *, hal_settings: dict[str, Any], **start_kwargs: Any) -> Iterator[Flow]:
    """The started flow (`start`) on the Ray instance of the lane (`loopback_ray`, which
    must be running), with the model in `model_dir`; at the end every actor and placement
    group is checked gone."""
    import pytest

    from hal.integrations.ray import ActorScope

    with pytest.MonkeyPatch.context() as patch:
        for key, value in worker_env().items():
            patch.setenv(key, value)  # the driver's side of the flow reads them too
        started = asyncio.run(start(build_model(model_dir), hal_settings=hal_settings, **start_kwargs))
        try:
            yield started
        finally:
            scope = ActorScope(timeout_s=60)
            for actor in started.actors():
                scope.add(actor)
            for pg in started.placement_groups():
                scope.add_placement_group(pg)
            scope.close()  # raises naming any actor, process or placement group left behind


@contextlib.contextmanager
def loopback_ray(num_cpus: int = 6) -> Iterator[None]:
    """Ray on loopback, its processes started with the workers' environment (`worker_env`),
    which this process keeps only while Ray starts; stopped at the end. Once for every flow
    of the lane (tests/verl/conftest.py): Ray's start and stop take ~11 s here."""
    import pytest

    from hal.integrations import ray as hal_ray

    with pytest.MonkeyPatch.context() as patch:
        for key, value in worker_env().items():
            patch.setenv(key, value)  # Ray's workers inherit the environment Ray starts in
        hal_ray.init_loopback(num_cpus=num_cpus)
    import ray

    try:
        yield
    finally:
        ray.shutdown()


def states(group: Any) -> list[dict[str, Any]]:
    """Every worker's `HalCheckpointEngine.state()` in `group`, in rank order."""
    import ray

    return ray.get(group.execute_checkpoint_engine(["state"] * group.world_size))


def failed_everywhere(*groups: Any, limit_s: float, kind: str = "") -> tuple[list[dict[str, Any]], float]:
    """The workers' states once every one reports a failed update (whose error starts with
    `kind`: a failure before this one stays in `last_error` until an update succeeds), or
    after `limit_s`; and the seconds that took. verl's manager raises with the first failed
    call, while the others may still be finishing theirs."""
    began = time.monotonic()
    while True:
        found = [s for group in groups for s in states(group)]
        if all(s["last_error"] and s["last_error"].startswith(kind) for s in found) or time.monotonic() - began > limit_s:
            return found, time.monotonic() - began
        time.sleep(0.2)
