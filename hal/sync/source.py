"""Where a sync reads the trainer's weights from.

A source declares its tensors (`metadata()`, cheap, no gather) and yields fully
materialized `(name, tensor)` pairs in the same order on each iteration, a fresh pass
every time: nothing per-sync survives into the next sync. This mirrors vLLM's
`WeightSource`, so a vLLM source can be passed as is.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Protocol, Sequence, runtime_checkable

import torch

from hal.sync.plan import TensorSpec


@runtime_checkable
class WeightSource(Protocol):
    def metadata(self) -> Sequence[TensorSpec]: ...
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


@runtime_checkable
class LocalSource(Protocol):
    """A source that can also say what this rank holds without a gather: what every trainer
    rank sending its own rows reads (hal.sync.sharded). `ModuleSource` and `TensorSource` are."""

    def local_tensors(self) -> list[tuple[str, torch.Tensor]]: ...


def materialize(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor: FSDP DTensors gather through `full_tensor()` (a collective)."""
    if type(tensor) is torch.Tensor:  # the common case, without an attribute lookup
        return tensor
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` out of autograd (a copy from it must not join a graph); a new tensor object
    only when it is in one."""
    return tensor.detach() if tensor.requires_grad else tensor


class ModuleSource:
    """The parameters of a module, optionally renamed or filtered.

    `rename(name)` returns the name the engine expects, or None to leave the
    parameter out of the sync (e.g. LoRA adapters when only the base travels).
    """

    def __init__(self, module: torch.nn.Module, rename: Callable[[str], str | None] | None = None) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"ModuleSource needs a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.rename = rename

    def _named(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.module.named_parameters():
            target = self.rename(name) if self.rename else name
            if target is not None:
                yield target, param

    def metadata(self) -> list[TensorSpec]:
        # DTensor reports its global shape, so no gather happens here
        return [TensorSpec.of(name, p) for name, p in self._named()]

    def local_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters as this rank holds them (DTensors not gathered), out of autograd."""
        return [(name, param.detach()) for name, param in self._named()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._named():
            yield name, materialize(param.detach())


class TensorSource:
    """Already materialized `(name, tensor)` pairs (a state dict's items, a list)."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.pairs = list(pairs)
        for name, tensor in self.pairs:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"TensorSource: {name!r} is a {type(tensor).__name__}, not a tensor")

    def metadata(self) -> list[TensorSpec]:
        return [TensorSpec.of(name, t) for name, t in self.pairs]

    def local_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors as this rank holds them (DTensors not gathered), out of autograd."""
        return [(name, _detached(t)) for name, t in self.pairs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        plain = torch.Tensor
        for name, tensor in self.pairs:
            # the common case (a plain tensor out of autograd) without a call per tensor
            yield name, tensor if type(tensor) is plain and not tensor.requires_grad else materialize(_detached(tensor))


def as_source(source: object) -> WeightSource:
    """Accept a module, a source, a dict of tensors or a list of pairs."""
    if isinstance(source, torch.nn.Module):
        return ModuleSource(source)
    if isinstance(source, WeightSource):
        return source
    if isinstance(source, dict):
        return TensorSource(source.items())
    if isinstance(source, (list, tuple)):
        return TensorSource(source)
    raise TypeError(
        f"cannot sync from a {type(source).__name__}: pass a torch.nn.Module, a dict or list of "
        "(name, tensor), or an object with metadata() and __iter__"
    )
