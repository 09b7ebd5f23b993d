"""`MegatronSource`: what one tensor- and pipeline-parallel rank of a Megatron-core trainer
holds of the Hugging Face model, as blocks the M-to-N sync sends (hal.integrations.megatron)."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from hal.integrations.megatron.convert import MegatronLayout, MegatronShape
from hal.sync.plan import Block
from hal.sync.spec import TensorSpec


class MegatronSource:
    """What this rank holds of the Hugging Face model, from its Megatron model chunk(s),
    through each chunk's `MegatronLayout` adapter (hal.integrations.megatron.convert).

    `model`: a `GPTModel`, one wrapped by Megatron (DDP, Float16Module), or the list of a
    rank's virtual-pipeline chunks. `hf_vocab_size`: the Hugging Face vocabulary when
    Megatron's is padded (rows past it are not sent). `shape`: the shape and parallel
    ranks, when not read from megatron-core's parallel state (tests, tools).

    A sharded sync reads `local_tensors()`; iterating (a whole-tensor sync from one rank)
    would need a gather, which this source does not do: it raises.
    """

    def __init__(self, model: Any, *, hf_vocab_size: int | None = None, shape: MegatronShape | Sequence[MegatronShape] | None = None) -> None:
        from hal.integrations.megatron import _internals

        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.chunks = [_internals.unwrap(chunk) for chunk in chunks]
        if shape is None:
            self.shapes = [_internals.shape_of(chunk, hf_vocab_size) for chunk in self.chunks]
        else:
            self.shapes = list(shape) if isinstance(shape, (list, tuple)) else [shape]
        if len(self.shapes) != len(self.chunks):
            raise ValueError(f"MegatronSource: {len(self.chunks)} model chunks, {len(self.shapes)} shapes")
        self.adapters = [MegatronLayout(shape) for shape in self.shapes]
        """Each chunk's names and layouts (hal.sync.adapters' contract)."""
        self._internals = _internals

    def local_tensors(self) -> list[tuple[str, torch.Tensor | Block]]:
        """This rank's Hugging Face tensors and blocks (no gather), fresh every call."""
        out: list[tuple[str, torch.Tensor | Block]] = []
        for chunk, adapter in zip(self.chunks, self.adapters):
            out += adapter.to_checkpoint(self._internals.local_named(chunk))
        return out

    def metadata(self) -> list[TensorSpec]:
        """The Hugging Face tensors this rank holds a part of, with their global shapes."""
        return [
            TensorSpec(name, held.shape if isinstance(held, Block) else tuple(held.shape), held.dtype)
            for name, held in self.local_tensors()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise TypeError(
            "a MegatronSource is sent by every rank, each its own shards: use ShardedSender or "
            "WeightSync(..., senders='all'); a whole-tensor sync from one rank would gather every tensor"
        )
