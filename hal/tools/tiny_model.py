"""Tiny models of the families users train, built locally, for the demo, the tests and the benchmark.

    path = build_tiny_model("/tmp/tiny", TinyModelSpec(vocab_size=64))
    path = build_tiny_model("/tmp/tiny-q", TinyModelSpec(architecture="qwen2", tie_word_embeddings=True))
    path = build_tiny_model("/tmp/tiny-moe", TinyModelSpec(architecture="qwen3_moe", num_experts=8))
    llm = vllm.LLM(model=str(path), dtype="float32", ...)

No hub access: the model comes from a `transformers` config of its family (`ARCHITECTURES`:
Llama; Qwen2, whose q/k/v projections carry biases; Qwen3, with q/k norms; the MoE
families Qwen3-MoE, Qwen2-MoE (a shared expert beside the routed ones) and Mixtral), the
tokenizer is a `tokenizers` WordLevel model with
exactly `vocab_size` entries (vLLM checks that the tokenizer and the embedding agree).
Words are `t0`, `t1`, ...; ids 0-2 are `<unk>`, `<s>`, `</s>`. Everything is saved in
float32 safetensors so vLLM's fp32 greedy output equals Hugging Face's token for token.

`tie_word_embeddings=True` gives the layout of most small real models (Qwen2.5 0.5B-3B,
Qwen3 0.6B-4B, Llama 3.2): `lm_head` shares `embed_tokens`' weight, and the checkpoint
holds no `lm_head.weight` tensor (as Hugging Face saves it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

UNK, BOS, EOS = 0, 1, 2
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
# architecture -> (the transformers config class, whether it is a mixture of experts)
FAMILIES = {
    "llama": ("LlamaConfig", False),
    "qwen2": ("Qwen2Config", False),
    "qwen3": ("Qwen3Config", False),
    "qwen3_moe": ("Qwen3MoeConfig", True),
    "qwen2_moe": ("Qwen2MoeConfig", True),
    "mixtral": ("MixtralConfig", True),
}
ARCHITECTURES = tuple(FAMILIES)


@dataclass(kw_only=True, slots=True)
class TinyModelSpec:
    """Shape of the model; defaults give a ~0.4 M-parameter model that builds in a second."""

    vocab_size: int = 64
    """Embedding rows and tokenizer entries (at least 4: three special tokens and one word)."""
    hidden_size: int = 128
    """head_dim = hidden_size / num_attention_heads must be one vLLM's CPU attention supports (32 here)."""
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    init_std: float = 0.2
    """Std of the normal init of every matrix. Larger than transformers' 0.02 so greedy
    decoding is decisive (no near-ties that float noise could flip between engines)."""
    seed: int = 0
    architecture: str = "llama"
    """One of `ARCHITECTURES`: "llama" (no biases), "qwen2" (q/k/v biases), "qwen3" (q/k
    norms), "qwen3_moe", "qwen2_moe" (routed experts and a shared one), "mixtral"."""
    tie_word_embeddings: bool = False
    """Share one matrix between `embed_tokens` and `lm_head`; saved without `lm_head.weight`."""
    head_dim: int | None = None
    """Attention head size where the family takes one (Qwen3, Qwen3-MoE, Mixtral); None:
    hidden_size / num_attention_heads. vLLM 0.23's CPU attention needs 64."""
    num_experts: int = 8
    """Routed experts per MoE layer (MoE families only)."""
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    """Each routed expert's intermediate size (Mixtral's experts take `intermediate_size`)."""
    router_std: float | None = None
    """Std of the MoE routers' weights (None: `init_std`). Larger routes decisively, as a
    trained router does: top-k choices then sit far from a tie that a bf16 rounding could flip."""
    norm_std: float = 0.0
    """Std of a normal draw added to every norm weight's 1.0. 0 keeps transformers' ones;
    a nonzero value makes a norm that was not loaded, or loaded into the wrong place,
    change what the model computes."""

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture: expected one of {list(ARCHITECTURES)}, got {self.architecture!r}")
        if self.vocab_size < len(SPECIAL_TOKENS) + 1:
            raise ValueError(f"vocab_size: need at least {len(SPECIAL_TOKENS) + 1}, got {self.vocab_size}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.init_std <= 0:
            raise ValueError(f"init_std must be positive, got {self.init_std}")
        if self.router_std is not None and self.router_std <= 0:
            raise ValueError(f"router_std must be positive, got {self.router_std}")
        if self.head_dim is not None and self.head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {self.head_dim}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: expected 1..num_experts ({self.num_experts}), got {self.num_experts_per_tok}"
            )

    @property
    def moe(self) -> bool:
        """Whether this family routes tokens to experts."""
        return FAMILIES[self.architecture][1]

    def nbytes_fp32(self) -> int:
        """Bytes of all parameters in float32 (a tied embedding counted once): from the shape
        for Llama and Qwen2 (the benchmark's models, too large to build for a count), other
        families from their model built on the meta device."""
        if self.architecture not in ("llama", "qwen2"):
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(hf_config(self))
            return 4 * sum(p.numel() for p in model.parameters())
        h, i, v, n = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        kv = h // self.num_attention_heads * self.num_key_value_heads
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
        if self.architecture == "qwen2":
            per_layer += h + 2 * kv  # q, k, v biases
        embeddings = (1 if self.tie_word_embeddings else 2) * v * h
        return 4 * (embeddings + h + n * per_layer)


