"""The smallest stand-ins for the pieces of verl 0.9.1 that cannot run on the CPU.

Each replaces one call, names the verl file and line that stops it, and leaves everything
else to verl's classes. docs/verl.md lists them.

1. verl/utils/distributed.py:89 (`initialize_global_process_group_ray`, called by
   `TrainingWorker.__init__` at verl/workers/engine_workers.py:89) builds the backend
   string `f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"`, which on the CPU is
   `"cpu:gloo,cpu:gloo"`; torch refuses a device type named twice ("Duplicate device type
   cpu", torch/distributed/distributed_c10d.py, `BackendConfig`). The stand-in trainer
   worker calls the same verl function first, with the backend string hal gives for the
   device (`Backend.dist_backend_string()`: "gloo" on the CPU, "cuda:nccl,cpu:gloo" on
   CUDA) and a timeout (`TRAINER_GROUP_TIMEOUT_S`; verl passes None: torch's default of
   30 minutes), so verl's own call finds the group initialised and does nothing.

2. verl's FSDP training engine places every tensor on `get_device_id()`, an int, which
   torch reads as an accelerator index ("Cannot access accelerator device when none is
   available"): first at verl/utils/fsdp_utils.py:509 (`model.to_empty(device=
   get_device_id())`, from `FSDPEngine._build_fsdp_module`), then in
   `get_per_tensor_param` (verl/workers/engine/fsdp/transformer_impl.py:1028-1032,
   `param.to(get_device_id())`); before that, FSDP1 (`strategy="fsdp"`) passes the same
   int as `device_id` (transformer_impl.py:441), and the engine class is registered for
   devices "cuda" and "npu" only (transformer_impl.py:1143), so verl finds none for "cpu"
   (verl/workers/engine/base.py:426). The stand-in, `CpuFSDP2Engine`, is registered
   through verl's own `EngineRegistry` for device "cpu" (backends "fsdp" and "fsdp2"): it
   loads the checkpoint as verl's engine does (bfloat16 when forward-only), shards every
   decoder layer and the root with FSDP2 `fully_shard` over the trainer ranks, and its
   `get_per_tensor_param` is verl's FSDP2 path without the device move: the state dict
   through verl's `convert_weight_keys`, then `(name, DTensor.full_tensor())` per entry:
   a gather over every trainer rank per tensor, in the same order on every rank.

Everything else is verl's: `TrainingWorker` (through verl's `TrainingWorkerTest`), its
`CheckpointEngineRegistry.new("hal", ...)`, `CheckpointEngineWorker`, `MockServerAdapter`
(whose `update_weights` and `check_weights` run unchanged below), `MockReplica`, and
`CheckpointEngineManager`.
"""

from __future__ import annotations

from typing import Any

from tests.verl.shipped import test_utils

_verl_tests = test_utils()
from verl.single_controller.base.decorator import Dispatch as _Dispatch, register as _register  # noqa: E402  (verl, as the helpers above)

# Every collective of the trainer's default group (FSDP's gathers) fails after this long
# instead of hanging (stand-in 1 sets it; verl leaves torch's default of 30 minutes).
TRAINER_GROUP_TIMEOUT_S = 120


class CpuFSDP2Engine:
    """Stand-in 2 above: the part of verl's FSDP engine the weight sync uses, on the CPU."""

    def __init__(self, model_config: Any, engine_config: Any, optimizer_config: Any = None, checkpoint_config: Any = None) -> None:
        self.model_config = model_config
        self.engine_config = engine_config
        self.module: Any = None

    is_param_offload_enabled = False
    is_optimizer_offload_enabled = False

    def initialize(self) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM
        from verl.utils.torch_dtypes import PrecisionType

        # verl's rule (transformer_impl.py:258-264): the configured dtype, else bf16 forward-only, fp32 to train
        dtype = self.engine_config.model_dtype or ("bf16" if self.engine_config.forward_only else "fp32")
        model = AutoModelForCausalLM.from_pretrained(
            self.model_config.local_path, torch_dtype=PrecisionType.to_dtype(dtype), attn_implementation="sdpa"
        )
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.module = model

    gathers = 0
    """`full_tensor()` gathers this engine's weight generator ran (the tests count them)."""

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Any, None]:
        from verl.utils.model import convert_weight_keys

        # verl: transformer_impl.py:1016-1035, with the tensors left where FSDP holds them
        params = convert_weight_keys(self.module.state_dict(), self.module)
        return ((name, self._gathered(p)) for name, p in params.items()), None

    def _gathered(self, param: Any) -> Any:
        from torch.distributed.tensor import DTensor

        if not isinstance(param, DTensor):
            return param
        self.gathers += 1
        return param.full_tensor()

    def get_data_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True


