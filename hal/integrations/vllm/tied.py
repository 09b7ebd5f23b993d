"""Tied embeddings after a weight update: every module that shares its weight with an
earlier one (`lm_head` with `embed_tokens`) computes with the current shared weight again
(`refresh_tied_weights`). It reads and writes vLLM's layers through the accessors of
hal.integrations.vllm.internals only (`quant_method_of`, `embedding_method`,
`derived_linear`, ...), which name what they touch; why it is needed: docs/platform-notes.md.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hal.integrations.vllm import internals as vllm_internals

_warned_tied: set[str] = set()


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Modules that share a parameter with a module met earlier in `model.named_modules()`:
    `{alias: owner}` (`{"lm_head": "model.embed_tokens"}`), empty for an untied model. The
    earlier one is the owner, as in vLLM's `AutoWeightsLoader`, which loads a tied parameter
    under the first name module traversal reaches."""
    owner_of: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owner = owner_of.setdefault(id(param), name)
            if owner != name:
                aliases.setdefault(name, owner)
    return aliases


def refresh_tied_weights(model: torch.nn.Module) -> list[str]:
    """After a weight update, make every tied alias compute with the current shared weight;
    returns the aliases refreshed (`["lm_head"]` for a tied model on vLLM-CPU, else `[]`).

    The owner's packed copy is always current: the reload re-processes the owner whenever
    the shared values change (and, on a failed reload, puts back the old values with the
    old copy). So the alias takes the owner's `cpu_linear`: no repack, one packed copy
    fewer in memory. An owner without one (not processed by the unquantized embedding
    method), or an alias whose method is a subclass with processing of its own (vllm-ascend's
    310P embedding method), makes the alias re-run its own processing, as vLLM does at load. Cheap where
    there is nothing to do (a pass over the modules' own parameters); no device checks:
    where nothing is derived from the weight (CUDA) there is no `cpu_linear` and nothing happens.
    """
    embedding_method = vllm_internals.embedding_method()
    modules = dict(model.named_modules())
    refreshed: list[str] = []
    for alias, owner in tied_aliases(model).items():
        module, owner_module = modules[alias], modules[owner]
        quant_method = vllm_internals.quant_method_of(module)
        if quant_method is None:
            continue  # a plain torch module: nothing is derived from its weight
        if not isinstance(quant_method, embedding_method):
            _warn_tied_once(alias, owner, quant_method)
            continue
        if vllm_internals.has_own_processing(quant_method):
            # a platform's own embedding method (vllm-ascend's 310P one derives `weight_nz`
            # and computes logits from it): what it derives is its business, so the alias
            # runs it again, as vLLM does at load
            _reprocess(module, alias, owner, owner_module, quant_method)
            refreshed.append(alias)
            continue
        derived = vllm_internals.derived_linear(module)
        if derived is None or derived is torch.nn.functional.linear:
            continue  # no packed copy: the layer computes from its weight on every call
        current = vllm_internals.derived_linear(owner_module)
        if derived is current:
            continue  # already the owner's, which the reload keeps current
        if current is not None and isinstance(vllm_internals.quant_method_of(owner_module), embedding_method):
            vllm_internals.share_derived_linear(module, owner_module)
        else:
            _reprocess(module, alias, owner, owner_module, quant_method)
        refreshed.append(alias)
    return refreshed


def _reprocess(module: torch.nn.Module, alias: str, owner: str, owner_module: torch.nn.Module, quant_method: Any) -> None:
    shared = {id(p) for p in owner_module.parameters(recurse=False)}
    before = {n: p for n, p in module.named_parameters(recurse=False) if id(p) in shared}
    with torch.no_grad():
        vllm_internals.rerun_processing(quant_method, module)
    after = dict(module.named_parameters(recurse=False))
    broken = sorted(n for n, p in before.items() if after.get(n) is not p)
    if broken:
        raise RuntimeError(
            f"module {alias!r}: re-running {type(quant_method).__name__}.process_weights_after_loading replaced "
            f"{broken} that it shares with {owner!r}; the tie is broken (a vLLM change?)"
        )


def _warn_tied_once(alias: str, owner: str, quant_method: Any) -> None:
    kind = type(quant_method).__name__
    if kind in _warned_tied:
        return
    _warned_tied.add(kind)
    logging.getLogger(__name__).warning(
        "module %r shares its weight with %r but uses quant method %s: state it derives from the weight is not "
        "rebuilt after a weight update (only the unquantized embedding method is known to be safe)",
        alias, owner, kind,
    )
