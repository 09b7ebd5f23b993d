"""Each worker's needs, recorded from vLLM's own loaders (issue 41): the model in vLLM's
layerwise-reload state with each loadable tensor's original loader wrapped, and back.

hal.integrations.vllm.recording drives `model.load_weights` once against stand-in tensors
inside that state (every loadable tensor on the meta device, in the checkpoint layout of
the worker's shard; the kernel tensors kept aside), each tensor's loader wrapped so it
knows whose loader runs; afterwards every layer gets its kernel tensors back untouched.
The reload's module, its per-layer state (`LAYERWISE_INFO`, `LayerReloadingInfo`) and its
helpers are private to vLLM. A module apart from `reload` (an update's reload); its last
block is what the landing of received pieces into a layer of a reload reaches (vLLM's
staging and per-layer processing: hal.integrations.vllm.landing).
"""

from __future__ import annotations

import contextlib
import typing
from typing import Any, Callable, Iterator

import torch
from torch.nn import Parameter

from hal.integrations.vllm.internals.reload import LAYERWISE_MODULE, initialize_layerwise_reload
from hal.integrations.vllm.internals.versions import require_supported_vllm, vllm_release

# The reload's modules beside LAYERWISE_MODULE: the meta tensors' rules, a layer's tensors.
RELOAD_META_MODULE = "vllm.model_executor.model_loader.reload.meta"
RELOAD_UTILS_MODULE = "vllm.model_executor.model_loader.reload.utils"
# Tensors no loader writes (expert maps, `e_score_correction_bias`): `SKIP_LOAD_TENSORS`
# from 0.27, when vLLM split it from `SKIP_TENSORS` (those and `bias`, which from then on
# stays live during a reload); before it `SKIP_TENSORS` alone, and `bias` goes to meta.
SKIP_LOAD_TENSORS_SINCE = (0, 27)
# A tensor's loader (`param.weight_loader(param, loaded_weight, ...)`; none: vLLM's
# `default_weight_loader`, which `_get_original_loader` answers then), and the elements its
# creator counts as loadable when it pads the tensor (fused MoE weights of a padded hidden
# size, 0.32 on; read with a fallback, as vLLM's own `get_tensor_load_numel` reads it).
LOADER_ATTR = "weight_loader"
LOADABLE_NUMEL_ATTR = "weight_loader_numel"
# Set on the model by `initialize_layerwise_reload` (and put back by its finalize).
TORCHAO_FLAGS = ("_do_torchao_reload", "_original_do_torchao_reload")


class ReloadTarget(typing.NamedTuple):
    """A tensor loaders write during a layerwise reload: `name` of module `module` (named
    `layer` in the model), on the meta device (a live `bias` from vLLM 0.27 on)."""

    layer: str
    module: torch.nn.Module
    name: str
    tensor: torch.Tensor
    padding: int
    """Elements its creator declared as padding (`LOADABLE_NUMEL_ATTR`)."""


def _skip_load_names() -> frozenset[str]:
    import importlib

    meta = importlib.import_module(RELOAD_META_MODULE)
    return frozenset(meta.SKIP_LOAD_TENSORS if vllm_release() >= SKIP_LOAD_TENSORS_SINCE else meta.SKIP_TENSORS)


def reload_in_progress(model: torch.nn.Module) -> bool:
    """Whether any layer of `model` is inside a layerwise reload (`LAYERWISE_INFO[layer].can_load()`;
    on vLLM 0.23-0.24 the worker starts one at every update)."""
    import importlib

    info = importlib.import_module(LAYERWISE_MODULE).LAYERWISE_INFO
    return any(info[m].can_load() for m in model.modules() if m in info)


def _loader_of(tensor: torch.Tensor) -> tuple[bool, Any]:
    return (True, getattr(tensor, LOADER_ATTR)) if hasattr(tensor, LOADER_ATTR) else (False, None)


def _put_loader(tensor: torch.Tensor, had: bool, loader: Any) -> None:
    if had:
        setattr(tensor, LOADER_ATTR, loader)
    elif hasattr(tensor, LOADER_ATTR):
        delattr(tensor, LOADER_ATTR)


