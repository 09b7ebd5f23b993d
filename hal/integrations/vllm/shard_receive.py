"""The engine side of a shard receive (issue 41): each vLLM worker takes only its own
pieces of every sync and lands them straight in its layers.

At `init_transfer_engine`, when the trainer asks for it (`HalInitInfo.receive` "shard" or
"auto"), each worker records its needs from vLLM's own loaders
(hal.integrations.vllm.recording) and makes its `LayerLanding` over the engine's reload
(hal.integrations.vllm.landing); either may refuse, by name (a loader the record cannot
express, a layer vLLM processes only at the end of a reload). Every rank of every sync
group then gathers every worker's word (hal.sync.plan.exchange) and decides alike:
`ShardReceive.negotiate` returns this worker's receiving side, or None for whole tensors.

Each sync then runs `LinkReceiver.receive(LandingSink(needs, LandingLayers(...)))`
(hal.sync.receive.links and .landing), under the guarantees of every sync: each trainer
rank's header, token, version and verify; every link's pieces read from its header and
checked to bring exactly this worker's needs; one agreement per group; each layer old or
new after a failure (`LayerLanding.abort`: vLLM's finalize puts back every layer that did
not complete). `LandingLayers` is the adapter from the landing's calls to the sink's
`EngineLayers`; it works the same under both engine generations (on vLLM 0.23-0.24 the
worker opened the reload before the sync: the landing finds it open).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch

from hal.integrations.vllm.landing import LayerLanding
from hal.integrations.vllm.recording import record_needs
from hal.integrations.vllm.reload import LayerwiseReload
from hal.sync import SpecMismatchError, TensorSpec
from hal.sync.plan.exchange import choose_receive, exchange_needs, needs_payload, read_payloads
from hal.sync.plan.needs import Target, UnexpressibleLoad, WorkerNeeds, contiguous_strides
from hal.sync.receive import LandingSink, LinkReceiver
from hal.sync.transport import PeerTransport
from hal.sync.wire import GroupChannel

logger = logging.getLogger(__name__)


class LandingLayers:
    """A `LayerLanding` as the `EngineLayers` a `LandingSink` lands into: each target of an
    opened layer given whole (the staged tensor, or the landing's held copy of a live one),
    a layer closed by the landing's `complete`. `model_config`: what the reload is opened
    with; `check`: called as a sync begins (raising refuses it before anything lands)."""

    def __init__(self, landing: LayerLanding, model_config: Any, *, check: Callable[[], None] | None = None) -> None:
        self.landing, self.model_config, self.check = landing, model_config, check
        self.index = {(t.layer, t.name): i for i, t in enumerate(landing.needs.targets)}

    def begin(self) -> None:
        if self.check is not None:
            self.check()
        self.landing.start(self.model_config)  # on vLLM 0.23-0.24 the worker opened the reload: found open

    def open_layer(self, layer: str, targets: Sequence[Target]) -> list[torch.Tensor | None]:
        self.landing.open(layer)
        return [
            self.landing.destination(self.index[(layer, t.name)], (0, t.shape, contiguous_strides(t.shape))) for t in targets
        ]

    def close_layer(self, layer: str, held: Mapping[str, torch.Tensor]) -> None:
        self.landing.complete(layer)  # nothing is held by the sink: the landing keeps live tensors itself

    def finish(self) -> None:
        self.landing.finish()

    def abort(self) -> None:
        self.landing.abort()


EPLB_REFUSAL = (
    "the engine balances its experts (parallel_config.enable_eplb): EPLB moves experts between workers "
    "while it serves, so needs recorded at init go stale; whole tensors reach every worker"
)
"""Why a worker of an engine with EPLB takes whole tensors ("auto"), or refuses ("shard")."""


def record(model: torch.nn.Module, specs: Sequence[TensorSpec], device: torch.device, worker: int,
           reload: LayerwiseReload) -> tuple[WorkerNeeds, LayerLanding] | str:
    """This worker's needs and its landing, or why it has none (the refusal's message)."""
    try:
        needs = record_needs(model, specs, device, worker=worker)
        return needs, LayerLanding(model, needs, reload)
    except (UnexpressibleLoad, SpecMismatchError) as exc:
        return str(exc)


class ShardReceive:
    """One worker's side of a shard receive: its receiver and the sink it lands into."""

    def __init__(self, receiver: LinkReceiver, sink: LandingSink) -> None:
        self.receiver, self.sink = receiver, sink

    @classmethod
    def negotiate(
        cls,
        receive: str,
        word: tuple[WorkerNeeds, LayerLanding] | str,
        groups: Sequence[Any],
        *,
        model_config: Any,
        control_device: torch.device | str,
        timeout_s: float,
        token: str | None,
        check: Callable[[], None] | None = None,
    ) -> "ShardReceive | None":
        """Tell every trainer rank this worker's `word` (`record`) in each of its sync
        `groups` (trainer-rank order), learn every worker's, and decide as every rank does
        (`choose_receive`): this worker's receiving side, or None for whole tensors (why,
        logged once). "shard" with a worker that has no record raises `UnexpressibleLoad`
        on every rank."""
        payload = needs_payload(word[0] if isinstance(word, tuple) else word)
        gathered = None
        for group in groups:  # the same bytes in every group: each trainer rank gets them all
            channel = GroupChannel(group, control_device=control_device)
            with channel.bounded(timeout_s):
                words = exchange_needs(channel, payload)
            gathered = gathered if gathered is not None else words
        choice = choose_receive(receive, read_payloads(gathered or []))
        if not choice.shard:
            logger.info("hal weight transfer: every worker receives whole tensors (%s)", choice.why)
            return None
        needs, landing = word  # type: ignore[misc] - every worker recorded (choose_receive)
        if choice.needs[needs.worker].digest != needs.digest:
            raise SpecMismatchError(f"engine worker {needs.worker}: the needs the group gathered are not the ones it recorded")
        receiver = LinkReceiver([PeerTransport(g, src=0, control_device=control_device) for g in groups], timeout_s=timeout_s, token=token)
        sink = LandingSink(needs, LandingLayers(landing, model_config, check=check))
        logger.info(
            "hal weight transfer: engine worker %d receives only its shard: %.3f MiB of %.3f MiB a sync, %d layers",
            needs.worker, needs.nbytes / 2**20, sum(s.nbytes for s in needs.specs) / 2**20, len(sink.landing_layers),
        )
        return cls(receiver, sink)