def _register_cpu_engine() -> None:
    from verl.workers.engine import BaseEngine, EngineRegistry

    try:
        EngineRegistry.get_engine_cls("language_model", "fsdp2")  # for this process's platform: hal, device cpu
        return  # registered already
    except ValueError:
        pass
    engine = type("CpuFSDP2Engine", (CpuFSDP2Engine, BaseEngine), {})
    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(engine)


class TrainingWorkerOnHal(_verl_tests.TrainingWorkerTest):
    """verl's `TrainingWorkerTest`, with the default process group initialised first with
    hal's backend string (stand-in 1 above) and the CPU engine registered (stand-in 2)."""

    def __init__(self, config: Any, checkpoint_engine_config: Any) -> None:
        import hal
        from verl.utils.distributed import initialize_global_process_group_ray

        initialize_global_process_group_ray(timeout_second=TRAINER_GROUP_TIMEOUT_S, backend=hal.current().dist_backend_string())
        _register_cpu_engine()
        super().__init__(config, checkpoint_engine_config)
        self._edges: dict[tuple[str, bool], Any] = {}  # the elements set_*_elements changed, as they were
        self._canary_log: list[str] = []  # the canary's warnings in this process (`canary_warnings`)

    @_register(dispatch_mode=_Dispatch.ONE_TO_ALL)
    def canary_warnings(self) -> list[str]:
        """The warnings hal's canary logged in this process since the first call (which starts listening)."""
        import logging

        if not getattr(self, "_canary_listening", False):
            log = self._canary_log

            class Keep(logging.Handler):
                def emit(self, record: logging.LogRecord) -> None:
                    if record.levelno >= logging.WARNING:
                        log.append(record.getMessage())

            logging.getLogger("hal.canary").addHandler(Keep())
            self._canary_listening = True
        return list(self._canary_log)

    @_register(dispatch_mode=_Dispatch.ONE_TO_ALL)
    def set_first_elements(self, value: float | None) -> int:
        """A training step's change, in the smallest form that is easy to check: element 0
        of every weight becomes `value` (None: back to what it was). FSDP2 shards along dim
        0 in rank order, so rank 0's shard starts with element 0 of the whole tensor; the
        other ranks change nothing. Returns the tensors this rank changed (a tied weight counts once)."""
        return self._set_edge(value, last=False)

    @_register(dispatch_mode=_Dispatch.ONE_TO_ALL)
    def set_last_elements(self, value: float | None) -> int:
        """`set_first_elements` at the other end: the last element of every weight, which
        the last trainer rank's shard ends with (every weight here has a row per rank)."""
        return self._set_edge(value, last=True)

    def _set_edge(self, value: float | None, *, last: bool) -> int:
        import torch
        from torch.distributed.tensor import DTensor

        changed = 0
        with torch.no_grad():
            for name, param in self.engine.module.named_parameters():  # a tied weight appears once
                local = param.to_local() if isinstance(param, DTensor) else param
                if isinstance(param, DTensor):
                    mesh = param.device_mesh
                    if mesh.get_local_rank() != (mesh.size() - 1 if last else 0):
                        continue
                if local.numel() == 0:
                    continue
                edge = local.view(-1)[-1:] if last else local.view(-1)[:1]
                key = (name, last)
                if value is None:
                    edge.copy_(self._edges.pop(key))
                else:
                    self._edges.setdefault(key, edge.clone())
                    edge.fill_(value)
                changed += 1
        return changed

    @_register(dispatch_mode=_Dispatch.ONE_TO_ALL)
    def set_canary_mode(self, mode: str) -> None:
        """Switch this rank's checkpoint-engine canary between "log" and "enforce" (a test
        switch: verl reads engine_kwargs once, when it builds the engines)."""
        self.checkpoint_engine.canary.config.mode = mode

    @_register(dispatch_mode=_Dispatch.ONE_TO_ALL)
    def gathers(self) -> int:
        """How many `full_tensor()` gathers this rank's weight generator has run."""
        return self.engine.gathers

    @_register(dispatch_mode=_Dispatch.ONE_TO_ALL)
    def hide_weight(self, rank: int, name: str | None) -> None:
        """On trainer rank `rank`, leave `name` out of the module's state dict (None: put it
        back): that rank then declares other tensors than the others (a mismatched layout)."""
        import torch.distributed as dist

        handle = getattr(self, "_hidden", None)
        if handle is not None:
            handle.remove()
            self._hidden = None
        if name is None or dist.get_rank() != rank:
            return

        def hide(module: Any, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            state_dict.pop(prefix + name, None)

        self._hidden = self.engine.module.register_state_dict_post_hook(hide)


def register_by_value() -> None:
    """Ray sends this module's classes by value: the workers need not import it by name."""
    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ServerAdapterOnHal(_verl_tests.MockServerAdapter):
    """verl's `MockServerAdapter` (its `update_weights` and `check_weights` unchanged), which
    can also end its own process in the middle of an update (a rollout worker killed during
    `update_weights`), and compare what it received bit for bit."""

    die_after: int | None = None
    stale: bool = False
    """When set: the engine keeps computing with the weights it loaded last, whatever
    arrives (an engine that holds the new bytes and computes with old ones)."""
    engine: Any = None

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """The engine's side of the checkpoint engine's canary (hal.integrations.verl.canary):
        the probe's log-probs under the checkpoint's model, loaded with what this adapter
        received, in the received dtype (unless `stale`: then with what it loaded last)."""
        import torch
        from transformers import AutoModelForCausalLM

        from hal.canary import Probe, module_logprobs

        weights = self.received_weights
        if self.engine is None:
            dtype = next(iter(weights.values())).dtype if weights else torch.float32  # verl's FSDP engine trains in fp32
            self.engine = AutoModelForCausalLM.from_pretrained(self.model_config.local_path, dtype=dtype, attn_implementation="sdpa")
        if not self.stale:
            missing, unexpected = self.engine.load_state_dict(dict(weights), strict=False)
            assert not unexpected and not [m for m in missing if m in weights], (missing, unexpected)
        return module_logprobs(self.engine, Probe.of(sequences))

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        await super().update_weights(self._dying(weights) if self.die_after is not None else weights, **kwargs)

    async def _dying(self, weights: Any) -> Any:
        import os

        taken = 0
        async for pair in weights:
            if taken >= self.die_after:
                os._exit(17)  # the worker dies with the sync in flight
            taken += 1
            yield pair

    def mismatches(self, first: float | None = None, last: float | None = None) -> list[str]:
        """What differs between the received tensors and the checkpoint, bit for bit, with
        element 0 of every tensor set to `first` and its last element to `last` when given
        (the trainers' `set_first_elements` / `set_last_elements`). The checkpoint is
        bfloat16 and the trainer may hold float32 (verl's FSDP default): bf16 widens to fp32
        exactly, so the comparison is exact in the received dtype."""
        import torch
        from transformers import AutoModelForCausalLM

        expected = AutoModelForCausalLM.from_pretrained(self.model_config.local_path, dtype=torch.bfloat16).state_dict()
        for tensor in expected.values():
            if first is not None:
                tensor.view(-1)[0] = first
            if last is not None:
                tensor.view(-1)[-1] = last
        bad = [f"{name}: not received" for name in expected if name not in self.received_weights]
        for name, tensor in self.received_weights.items():
            want = expected.get(name)
            if want is None:
                bad.append(f"{name}: not in the checkpoint")
            elif want.shape != tensor.shape or not (tensor.dtype == want.dtype or tensor.dtype == torch.float32):
                bad.append(f"{name}: {tensor.dtype} {tuple(tensor.shape)}, checkpoint {want.dtype} {tuple(want.shape)}")
            elif not torch.equal(want.to(tensor.dtype), tensor):
                bad.append(f"{name}: {int((want != tensor).sum())} of {want.numel()} elements differ")
        return sorted(bad)


def rollout_worker_class() -> type:
    """verl's `CheckpointEngineWorker` with `ServerAdapterOnHal` (verl's test helper builds
    it with `MockServerAdapter`; this one adds the failure switch and the exact check)."""
    from verl.checkpoint_engine import CheckpointEngineWorker
    from verl.single_controller.base.decorator import Dispatch, register

    class RolloutWorkerOnHal(CheckpointEngineWorker):
        def __init__(self, rollout_config: Any, model_config: Any, *args: Any, **kwargs: Any) -> None:
            adapter = ServerAdapterOnHal(rollout_config, model_config, True)
            super().__init__(rollout_config, model_config, adapter, *args, **kwargs)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def check_weights(self) -> list[str]:
            bad = self.server_adapter.mismatches()
            self.server_adapter.check_weights()  # verl's own check; clears what was received
            return bad

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def check_changed_weights(self, first: float | None, last: float | None = None) -> list[str]:
            """`check_weights` for trainers that changed element 0 of every weight to `first`
            (and its last element to `last`; verl's own check compares with the checkpoint,
            so it is left out)."""
            bad = self.server_adapter.mismatches(first, last)
            self.server_adapter.received_weights.clear()
            return bad

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def go_stale(self, rank: int, stale: bool) -> None:
            """Rollout worker `rank`'s engine keeps computing with the weights it holds now
            (`stale`), or again with what it receives."""
            if self.rank == rank:
                self.server_adapter.stale = stale

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def die_during_next_update(self, rank: int, after: int) -> None:
            if self.rank == rank:
                self.server_adapter.die_after = after

    return RolloutWorkerOnHal
