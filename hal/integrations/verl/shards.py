"""Every trainer rank sends its own shards (`senders: all`) in verl's checkpoint engine "hal".

verl hands `send_weights` a generator that would gather every tensor on every rank, so with
`senders: all` the checkpoint engine closes it unread and sends the shards of the training
engine's module instead (`verl_internals.engine_shards`: an FSDP engine's `module.state_dict()`
under verl's names, the DTensors as they are; verl's Megatron engine's shards under Hugging
Face names). The training engine is `weights` itself when verl passes it (as it does for
its shard-operating backends), else the engine of the worker that holds the checkpoint
engine (`verl_internals.owning_worker`). What verl's generator would transform on the way
(LoRA, QAT, packed MoE experts, FSDP1) is refused by name (`verl_internals.shard_refusal`),
in `build_topology` when `prepare` could see the engine. The sync itself is the checkpoint
engine's, as for `senders: gather`: only its source differs. Imports no verl.
"""

from __future__ import annotations

import types
from typing import Any, Callable

from hal.integrations.verl import internals as verl_internals


class ShardSending:
    """One trainer rank's side of `senders: all`: the training engine whose shards it sends,
    why they could not stand for verl's generator (`check`, once per engine), and the
    source of one update (`engine_of`, then `source`)."""

    def __init__(self) -> None:
        self.engine: Any = None
        """The training engine `check` last saw (`prepare()` finds it in its worker)."""
        self.refusal: str | None = None
        """Why that engine's shards are not what verl's generator yields; None: they are."""

    def check(self, engine: Any) -> str | None:
        """Why `engine`'s shards cannot stand for verl's generator (None: they can); once per engine."""
        if engine is not self.engine:
            self.engine, self.refusal = engine, verl_internals.shard_refusal(engine)
        return self.refusal

    def found(self, worker: Any) -> Any:
        """The training engine of `worker` (the one that holds the checkpoint engine, or
        None), else the one `check` saw, else None."""
        engine = verl_internals.training_engine(worker)
        return self.engine if engine is None else engine

    def engine_of(self, weights: Any, worker: Any) -> Any:
        """The engine whose shards an update sends: `weights` when verl passed the engine,
        else `found(worker)`, which `senders: all` cannot do without (RuntimeError)."""
        if verl_internals.is_training_engine(weights):
            return weights
        engine = self.found(worker)
        if engine is None:
            raise RuntimeError(
                "checkpoint engine 'hal': senders 'all' sends the training engine's own shards, and found no engine: "
                "pass it to send_weights (as verl does for shard-operating backends), or call send_weights from the "
                "worker that holds this checkpoint engine (its `engine` or `actor.engine`)"
            )
        return engine

    def source(self, engine: Any, weights: Any) -> Callable[[], Any]:
        """This rank's shards of `engine` as one sync's source, read when called (on the
        sending thread); verl's generator `weights` is closed unread, so its `full_tensor()`
        gathers never run. ValueError naming why when the engine is refused."""
        if isinstance(weights, types.GeneratorType):
            weights.close()
        refused = self.check(engine)
        if refused is not None:
            raise ValueError(f"checkpoint engine 'hal': senders 'all' is refused on this trainer rank: {refused}")
        return lambda: verl_internals.engine_shards(engine)