# About 0.63 GiB in fp32, 75 tensors: the size the benchmark asks for (at least 0.5 GiB).
BENCH_SPEC = TinyModelSpec(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    init_std=0.02,
)


def hf_config(spec: TinyModelSpec):
    """The `transformers` config of `spec`'s family (`LlamaConfig`, `Qwen3MoeConfig`, ...)."""
    import inspect

    import transformers

    config_cls = getattr(transformers, FAMILIES[spec.architecture][0])
    family: dict = {}
    if "head_dim" in inspect.signature(config_cls.__init__).parameters:
        # explicit: some configs default to a head size of their own (Qwen3: 128)
        family["head_dim"] = spec.head_dim or spec.hidden_size // spec.num_attention_heads
    elif spec.head_dim is not None and spec.head_dim != spec.hidden_size // spec.num_attention_heads:
        raise ValueError(f"head_dim: {config_cls.__name__} derives it from hidden_size / num_attention_heads")
    if spec.architecture in ("qwen3_moe", "qwen2_moe"):
        family.update(
            num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[],
        )
        if spec.architecture == "qwen2_moe":
            family["shared_expert_intermediate_size"] = spec.intermediate_size
    elif spec.architecture == "mixtral":
        family.update(num_local_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok)
    return config_cls(
        **family,
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=UNK,
        torch_dtype="float32",
        initializer_range=spec.init_std,
    )


def build_model(spec: TinyModelSpec):
    """A fresh model of `spec`'s family in float32, deterministically initialised from
    `spec.seed`. Tied: `lm_head.weight` is `model.embed_tokens.weight`."""
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(hf_config(spec), torch_dtype=torch.float32)
    with torch.no_grad():
        # named_parameters() lists a tied matrix once, under model.embed_tokens.weight
        routers = {f"{name}.weight" for name, module in model.named_modules() if name.endswith("mlp.gate")}
        for name, param in model.named_parameters():
            if param.dim() >= 2 or name.endswith(".bias"):
                std = spec.router_std if name in routers and spec.router_std is not None else spec.init_std
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            elif spec.norm_std:  # RMSNorm weights (q/k norms too), drawn around 1
                param.copy_(1.0 + torch.randn(param.shape, generator=generator) * spec.norm_std)
            else:  # ones, drawing nothing: the other tensors stay what the same seed gave before norm_std
                param.fill_(1.0)
    if spec.tie_word_embeddings and model.lm_head.weight is not model.get_input_embeddings().weight:
        raise RuntimeError(f"{type(model).__name__}: tie_word_embeddings=True but lm_head is not tied")
    model.eval()
    return model


def build_tokenizer(vocab_size: int):
    """A `PreTrainedTokenizerFast` over words `t3`..`t{vocab_size-1}` plus the special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(len(SPECIAL_TOKENS), vocab_size):
        vocab[f"t{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )
    if len(fast) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(fast)} entries, expected exactly vocab_size={vocab_size}")
    return fast


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write model (fp32 safetensors), config and tokenizer into `out_dir`; returns the path.

    Reuses the directory when it already holds a model built from the same spec (every
    field of the spec, architecture and tying included, is in the stamp).
    """
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    stamp = out / "hal_tiny_spec.json"
    wanted = json.dumps(asdict(spec), sort_keys=True)
    if stamp.exists() and stamp.read_text() == wanted and (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    if stamp.exists():
        # Our own earlier build from another spec: drop its weights first, so that neither
        # a build cut short nor a leftover shard passes for the new model.
        stamp.unlink()
        for old in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
            old.unlink()
    model = build_model(spec)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(spec.vocab_size).save_pretrained(out)
    stamp.write_text(wanted)
    return out


build_tiny_llama = build_tiny_model
"""The former name, kept for callers: it builds whatever `spec.architecture` says."""


def load_trainer_model(model_dir: str | Path):
    """The Hugging Face model from `model_dir` in float32 (the trainer's copy)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
