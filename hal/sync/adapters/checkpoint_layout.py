"""A transformers model's tensors as its checkpoint holds them: the names and layouts
`save_pretrained` writes and engines load, as views of the module's own parameters.

transformers 5 converts some checkpoints when it loads them: a MoE layer's experts, one
tensor per expert in the checkpoint, become one 3-D parameter of the module

    checkpoint (what vLLM loads)                        module (transformers 5)
    mlp.experts.{e}.gate_proj.weight (I, H)   ┐
    mlp.experts.{e}.up_proj.weight   (I, H)   ┴──────►  mlp.experts.gate_up_proj (E, 2I, H)
    mlp.experts.{e}.down_proj.weight (H, I)   ────────►  mlp.experts.down_proj   (E, H, I)

and Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2` are renamed on the way. The
`CheckpointLayout` of a model is a state-dict adapter (hal.sync.adapters.base): `Renamed`
and `Split` rules, the latter views. The mapping is transformers' own (`conversion_mapping.py`, reversed on save by
`core_model_loading.revert_weight_conversion`); `CheckpointLayout` reads it, never a
table of hal's. Names come from transformers' own renaming functions; each reversed
operation (`Chunk`, `SplitModulelist`, `Transpose`) is applied as the view it is, without
the copy transformers' save makes, so a sync packs the experts from their own memory and
never copies the model first. Every split is checked once, when its rule is made, against transformers'
own conversion run on a meta tensor: the same names and shapes. A conversion that makes
new tensors (a concatenation, an interleave) or that transformers cannot reverse is
refused by parameter name, with what to send instead.

Nothing here imports transformers unless the module is a transformers model (one is
already imported then).
"""

from __future__ import annotations

import copy
import functools
import re
import sys
import weakref
from typing import Any, Callable, Sequence

import torch

from hal.sync.adapters.base import Derived, Renamed, Rule, StateDictAdapter

_INSTEAD = (
    "send the checkpoint's tensors yourself: TensorSource(revert_weight_conversion(model, model.state_dict())) "
    "(transformers.core_model_loading; a copy of the model), or ModuleSource(model, checkpoint=False) for the module's own names"
)


