"""Trainer side of "hal-lora": `LoraWeightSync` sends what `decide_lora_sync` says (the adapter alone
while the engines keep their base weights) into engines started with `backend="hal-lora"`.

    sync = LoraWeightSync([OfflineEngine(llm)], adapter_config(peft_model), sleep_level=1, free_cache_engine=True)
    sync.init()
    result = sync.sync(peft_model, version=step)
    llm.generate(prompts, params, lora_request=sync.lora_request())

Each engine is what `WeightSync` takes (an `Engine` or a vLLM weight-sync client), wrapped
in `LoraEngine` so that its init request also carries the adapter's config, name and id.

A sharded trainer (FSDP2): `LoraWeightSync(engines, lora_config, ..., trainer_group=g,
senders="all")`, made and called the same way on every rank of `g` (rank 0 alone drives
the engines; the others may pass `[]`): each rank sends only its rows of what travels
(`WeightSync(..., senders="all")`). Before each sync the ranks agree on it: the base
travels when any rank's tracker says so (`engine_lost_weights()` told on rank 0 alone is
enough), and a rank that cannot read its parts of the model fails the sync on every rank.
Merged weights (`adapter_merged=True`) are refused with senders="all".
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from hal.integrations.vllm.engines import Engine, as_engine
from hal.integrations.vllm.lora_engine import DEFAULT_LORA_ID, DEFAULT_LORA_NAME, HalLoraInitInfo
from hal.integrations.vllm.weight_sync import SyncResult, WeightSync
from hal.sync import SyncConfig, TensorSource
from hal.canary import as_canary
from hal.sync.lora import BaseWeightTracker, LoraSyncDecision, MergedSource, adapter_tensors, base_tensors
from hal.sync.config import ALL, GATHER
from hal.sync.errors import agree_failure
from hal.sync.wire import GroupChannel

logger = logging.getLogger(__name__)


def default_adapter_dir(lora_name: str = DEFAULT_LORA_NAME) -> str:
    """Where the engine publishes the adapter unless told otherwise: unique per trainer process."""
    return os.path.join(tempfile.gettempdir(), f"hal-lora-{os.getpid()}-{lora_name}")


def lora_request(adapter_dir: str, lora_name: str = DEFAULT_LORA_NAME, lora_int_id: int = DEFAULT_LORA_ID) -> Any:
    """The `LoRARequest` that makes a request use the synced adapter."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name, lora_int_id, adapter_dir)


class LoraEngine:
    """An engine of a "hal-lora" sync: `inner` (an `Engine`, or a vLLM weight-sync client as
    `WeightSync` takes it) whose init request also carries the adapter's config, name and id."""

    def __init__(self, inner: Any, lora_config: dict[str, Any], *, adapter_dir: str, lora_name: str, lora_int_id: int) -> None:
        self.inner: Engine = as_engine(inner)
        self.lora_config = dict(lora_config)
        self.adapter_dir = adapter_dir
        self.lora_name = lora_name
        self.lora_int_id = lora_int_id

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def num_workers(self) -> int:
        return self.inner.num_workers

    @property
    def same_node(self) -> bool:
        return self.inner.same_node

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        payload = {
            **init_info,
            "lora_config": self.lora_config,
            "adapter_dir": self.adapter_dir,
            "lora_name": self.lora_name,
            "lora_int_id": self.lora_int_id,
        }
        HalLoraInitInfo(**payload)  # refuse a bad adapter config here, not in the engine
        self.inner.init_weight_transfer_engine(payload)

    def start_weight_update(self) -> None:
        self.inner.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.inner.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.inner.finish_weight_update(weight_version)

    def update_weight_version(self, weight_version: str) -> None:
        self.inner.update_weight_version(weight_version)

    def get_weight_version(self) -> str:
        return self.inner.get_weight_version()

    def reset_prefix_cache(self) -> None:
        self.inner.reset_prefix_cache()

    def shutdown_weight_transfer_engine(self) -> None:
        self.inner.shutdown_weight_transfer_engine()


