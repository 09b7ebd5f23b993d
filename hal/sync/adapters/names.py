"""Adapters that only rename: the checkpoint holds every tensor as the trainer does, under
another name (or not at all).

- `Unwrap`: without the components torch's wrappers insert (`WRAPPER_COMPONENTS`).
- `Rename(function)`: a caller's function of one name (`ModuleSource(model, rename=...)`).
- `KeyMapping`: transformers 4's `_checkpoint_conversion_mapping`, reversed as its
  `save_pretrained` reverses it (and verl's `convert_weight_keys`, which verl's weight
  generator sends under).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from hal.sync.adapters.base import NameAdapter, NameFunction

# Modules torch inserts around a user's module, whose attribute name is in `named_parameters()`
# but not in the checkpoint the engine loads: activation checkpointing's `checkpoint_wrapper`
# and FSDP1's wrapper (their `state_dict()` drops it too) and `torch.compile`'s
# `OptimizedModule` (its `state_dict()` keeps it; no engine checkpoint has it).
WRAPPER_COMPONENTS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def unwrapped_name(name: str) -> str:
    """`name` without the components of `WRAPPER_COMPONENTS`:
    `layers.0._checkpoint_wrapped_module.mlp.weight` is `layers.0.mlp.weight`."""
    if "._" not in name and not name.startswith("_"):  # the common case: every wrapper's component starts with "_"
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


class Unwrap(NameAdapter):
    """Names without the wrappers' components (`unwrapped_name`). Every `Unwrap` is the same."""

    def name(self, name: str) -> str:
        return unwrapped_name(name)

    def name_function(self) -> NameFunction:
        return unwrapped_name  # no method call per name

    def __eq__(self, other: object) -> bool:
        return type(other) is Unwrap

    def __hash__(self) -> int:
        return hash(Unwrap)

    def __repr__(self) -> str:
        return "Unwrap()"


class Rename(NameAdapter):
    """A caller's function: the checkpoint's name of a name, or None to leave the tensor out.
    Two are the same when their functions are (`==`): pass the same function every sync."""

    def __init__(self, function: Callable[[str], str | None]) -> None:
        if not callable(function):
            raise TypeError(f"Rename needs a function of one name, got a {type(function).__name__}")
        self.function = function

    def name(self, name: str) -> str | None:
        return self.function(name)

    def name_function(self) -> NameFunction:
        return self.function

    def __eq__(self, other: object) -> bool:
        return type(other) is Rename and other.function == self.function

    def __hash__(self) -> int:
        return hash(self.function)

    def __repr__(self) -> str:
        return f"Rename({getattr(self.function, '__qualname__', self.function)!r})"


class KeyMapping(NameAdapter):
    """A model's `_checkpoint_conversion_mapping` (transformers 4: checkpoint pattern -> the
    module's name) reversed: each module-side pattern, in the mapping's order, is replaced
    by its checkpoint-side pattern stripped of its anchor (`^`) and of its groups; the first
    that matches renames. What transformers 4's `save_pretrained` writes and verl's
    `convert_weight_keys` sends (verl's lane checks it against verl's function)."""

    def __init__(self, mapping: dict[str, str]) -> None:
        reverse: dict[str, str] = {}
        for checkpoint_side, module_side in mapping.items():
            reverse[module_side] = checkpoint_side  # a module-side pattern mapped twice: the later one
        self.mapping = tuple(mapping.items())
        self._reverse = [(re.compile(module_side), re.sub(r"\(.*\)", "", checkpoint_side.lstrip("^"))) for module_side, checkpoint_side in reverse.items()]

    @classmethod
    def of(cls, model: Any) -> "KeyMapping | None":
        """The mapping of `model` (None when it has none: transformers 5's models, most others)."""
        mapping = getattr(model, "_checkpoint_conversion_mapping", None)
        return cls(mapping) if mapping else None

    def name(self, name: str) -> str:
        for pattern, replacement in self._reverse:
            renamed, count = pattern.subn(replacement, name)
            if count:
                return renamed
        return name

    def __eq__(self, other: object) -> bool:
        return type(other) is KeyMapping and other.mapping == self.mapping

    def __hash__(self) -> int:
        return hash(self.mapping)

    def __repr__(self) -> str:
        return f"KeyMapping({dict(self.mapping)!r})"