class Split(Derived):
    """A parameter the checkpoint holds as several tensors: views of it, in a fixed order
    (by where they lie in the parameter: back to back tensors stay back to back)."""

    __slots__ = ("param", "key", "converter", "names", "model_ref")

    def __init__(self, param: str, key: str, converter: Any, model: torch.nn.Module) -> None:
        self.param = param  # the module's name of the parameter
        self.key = key  # transformers' name of the group (`...experts.*.gate_proj.weight`)
        self.converter = converter  # reversed: the module's tensor -> the checkpoint's
        self.model_ref = weakref.ref(model)
        self.names: list[str] = []

    def made(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors of this group as views of `tensor`, by name."""
        converter, model = self.converter, self.model_ref()
        collected: dict[str, Any] = {converter.source_patterns[0]: [tensor]}
        kwargs = {"model": model, "config": getattr(model, "config", None), "full_layer_name": self.key}
        for op in converter.operations:
            collected = _view_ops()[type(op)](op, collected, converter.source_patterns, converter.target_patterns, **kwargs)
        # the group's full names, as `WeightConverter.convert` makes them
        full = self.key.replace("*.", "0.")
        prefix, _, suffix = next((full.partition(k) for k in collected if k in full), ("", "", ""))
        return {prefix + k + suffix: v for k, v in collected.items()}

    def apply(self, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors of the parameter `tensor` (its full tensor), in order."""
        views = self.made(tensor)
        return [(name, views[name]) for name in self.names]

    def __repr__(self) -> str:
        return f"Split({self.param!r} -> {self.key!r})"


def _first(collected: dict[str, Any]) -> torch.Tensor:
    tensors = next(iter(collected.values()))
    return tensors[0] if isinstance(tensors, list) else tensors


def _chunk(op: Any, collected: dict, sources: list[str], targets: list[str], **kwargs: Any) -> dict:
    names = op.get_target_patterns(targets, **kwargs)
    return dict(zip(names, torch.chunk(_first(collected), len(names), dim=op.dim)))  # transformers adds .contiguous(): a copy


def _split_modulelist(op: Any, collected: dict, sources: list[str], targets: list[str], **kwargs: Any) -> dict:
    out = {}
    for pattern, tensors in collected.items():
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        count = tensor.size(op.dim)
        names = op.get_target_patterns(collected, pattern, targets, count)
        out.update({name: piece.squeeze() for name, piece in zip(names, torch.chunk(tensor, count, dim=op.dim))})
    return out


def _transpose(op: Any, collected: dict, sources: list[str], targets: list[str], **kwargs: Any) -> dict:
    name = op.get_target_pattern(collected, sources, targets)
    tensor = _first(collected)
    if op.check_dims and tensor.shape == kwargs["model"].get_parameter(kwargs["full_layer_name"]).shape:
        return {name: tensor}  # transformers transposes only a tensor not already in the expected shape
    return {name: tensor.transpose(op.dim0, op.dim1)}  # transformers adds .contiguous(): the sender copies it anyway


@functools.cache
def _view_ops() -> dict[type, Callable[..., dict]]:
    """transformers' reversed operations that are views, and how to make them."""
    from transformers.core_model_loading import Chunk, SplitModulelist, Transpose

    return {Chunk: _chunk, SplitModulelist: _split_modulelist, Transpose: _transpose}


class CheckpointLayout(StateDictAdapter):
    """transformers' reversed conversion of one model (see the module doc), as a state-dict
    adapter. One per model (`checkpoint_layout`), compared by identity; holds the model
    weakly (it is kept per model, weakly)."""

    def __init__(self, conversions: list[Any], model: torch.nn.Module) -> None:
        self.conversions = conversions  # transformers' WeightTransforms, as loading applies them
        self.model_ref = weakref.ref(model)
        self._names: list[str] | None = None
        self._rules: dict[str, Rule] = {}
        self._split_shapes: list[tuple[int, torch.Size]] = []  # (position, shape) of each split tensor

    def rules(self, names: list[str], tensors: list[torch.Tensor]) -> dict[str, Rule]:
        """The rule of every name of `names` (the module's state-dict names, of `tensors`) that
        the checkpoint holds otherwise; a name without one is the checkpoint's as it is. Made
        once per list of names and shapes of the split tensors (how many experts there are):
        transformers renames a whole state dict at once, in its own order."""
        model = self.model_ref()
        if model is None:
            raise ValueError("the model of this checkpoint layout was deleted")
        if names != self._names or any(tensors[at].shape != shape for at, shape in self._split_shapes):
            self._rules = self._make(model, names, dict(zip(names, tensors)))
            self._names = list(names)
            position = {name: at for at, name in enumerate(names)}
            self._split_shapes = [(position[r.param], tensors[position[r.param]].shape) for r in self._rules.values() if isinstance(r, Split)]
        return self._rules

    def _make(self, model: torch.nn.Module, names: list[str], tensors: dict[str, torch.Tensor]) -> dict[str, Rule]:
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        reversed_ = []
        for transform in self.conversions[::-1]:  # as revert_weight_conversion: sub-models' first
            try:
                reversed_.append(transform.reverse_transform())
            except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, NotImplementedError, ...
                touched = _touched(transform, names)
                raise ValueError(
                    f"parameter {touched!r}: transformers cannot reverse its checkpoint conversion ({transform!r}: "
                    f"{type(exc).__name__}: {exc}), so hal does not know the checkpoint's names and layout; {_INSTEAD}"
                ) from exc
        renamings = [t for t in reversed_ if isinstance(t, WeightRenaming)]
        converters = [t for t in reversed_ if isinstance(t, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        rules: dict[str, Rule] = {}
        groups: dict[str, list[str]] = {}
        patterns: dict[str, str] = {}
        for name in sorted(names, key=dot_natural_key):
            key, pattern = rename_source_key(name, renamings, converters, reverse=True)
            if pattern is None:
                if key != name:
                    rules[name] = Renamed(key)
                continue
            groups.setdefault(key, []).append(name)
            patterns[key] = pattern
        for key, members in groups.items():
            converter = by_pattern[patterns[key]]
            rules[members[0]] = self._split(model, key, converter, members, tensors)
        return rules

    def _split(self, model: torch.nn.Module, key: str, converter: Any, members: list[str], tensors: dict[str, torch.Tensor]) -> Split:
        name = members[0]
        ops = [type(op).__name__ for op in converter.operations]
        if len(members) > 1 or len(converter.source_patterns) > 1 or any(type(op) not in _view_ops() for op in converter.operations):
            raise ValueError(
                f"parameter {name!r}: transformers' checkpoint conversion ({' -> '.join(ops)} of {', '.join(members)}) "
                f"makes new tensors, not views of the parameter; ModuleSource sends views only; {_INSTEAD}"
            )
        split = Split(name, key, converter, model)
        held = tensors[name]
        stand_in = torch.empty_strided(tuple(held.shape), _strides(held), dtype=held.dtype, device="meta")
        views = split.made(stand_in)
        # transformers' own conversion of the same tensor, for the names and shapes it saves
        theirs = copy.deepcopy(converter)
        theirs.add_tensor(key, name, converter.source_patterns[0], stand_in)
        saved = {n: tuple((t[0] if isinstance(t, list) else t).shape) for n, t in theirs.convert(key, model=model, config=model.config).items()}
        ours = {n: tuple(t.shape) for n, t in views.items()}
        if ours != saved:
            raise ValueError(
                f"parameter {name!r}: hal's views of transformers' checkpoint conversion ({' -> '.join(ops)}) give "
                f"{sorted(ours.items())}, transformers saves {sorted(saved.items())} (a transformers release hal does not "
                f"know; please report it); {_INSTEAD}"
            )
        split.names = sorted(views, key=lambda n: (views[n].storage_offset(), n))
        return split


def _strides(tensor: torch.Tensor) -> tuple[int, ...]:
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return tensor.stride()
    return torch.empty(tuple(tensor.shape), device="meta").stride()  # a DTensor: as its full tensor is laid out


def _touched(transform: Any, names: Sequence[str]) -> str:
    """A parameter a (forward) transform made, to name in an error; the transform when none shows."""
    for pattern in transform.target_patterns:
        try:
            found = re.compile(pattern.replace("*", ".*"))
        except re.error:
            continue
        name = next((n for n in names if found.search(n)), None)
        if name is not None:
            return name
    return repr(transform)


def _make_layout(model: torch.nn.Module) -> CheckpointLayout | None:
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None or not isinstance(model, modeling.PreTrainedModel):
        return None  # not a transformers model (its class would have imported transformers)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # transformers 4: experts are modules, named as the checkpoint names them
        return None
    # the conversions `revert_weight_conversion` reverses when the model is saved
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return CheckpointLayout(list(conversions), model) if conversions else None


_LAYOUTS: "weakref.WeakKeyDictionary[torch.nn.Module, CheckpointLayout | None]" = weakref.WeakKeyDictionary()


def checkpoint_layout(model: torch.nn.Module) -> CheckpointLayout | None:
    """The checkpoint layout of a transformers model, made once per model; None for a module
    that is not one or whose checkpoint transformers does not convert (most dense models)."""
    try:
        return _LAYOUTS[model]
    except KeyError:
        layout = _LAYOUTS[model] = _make_layout(model)
        return layout
