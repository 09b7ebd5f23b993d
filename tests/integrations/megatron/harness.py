"""megatron-core 0.16.1 on this CPU over gloo, for the tests: build a `GPTModel` on every
TP x PP rank, re-draw its weights from a seed, run its stages by hand, take an optimizer step.

What it takes to run Megatron here (docs/megatron.md, "Running it on a CPU"):

- `torch.cuda.current_device` answers the CPU (Megatron calls it for its global memory
  buffer and RoPE), and `Tensor.cuda` is a no-op while a tied PP > 1 model is built (it
  moves the embedding before its embedding-group all-reduce);
- `initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)`;
- an explicit boolean causal mask (Megatron's default one is built on CUDA);
- Megatron's pipeline schedule hard-codes CUDA: the stages run by hand here
  (`set_input_tensor`, gloo send/recv between a stage and the next).

Test code, not hal's: the CPU patches are device-specific and live here, not under hal/.
"""

from __future__ import annotations

import contextlib
import importlib.util
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

# The tests' skips: found, not imported (the cpu lane collects the files and leaves them out by
# their marker; importing megatron-core there would cost every worker seconds)
NEEDS = [
    pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} is not installed: {why}")
    for module, why in (("megatron", "the [megatron] extra"), ("vllm", "the [vllm] extra (WeightSync needs it)"), ("transformers", "the [vllm] extra"))
]

# 8 query heads in 4 groups: two query groups per TP rank at TP=2 (one group per rank hides
# a wrong q/k/v de-interleave); head_dim 32 (one vLLM's CPU attention takes)
DIMS = dict(hidden_size=256, num_attention_heads=8, num_query_groups=4, kv_channels=32, ffn_hidden_size=384, num_layers=4)
VOCAB = 128
SEQ = 16
EPS = 1e-6
STD = 0.06  # of every matrix: logits of a few units, so fp32 noise stays under the 1e-5 the logits check allows
ROPE_THETA = 10000.0


@dataclass
class Rank:
    """One rank's Megatron model and its place."""

    model: Any
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    tied: bool
    ep_rank: int = 0
    qwen2: bool = False  # q/k/v biases (Qwen2's attention)


@contextlib.contextmanager
def cpu_patches(*, building: bool = False) -> Iterator[None]:
    """The two in-process patches megatron-core 0.16.1 needs on the CPU (module doc):
    `current_device` answers the CPU for the rest of the process (every forward asks it);
    `Tensor.cuda` is a no-op while `building` only."""
    torch.cuda.current_device = _cpu
    real_cuda = torch.Tensor.cuda
    if building:
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = real_cuda


def _cpu() -> str:
    return "cpu"


