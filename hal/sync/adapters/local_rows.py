"""A trainer rank's own part of the checkpoint tensors an adapter makes of one FSDP2-sharded
parameter: what every-rank senders (`senders="all"`) read without a gather.

transformers 5 holds a MoE layer's experts as one 3-D parameter (`mlp.experts.gate_up_proj`,
(E, 2I, H)); the checkpoint holds one tensor per expert, views of it
(hal.sync.adapters.checkpoint_layout). FSDP2's `Shard(0)` gives each trainer rank whole
experts (the rows `torch.chunk` gives it of dim 0). The adapter's views are made on a meta
tensor of the parameter's global shape (`global_stand_in`); each is then either

- inside this rank's rows: the same view of the rank's local tensor, which this rank
  declares whole (hal.sync.plan.declare: a plain tensor) and alone sends;
- outside them: another rank's, left out here;
- across the boundary between two ranks' rows: refused by name (`local_view` raises), since
  the plan cannot declare part of a tensor that is no box of its rows here.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _placement_rows(name: str, tensor: Any) -> tuple[int, int, torch.Tensor]:
    """(first row, end row, local tensor) of a DTensor sharded `Shard(0)` over a 1-d mesh."""
    from torch.distributed.tensor import Shard

    placements = tuple(tensor.placements)
    if len(placements) != 1 or type(placements[0]) is not Shard or placements[0].dim != 0:
        raise ValueError(
            f"parameter {name!r}: placements {placements}; every-rank senders split the checkpoint tensors made of it "
            "only from Shard(0) over a 1-d mesh (FSDP2's fully_shard over the trainer group)"
        )
    mesh = tensor.device_mesh
    rows, parts, index = int(tensor.shape[0]), mesh.size(), mesh.get_local_rank()
    size = -(-rows // parts) if rows else 0
    lo, hi = min(rows, size * index), min(rows, size * (index + 1))
    return lo, hi, tensor.to_local()


class LocalRows:
    """The meta stand-ins of sharded parameters handed to an adapter's rules, and how to
    turn each view made of one back into this rank's part (`local_view`)."""

    def __init__(self) -> None:
        self._by_storage: dict[int, tuple[str, Any, torch.Tensor]] = {}

    def global_stand_in(self, name: str, tensor: Any) -> torch.Tensor:
        """A meta tensor of `tensor`'s global shape, contiguous: what the rule views."""
        root = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
        self._by_storage[_storage(root)] = (name, tensor, root)
        return root

    def made_of_shard(self, view: Any) -> bool:
        return isinstance(view, torch.Tensor) and view.device.type == "meta" and _storage(view) in self._by_storage

    def local_view(self, checkpoint_name: str, view: torch.Tensor) -> torch.Tensor | None:
        """This rank's tensor for `view` (made of a `global_stand_in`): the same view of its
        local rows, or None where another rank holds it."""
        name, sharded, root = self._by_storage[_storage(view)]
        if view.numel() == 0:
            return None
        lo, hi, local = _placement_rows(name, sharded)
        row = math.prod(root.shape[1:])
        first = view.storage_offset()
        last = first + sum((n - 1) * s for n, s in zip(view.shape, view.stride()))
        first_row, last_row = first // row, last // row if row else 0
        if last_row < lo or first_row >= hi:
            return None
        if first_row < lo or last_row >= hi:
            raise ValueError(
                f"checkpoint tensor {checkpoint_name!r} of parameter {name!r} spans rows {first_row}..{last_row} of it, "
                f"across this trainer rank's rows {lo}..{hi - 1} (FSDP2's Shard(0)): every-rank senders send a checkpoint "
                "tensor made of a sharded parameter only from the one rank that holds all of it; shard the parameter so that "
                "each rank holds whole ones, or send from one rank (senders='gather')"
            )
        if local.dim() != root.dim() or local.shape[0] != hi - lo or (hi > lo and tuple(local.stride()) != tuple(root.stride())):
            raise ValueError(
                f"parameter {name!r}: this rank holds rows of shape {tuple(local.shape)} and strides {tuple(local.stride())}, not "
                f"rows {lo}..{hi - 1} of the contiguous {tuple(root.shape)} its checkpoint tensors are views of"
            )
        local = local.detach()
        return local.as_strided(tuple(view.shape), tuple(view.stride()), local.storage_offset() + first - lo * row)


def _storage(tensor: torch.Tensor) -> int:
    # meta tensors have no addresses (every data_ptr is 0): the storage object tells roots apart
    return tensor.untyped_storage()._cdata


__all__ = ["LocalRows"]
