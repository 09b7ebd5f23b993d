"""Each trainer rank's own part of the checkpoint tensors made of an FSDP2-sharded parameter
(hal.sync.adapters.local_rows), against a stand-in of a DTensor: the same placements, mesh
and local rows FSDP2's `Shard(0)` gives, without a process group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torch.distributed.tensor")

from torch.distributed.tensor import Replicate, Shard  # noqa: E402

from hal.sync.adapters.local_rows import LocalRows  # noqa: E402


def sharded(full: torch.Tensor, ranks: int, rank: int, placement=None) -> SimpleNamespace:
    """What `ModuleSource` reads of a DTensor: its global shape and dtype, placements, mesh, local rows."""
    local = torch.chunk(full, ranks)[rank] if rank < len(torch.chunk(full, ranks)) else full[:0]
    mesh = SimpleNamespace(size=lambda: ranks, get_local_rank=lambda: rank)
    return SimpleNamespace(shape=full.shape, dtype=full.dtype, placements=(placement or Shard(0),), device_mesh=mesh,
                           to_local=lambda: local.clone())


def experts_of(root: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert views of a packed (E, 2I, H) parameter, as transformers' reversed conversion makes them."""
    out = {}
    for e in range(root.shape[0]):
        gate, up = torch.chunk(root[e], 2, dim=0)
        out[f"experts.{e}.gate_proj.weight"], out[f"experts.{e}.up_proj.weight"] = gate, up
    return out


@pytest.mark.parametrize("experts,ranks", [(4, 2), (5, 2), (3, 4)])
def test_each_rank_holds_the_experts_in_its_rows_and_together_every_one_once(experts, ranks):
    full = torch.arange(experts * 6 * 3, dtype=torch.float32).reshape(experts, 6, 3)
    want = experts_of(full)
    held: dict[str, list[int]] = {}
    for rank in range(ranks):
        rows = LocalRows()
        root = rows.global_stand_in("mlp.experts.gate_up_proj", sharded(full, ranks, rank))
        for name, view in experts_of(root).items():
            assert rows.made_of_shard(view)
            local = rows.local_view(name, view)
            if local is not None:
                assert torch.equal(local, want[name]), (rank, name)
                assert local.shape == want[name].shape and local.stride() == want[name].stride()
                held.setdefault(name, []).append(rank)
    assert held == {name: [held[name][0]] for name in want}  # every expert from exactly one rank
    assert sorted(held) == sorted(want)
    assert not LocalRows().made_of_shard(full) and not LocalRows().made_of_shard(torch.empty(2, device="meta"))


def test_a_checkpoint_tensor_across_two_ranks_rows_is_refused_by_name():
    full = torch.zeros(4, 6, 3)
    rows = LocalRows()
    root = rows.global_stand_in("mlp.experts.down_proj", sharded(full, 4, 1))
    straddling = root.flatten(0, 1)[4:8]  # rows 0 and 1 of the parameter: ranks 0 and 1
    with pytest.raises(ValueError, match=r"checkpoint tensor 'w' of parameter 'mlp.experts.down_proj' spans rows 0..1 of it, across this trainer rank's rows 1..1"):
        rows.local_view("w", straddling)


def test_a_parameter_not_sharded_by_rows_is_refused_by_name():
    full = torch.zeros(4, 6, 3)
    for placement in (Shard(1), Replicate()):
        rows = LocalRows()
        root = rows.global_stand_in("mlp.experts.gate_up_proj", sharded(full, 2, 0, placement))
        with pytest.raises(ValueError, match=r"parameter 'mlp.experts.gate_up_proj': placements .* only from Shard\(0\)"):
            rows.local_view("experts.0.gate_proj.weight", experts_of(root)["experts.0.gate_proj.weight"])