def build(tp: int, pp: int, *, tied: bool = False, seed: int = 0, qwen2: bool = False) -> Rank:
    """This rank's GPTModel (Llama shape: RMSNorm, SwiGLU, GQA, RoPE; `qwen2`: with Qwen2's
    q/k/v biases) with weights re-drawn from `seed` (Megatron's default init sets every norm
    to 1, which hides swapped norms)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import TransformerConfig

    with cpu_patches(building=True):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        config = TransformerConfig(
            **DIMS, normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, bias_activation_fusion=False,
            masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=EPS,
            add_qkv_bias=qwen2,
        )
        model = GPTModel(
            config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB, max_sequence_length=256,
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=tied, position_embedding_type="rope", rotary_base=int(ROPE_THETA),
        )
    rank = Rank(model, ps.get_tensor_model_parallel_rank(), tp, ps.get_pipeline_model_parallel_rank(), pp, tied, qwen2=qwen2)
    redraw(rank, seed)
    return rank


def redraw(rank: Rank, seed: int) -> None:
    """Every parameter from a generator seeded by its name and stage (and its TP rank when it
    is split across TP): replicas on the TP ranks of a stage get the same values, norms scattered
    around 1, matrices std `STD`. A tied model's last-stage output layer copies the
    embedding's draw (as Megatron's embedding group keeps them equal)."""
    with torch.no_grad():
        for name, param in rank.model.named_parameters():
            split = bool(getattr(param, "tensor_model_parallel", False))
            expert = getattr(param, "allreduce", True) is False  # Megatron's mark: another expert on every EP rank
            # keyed by stage too: the same local name on two stages is two layers (equal draws
            # there would hide a wrong global layer index)
            key = f"{name}@stage{rank.pp_rank}"
            if rank.tied and name == "output_layer.weight":
                key = "embedding.word_embeddings.weight@stage0"
            shard = (rank.tp_rank * 7919 if split else 0) + (rank.ep_rank * 104729 if expert else 0)
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()) + shard)
            draw = torch.randn(param.shape, generator=g)
            param.copy_(1.0 + 0.1 * draw if param.dim() == 1 else STD * draw)
        for name, buffer in rank.model.named_buffers():
            if name.endswith("router.expert_bias"):  # a buffer that travels: drawn too, the same on every rank
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{name}@stage{rank.pp_rank}".encode()))
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=g))


def causal_mask(seq: int) -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # True: masked


def _pp_peer(rank: Rank, step: int) -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_next_rank() if step > 0 else ps.get_pipeline_model_parallel_prev_rank()


def forward(rank: Rank, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor | None:
    """The stages by hand: each stage receives its input from the previous one (gloo), runs,
    sends its output to the next. The last stage returns its vocab-parallel logits (or the
    per-token loss with `labels`); the others None. Keeps what backward needs on `rank`."""
    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = causal_mask(seq)
    first, last = rank.pp_rank == 0, rank.pp_rank == rank.pp_size - 1
    with cpu_patches():
        if first:
            rank.model.set_input_tensor(None)
            received = None
        else:
            received = torch.empty(seq, batch, DIMS["hidden_size"])
            dist.recv(received, src=_pp_peer(rank, -1))
            received.requires_grad_(True)
            rank.model.set_input_tensor(received)
        out = rank.model(tokens if first else None, positions, mask, labels=labels if last else None)
    rank._received, rank._out = received, out  # type: ignore[attr-defined]
    if not last:
        dist.send(out.detach().contiguous(), dst=_pp_peer(rank, +1))
        return None
    return out


def backward(rank: Rank, loss: torch.Tensor | None) -> None:
    """Backward through the stages by hand, last to first (the input's grad goes back over gloo)."""
    last = rank.pp_rank == rank.pp_size - 1
    with cpu_patches():
        if last:
            loss.backward()
        else:
            grad = torch.empty_like(rank._out)  # type: ignore[attr-defined]
            dist.recv(grad, src=_pp_peer(rank, +1))
            rank._out.backward(grad)  # type: ignore[attr-defined]
        if rank.pp_rank > 0:
            dist.send(rank._received.grad.contiguous(), dst=_pp_peer(rank, -1))  # type: ignore[attr-defined]


def train_step(rank: Rank, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One optimizer step on a batch drawn from `step` (the same batch on every rank)."""
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    loss = forward(rank, tokens, labels)
    backward(rank, loss.mean() if loss is not None else None)
    optimizer.step()
    optimizer.zero_grad()


def full_logits(rank: Rank, tokens: torch.Tensor) -> torch.Tensor | None:
    """Megatron's logits of `tokens` (every TP rank's vocab columns, gathered here, in the
    test), on the last stage's TP rank 0; None elsewhere."""
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        out = forward(rank, tokens)
    if out is None:
        return None
    parts = [torch.empty_like(out) for _ in range(rank.tp_size)]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1) if rank.tp_rank == 0 else None


def hf_config(tied: bool, qwen2: bool = False) -> Any:
    """The Hugging Face config of the model `build` makes."""
    from transformers import LlamaConfig, Qwen2Config

    return (Qwen2Config if qwen2 else LlamaConfig)(
        vocab_size=VOCAB, hidden_size=DIMS["hidden_size"], intermediate_size=DIMS["ffn_hidden_size"],
        num_hidden_layers=DIMS["num_layers"], num_attention_heads=DIMS["num_attention_heads"],
        num_key_value_heads=DIMS["num_query_groups"], head_dim=DIMS["kv_channels"], rms_norm_eps=EPS,
        rope_theta=ROPE_THETA, max_position_embeddings=256, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
        torch_dtype="float32",
    )


def gather_hf(source: Any) -> dict[str, torch.Tensor] | None:
    """The whole Hugging Face state, assembled on world rank 0 from every rank's pieces (the
    test's gather, to compare against; the sync never does this). None elsewhere."""
    from hal.integrations.megatron.convert import assemble
    from hal.sync.plan import Block

    mine = [(n, (p.tensor.clone(), p.shape, p.offsets) if isinstance(p, Block) else p.clone()) for n, p in source.local_tensors()]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return None
    pieces = [[(n, Block(*p) if isinstance(p, tuple) else p) for n, p in held] for held in everyone]
    return assemble(pieces)