@dataclass(slots=True)
class LoraSyncResult:
    """One LoRA sync: what was decided, and the sync's own result."""

    decision: LoraSyncDecision
    result: SyncResult
    """The sync's own result (metrics.bytes: the bytes that travelled)."""
    part_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of each part sent ("base", "adapter", "merged"), of the whole model (with
    senders="all", `metrics.bytes` is this rank's share of their sum)."""

    @property
    def metrics(self) -> Any:
        return self.result.metrics


class LoraWeightSync:
    """Drives LoRA syncs from a peft trainer into "hal-lora" engines, sending what
    `decide_lora_sync` says (adapter only while the engines keep their base weights).

    `engines`: what `WeightSync` takes (`OfflineEngine(llm)`, vLLM's weight-sync clients,
    ...), each started with `backend="hal-lora"`. `sleep_level` and `free_cache_engine`
    describe how the engines are put to sleep between rollouts (as verl's rollout config);
    `engine_lost_weights()` records an engine's report that it freed its weights, so that
    the next sync resends the base.

    `trainer_group=g, senders="all"` (on every rank of `g`): every trainer rank sends its own
    rows (see the module doc); `token` as for `WeightSync`.

    `canary` (a `CanaryConfig` or `Canary`, hal.canary; off unless given, unlike
    `WeightSync`'s: an engine that serves LoRA computes the probe in a forced decode step
    per token): after a sync that is due, the engines compute the probe with the synced
    adapter (`lora_request()`) against the peft model's forward (docs/canary.md); the
    report is `result.result.canary`.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        lora_config: dict[str, Any],
        *,
        sleep_level: int,
        free_cache_engine: bool,
        adapter_merged: bool = False,
        adapter_name: str | None = None,
        lora_name: str = DEFAULT_LORA_NAME,
        lora_int_id: int = DEFAULT_LORA_ID,
        adapter_dir: str | None = None,
        config: SyncConfig | None = None,
        timeout_s: float = 120.0,
        transport: str = "auto",
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        token: str | None = None,
        trainer_group: Any = None,
        senders: str = "one",
        canary: Any = None,
    ) -> None:
        if senders == "all" and adapter_merged:
            raise ValueError(
                "LoraWeightSync(adapter_merged=True, senders='all'): merged weights (MergedSource) fold the adapter "
                "into whole base tensors, which no single trainer rank holds; send base and adapter "
                "(adapter_merged=False), or merge on one rank (senders='one')"
            )
        if senders == GATHER or (trainer_group is not None and senders != ALL):
            raise ValueError(
                "LoraWeightSync(trainer_group=...) needs senders='all' (every trainer rank sends its rows); "
                "gathering onto one sending rank (senders='gather') is not offered for LoRA syncs"
            )
        self.senders = senders
        self.trainer_group = trainer_group
        self._channel: GroupChannel | None = None  # senders="all": the trainer group, to agree on what travels
        self.lora_name = lora_name
        self.lora_int_id = lora_int_id
        self.adapter_dir = os.path.abspath(adapter_dir or default_adapter_dir(lora_name))
        """Where the engines publish the adapter (a directory on each engine's node)."""
        self.adapter_name = adapter_name
        self.tracker = BaseWeightTracker(
            has_adapter=True, sleep_level=sleep_level, free_cache_engine=free_cache_engine, adapter_merged=adapter_merged
        )
        self.tracker.decide()  # validates sleep_level and the flags now
        wrapped = [
            LoraEngine(e, lora_config, adapter_dir=self.adapter_dir, lora_name=lora_name, lora_int_id=lora_int_id)
            for e in engines
        ]
        self.weight_sync = WeightSync(
            wrapped, config=config, timeout_s=timeout_s, transport=transport,
            master_address=master_address, master_port=master_port, token=token,
            trainer_group=trainer_group, senders=senders,
            canary=None,  # its source is the parts that travel: this class runs the canary on the peft model
        )
        self.canary = as_canary(canary)
        """The canary (hal.canary), None when off: run here, since the sync's own source is the parts that travel."""

    def init(self) -> None:
        self.weight_sync.init()
        self._channel = self.weight_sync.trainer_channel  # senders="all": agree there on what travels

    def decide(self) -> LoraSyncDecision:
        return self.tracker.decide()

    def sources(self, model: torch.nn.Module, decision: LoraSyncDecision) -> tuple[TensorSource, dict[str, int]]:
        """The pairs of every part `decision` sends, in sending order, and each part's bytes."""
        pairs: list[tuple[str, torch.Tensor]] = []
        sizes: dict[str, int] = {}
        for part in decision.parts:
            if part == "base":
                got = base_tensors(model)
            elif part == "adapter":
                got = adapter_tensors(model, self.adapter_name)
            else:
                got = list(MergedSource(model, self.adapter_name))
            sizes[part] = sum(t.numel() * t.element_size() for _, t in got)
            pairs.extend(got)
        return TensorSource(pairs), sizes

    def sync(self, model: torch.nn.Module, version: int) -> LoraSyncResult:
        """One sync of the peft `model` as `version`; the engines serve the new adapter when it returns."""
        decision = self.tracker.decide()
        if self._channel is not None:
            decision, source, sizes = self._agreed(model, decision, version)
        else:
            source, sizes = self.sources(model, decision)
        start = time.perf_counter()
        result = self.weight_sync.sync(source, version)
        self.tracker.sent(decision)
        # the engines serve the adapter through a LoRARequest; the trainer's reference is the peft model's forward
        self.weight_sync.check_canary(model, version, result, canary=self.canary, lora_request=self.lora_request())
        logger.info(
            "hal-lora sync v%d: %s (%s) in %.3f s", version, "+".join(decision.parts), decision.reason, time.perf_counter() - start
        )
        return LoraSyncResult(decision=decision, result=result, part_bytes=sizes)

    def _agreed(
        self, model: torch.nn.Module, decision: LoraSyncDecision, version: int
    ) -> tuple[LoraSyncDecision, TensorSource, dict[str, int]]:
        """senders="all", on every trainer rank: what travels, the same on every rank (the
        base when any rank's tracker says so); a rank that cannot read its parts fails the
        sync on every rank, naming it, before any engine is asked anything."""
        parts: dict[str, TensorSource] = {}
        sizes: dict[str, int] = {}
        error: BaseException | None = None
        try:  # both parts (references, no copies): another rank may want the base
            for part in ("base", "adapter"):
                got = base_tensors(model) if part == "base" else adapter_tensors(model, self.adapter_name)
                parts[part] = TensorSource(got)
                sizes[part] = sum(t.numel() * t.element_size() for _, t in got)
        except Exception as exc:  # noqa: BLE001 - told to every rank
            error = exc
        channel = self._channel
        with channel.bounded(self.weight_sync.config.timeout_s):
            failure = agree_failure(
                channel, error, f"what the LoRA sync of version {version} sends",
                lambda rank: f"LoraWeightSync.sync of version {version}: trainer rank {rank}: ",
            )
            if failure is not None:
                raise failure from error
            wants_base = torch.zeros(channel.world_size, dtype=torch.int64, device=channel.control_device)
            wants_base[channel.rank] = int(decision.send_base)
            channel.allreduce(wants_base, f"whether the LoRA sync of version {version} sends the base")
        if not decision.send_base and bool(wants_base.cpu().any()):
            self.tracker.engine_lost_weights()  # another rank was told the engine lost its weights
            decision = self.tracker.decide()
        pairs = [pair for part in decision.parts for pair in parts[part].pairs]
        return decision, TensorSource(pairs), {part: sizes[part] for part in decision.parts}

    def engine_lost_weights(self) -> None:
        """An engine reported it freed its weights (e.g. woke from sleep level 2): resend the base next time."""
        self.tracker.engine_lost_weights()

    def lora_request(self) -> Any:
        """The `LoRARequest` for generation with the synced adapter."""
        return lora_request(self.adapter_dir, self.lora_name, self.lora_int_id)

    def close(self) -> None:
        self._channel = None
        self.weight_sync.close()

    def __enter__(self) -> "LoraWeightSync":
        self.init()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