@contextlib.contextmanager
def loaders_on_meta(model: torch.nn.Module, wrap: Callable[[str, str, Callable[..., Any]], Callable[..., Any]]) -> Iterator[list[ReloadTarget]]:
    """`model` in vLLM's layerwise-reload state for the length of the block, each loadable
    tensor's loader replaced by `wrap(layer name, tensor name, original loader)` (the
    original: not vLLM's `online_process_loader`, which would count and buffer the load);
    yields those tensors, in model order. On exit, whatever happened, every layer gets its
    kernel tensors back (the same objects), every tensor the loader it had (vLLM keeps the
    meta tensors for its next reload), each module its non-persistent buffer names and the
    model its torchao flags: the model computes as before. Refused while a reload is in
    progress (it would end it)."""
    import importlib

    require_supported_vllm()
    if reload_in_progress(model):
        raise RuntimeError("hal's recording of this worker's needs: a layerwise reload is in progress; record between updates")
    layerwise = importlib.import_module(LAYERWISE_MODULE)
    tensors_of = importlib.import_module(RELOAD_UTILS_MODULE).get_layer_tensors
    skip = _skip_load_names()
    modules = list(model.named_modules())
    live = [(t, *_loader_of(t)) for _, m in modules for t in tensors_of(m).values()]
    non_persistent = [(m, set(m._non_persistent_buffers_set)) for _, m in modules]
    flags = {k: vars(model)[k] for k in TORCHAO_FLAGS if k in vars(model)}
    wrapped: list[tuple[torch.Tensor, bool, Any]] = []
    try:
        initialize_layerwise_reload(model)
        targets, seen = [], set()
        for layer, module in modules:
            info = layerwise.LAYERWISE_INFO.get(module)
            if info is None or not info.can_load():
                continue
            for name, tensor in tensors_of(module).items():
                # vLLM's reload leaves the skipped tensors live; a parameter among them is
                # still a checkpoint tensor its model's loader writes (DeepSeek-V3's router
                # `e_score_correction_bias`): watched, so that its copy is recorded
                if (name in skip and not isinstance(tensor, Parameter)) or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                wrapped.append((tensor, *_loader_of(tensor)))
                setattr(tensor, LOADER_ATTR, wrap(layer, name, layerwise._get_original_loader(tensor)))
                padding = tensor.numel() - getattr(tensor, LOADABLE_NUMEL_ATTR, tensor.numel())
                targets.append(ReloadTarget(layer, module, name, tensor, padding))
        yield targets
    finally:
        for _, module in modules:
            info = layerwise.LAYERWISE_INFO.get(module)
            if info is not None and info.can_load():
                if info.kernel_tensors is not None:
                    layerwise._place_kernel_tensors(module, info)
                info.reset()
        for tensor, had, loader in (*reversed(wrapped), *live):
            _put_loader(tensor, had, loader)
        for module, names in non_persistent:  # in place: vLLM 0.23 registers every buffer back as persistent
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(names)
        for key in TORCHAO_FLAGS:
            if key in flags:
                setattr(model, key, flags[key])
            elif key in vars(model):
                delattr(model, key)


# ---- landing pieces into the layers of a reload ------------------------------------------
# hal.integrations.vllm.landing lands a shard receive's pieces in a layer of the reload in
# progress, in the checkpoint layout vLLM's own loaders would write, and has vLLM process
# the layer. It reaches `LAYERWISE_INFO[layer]` (the layer's reload state), vLLM's staging of
# a layer (`materialize_layer`) and its per-layer processing (`_layerwise_process`).
# A layer vLLM processes only when the reload ends, with a `process_weights_after_loading`
# of its own (attention layers and their scales: `_finalize_attention_layer`), is not one a
# landing completes: the module attribute that says so.
OWN_PROCESSING_ATTR = "process_weights_after_loading"


def _reload_info(module: torch.nn.Module) -> Any:
    import importlib

    info = importlib.import_module(LAYERWISE_MODULE).LAYERWISE_INFO.get(module)
    return info if info is not None and info.can_load() else None


def layer_in_reload(module: torch.nn.Module) -> bool:
    """Whether `module` is a layer of the layerwise reload in progress, not processed yet."""
    return _reload_info(module) is not None


def processed_at_end(module: torch.nn.Module) -> bool:
    """Whether vLLM's reload processes `module` only when the reload ends, with its own
    `process_weights_after_loading(dtype)` (attention layers: vLLM defers them)."""
    return callable(getattr(module, OWN_PROCESSING_ATTR, None))


def materialize_layer(module: torch.nn.Module) -> None:
    """vLLM's own staging of a layer of the reload: each of its tensors on the meta device
    becomes an empty tensor of its shape on the layer's device (`materialize_layer`), which
    vLLM's loaders would write and its processing reads. Tensors vLLM keeps live during a
    reload (`bias` from 0.27) stay as they are."""
    import importlib

    info = _reload_info(module)
    if info is None:
        raise RuntimeError(f"{type(module).__name__}: not a layer of a layerwise reload in progress")
    importlib.import_module(RELOAD_META_MODULE).materialize_layer(module, info)


def process_layer(module: torch.nn.Module) -> None:
    """vLLM's own processing of a layer whose tensors are all in place, as its reload runs
    it when a layer's last tensor arrives (`_layerwise_process`), with nothing buffered:
    the layer's `quant_method.process_weights_after_loading` (repacking, quantization;
    the experts' post-load step when `reprocess_experts_on_reload` is on), the processed
    values copied into the tensors the layer computes with, those put back; the layer's
    reload then ends. Refused for a layer that got a load through its loaders in this
    reload (vLLM would load it again over what landed)."""
    import importlib

    info = _reload_info(module)
    if info is None:
        raise RuntimeError(f"{type(module).__name__}: not a layer of a layerwise reload in progress")
    if info.loaded_weights:
        names = sorted({name for name, _ in info.loaded_weights})
        raise RuntimeError(f"{type(module).__name__}: {names} were loaded through vLLM's loaders in this reload as well")
    importlib.import_module(LAYERWISE_MODULE)._layerwise_process(module, info)