def logits_gap(rank: Rank, source: Any, seed: int = 7) -> float | None:
    """Max |Megatron's logits - transformers' logits| on one batch, transformers running on
    the Hugging Face state hal's rules make of every rank's shards (on world rank 0; None
    elsewhere). Megatron's own forward is the independent check of the name and layout rules."""
    hf = gather_hf(source)
    tokens = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    logits = full_logits(rank, tokens)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, logits)
    if dist.get_rank() != 0:
        return None
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    reference = (Qwen2ForCausalLM if rank.qwen2 else LlamaForCausalLM)(hf_config(rank.tied, rank.qwen2)).eval()
    result = reference.load_state_dict(hf, strict=False)
    expected_missing = ["lm_head.weight"] if rank.tied else []
    if list(result.missing_keys) != expected_missing or result.unexpected_keys:
        raise AssertionError(f"the converted state does not fit transformers' model: {result}")
    with torch.no_grad():
        ref = reference(input_ids=tokens).logits
    megatron = next(x for x in everyone if x is not None)
    return float((ref - megatron).abs().max())


class StandInEngine:
    """An engine of one worker that is a thread of trainer rank 0's process (what
    tests/integrations/vllm/test_sharded.py's ThreadEngine is): at init it joins a group per
    sending rank, as the hal vLLM engine does, and receives every sync with
    `ShardedReceiver` into plain tensors, `weights`."""

    same_node = False
    num_workers = 1

    def __init__(self, specs: list[Any], *, name: str = "stand-in") -> None:
        self.specs, self.name = specs, name
        self.weights = {spec.name: torch.zeros(spec.shape, dtype=spec.dtype) for spec in specs}
        self.groups: list[Any] = []
        self.version = ""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from hal.integrations.vllm import HalInitInfo
        from hal.sync import BroadcastTransport, ShardedReceiver
        from hal.sync.wire import SyncGroupSpec, join_sync_group

        info = HalInitInfo(**init_info)
        for address, port in info.endpoints():
            spec = SyncGroupSpec(address=address, port=port, world_size=info.world_size)
            self.groups.append(join_sync_group(spec, info.rank_offset, backend="gloo", timeout_s=info.timeout_s))
        self.receiver = ShardedReceiver([BroadcastTransport(g, src=0) for g in self.groups], self.specs, timeout_s=info.timeout_s)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        from hal.sync import copy_into

        self.receiver.receive(copy_into(self.weights))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.version = weight_version or self.version

    def update_weight_version(self, weight_version: str) -> None:
        self.version = weight_version

    def get_weight_version(self) -> str:
        return self.version

    def reset_prefix_cache(self) -> None:
        pass

    def shutdown_weight_transfer_engine(self) -> None:
        from hal.sync.wire import destroy_sync_group

        groups, self.groups = self.groups, []
        for group in groups:
            destroy_sync_group(group)


def own_bytes(rank: Rank) -> int:
    """What this rank holds that no other rank does, plus its part of what its stage's TP
    ranks all hold (norms: split between them), in bytes: its share of the model, counted
    from Megatron's parameters, not from hal's plan."""
    total = 0
    for name, param in rank.model.named_parameters():
        if rank.tied and name == "output_layer.weight":
            continue
        n = param.numel() * param.element_size()
        if getattr(param, "tensor_model_parallel", False):
            total += n
        else:  # replicated over the stage's TP ranks: torch.chunk's rows of it
            rows = param.shape[0]
            size = -(-rows // rank.tp_size)
            lo = min(rank.tp_rank * size, rows)
            total += (min(lo + size, rows) - lo) * (n // rows)
    return total


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    import hashlib

    return {n: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16] for n, t in tensors.items()}


class VerlMegatronEngine:
    """A stand-in for verl 0.9.1's `MegatronEngine` (verl/workers/engine/megatron/
    transformer_impl.py) with the attributes hal reads: `engine_config.strategy`
    ("megatron", verl/workers/config/engine.py:211), `module` (the list of chunks, line 581),
    `peft_cls` (435), `_qat_enabled` (211), `_is_offload_param` (197),
    `model_config.hf_config` (its Hugging Face config)."""

    def __init__(self, model: Any, *, model_type: str = "llama", **attributes: Any) -> None:
        from types import SimpleNamespace

        config = hf_config(False)
        if model_type != "llama":
            config = SimpleNamespace(model_type=model_type, vocab_size=VOCAB)
        self.engine_config = SimpleNamespace(strategy="megatron")
        self.module = [model]
        self.peft_cls = None
        self._qat_enabled = False
        self._is_offload_param = False
        self.model_config = SimpleNamespace(hf_config=config)
        for name, value in attributes.items():
            setattr(self, name, value)

    def get_per_tensor_param(self, **kwargs: Any) -> Any:  # verl's generator: never called by hal with senders "all"
        raise AssertionError("hal called the Megatron engine's weight generator, which gathers every tensor")


# ---- MoE: a Qwen3-MoE-shaped model (q/k norms, a router, experts) with expert parallelism ----
MOE_DIMS = dict(hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=32, ffn_hidden_size=256, num_layers=2)
EXPERTS, TOPK, MOE_FFN = 4, 2, 64


def build_moe(ep: int, *, expert_bias: bool = False, seed: int = 0) -> Rank:
    """This rank's MoE GPTModel: TP=1, PP=1, `ep` expert-parallel ranks (the data-parallel
    ranks), all-gather token dispatch. `expert_bias`: a sigmoid router with Megatron's
    `router.expert_bias` buffer (DeepSeek-V3's e_score_correction_bias); else a softmax
    top-k router, as Qwen3-MoE's (its logits are compared with transformers')."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import TransformerConfig

    # megatron-core 0.16.1 reads Transformer Engine's `te_general_gemm` in its router's
    # gating without defining it when TE is absent (NameError): None is its "no TE" value
    moe_utils.te_general_gemm = None
    with cpu_patches(building=True):
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=ep)
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        config = TransformerConfig(
            **MOE_DIMS, normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32, bias_activation_fusion=False,
            masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=EPS,
            num_moe_experts=EXPERTS, moe_ffn_hidden_size=MOE_FFN, moe_router_topk=TOPK, moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, qk_layernorm=True,
            expert_model_parallel_size=ep, moe_router_enable_expert_bias=expert_bias,
            moe_router_score_function="sigmoid" if expert_bias else "softmax",
        )
        spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm")
        model = GPTModel(
            config, spec, vocab_size=VOCAB, max_sequence_length=256, pre_process=True, post_process=True,
            share_embeddings_and_output_weights=False, position_embedding_type="rope", rotary_base=int(ROPE_THETA),
        )
    rank = Rank(model, 0, 1, 0, 1, False, ep_rank=ps.get_expert_model_parallel_rank())
    redraw(rank, seed)
    return rank


def moe_reference(hf: dict[str, torch.Tensor]) -> Any:
    """transformers' Qwen3-MoE on the per-expert Hugging Face state (the checkpoint's names,
    which vLLM loads); transformers 5 keeps each layer's experts fused (`gate_up_proj`
    (E, 2I, H), `down_proj` (E, H, I)), filled here from them."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=MOE_DIMS["hidden_size"], intermediate_size=MOE_DIMS["ffn_hidden_size"],
        num_hidden_layers=MOE_DIMS["num_layers"], num_attention_heads=MOE_DIMS["num_attention_heads"],
        num_key_value_heads=MOE_DIMS["num_query_groups"], head_dim=MOE_DIMS["kv_channels"], rms_norm_eps=EPS,
        rope_theta=ROPE_THETA, max_position_embeddings=256, tie_word_embeddings=False, num_experts=EXPERTS,
        num_experts_per_tok=TOPK, moe_intermediate_size=MOE_FFN, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        attention_bias=False, torch_dtype="float32",
    )
    model = Qwen3MoeForCausalLM(config).eval()
    state = {n: t for n, t in hf.items() if ".experts." not in n}
    for layer in range(MOE_DIMS["num_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        state[p + "gate_up_proj"] = torch.stack([torch.cat([hf[f"{p}{e}.gate_proj.weight"], hf[f"{p}{e}.up_proj.weight"]]) for e in range(EXPERTS)])
        state[p + "down_proj"] = torch.stack([hf[f"{p}{e}.down_proj.weight"] for e in range(EXPERTS)])
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise AssertionError(f"the converted MoE state does not fit transformers' Qwen3-MoE: {result}")
    return model
