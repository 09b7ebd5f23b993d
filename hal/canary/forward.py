"""The trainer's side of the canary: a module's log-probs of the probe (one batched forward,
resharding FSDP2 modules after it), its vocabulary size and dtype.
"""

from __future__ import annotations

import torch
from hal.canary.probe import Probe


# ---- the trainer's side ---------------------------------------------------------------------------
def module_logprobs(module: torch.nn.Module, probe: Probe) -> list[list[float]]:
    """The per-token log-probs of `probe` under `module` (a causal LM whose forward takes
    `input_ids` and returns logits, or an object with `.logits`): one batched forward
    without gradients, in eval mode (each submodule's mode is restored after). An FSDP2 module's
    forward is a collective: every rank of its group calls this in step; its modules are
    resharded after it (FSDP2 keeps the root's parameters unsharded after a forward, for
    the backward that follows in training: without this they stay plain full tensors). The
    log-softmax is taken in fp32 over the whole vocabulary, as vLLM takes it."""
    lengths = {len(s) for s in probe.sequences}
    first = next(iter(module.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    modes = [(sub, sub.training) for sub in module.modules()]  # each one's own: some may be frozen in eval
    module.eval()
    try:
        with torch.no_grad():
            if len(lengths) == 1:
                return _scores(module, torch.tensor(probe.sequences, device=device))
            out: list[list[float]] = []
            for seq in probe.sequences:  # unequal lengths: one forward each (no padding to get wrong)
                out.extend(_scores(module, torch.tensor([seq], device=device)))
            return out
    finally:
        _reshard(module)
        for sub, training in modes:
            sub.training = training


def _reshard(module: torch.nn.Module) -> None:
    """Put every FSDP2 module of `module` back to its sharded parameters (`FSDPModule.reshard`)."""
    import sys

    fsdp = sys.modules.get("torch.distributed.fsdp")  # a module is sharded only if its process imported FSDP
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is None:
        return
    for sub in module.modules():
        if isinstance(sub, fsdp_module):
            sub.reshard()


def _scores(module: torch.nn.Module, ids: torch.Tensor) -> list[list[float]]:
    output = module(input_ids=ids)
    logits = output if isinstance(output, torch.Tensor) else output.logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logprobs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).cpu().tolist()


def vocab_size_of(module: torch.nn.Module) -> int | None:
    """Rows of `module`'s input embedding (a transformers model's `get_input_embeddings()`), or None."""
    get = getattr(module, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    weight = getattr(embedding, "weight", None)
    return int(weight.shape[0]) if weight is not None else None


def dtype_of(module: torch.nn.Module) -> torch.dtype | None:
    """The dtype of `module`'s first floating-point parameter (what its forward computes in,
    short of autocast or mixed precision)."""
    for param in module.parameters():
        if param.dtype.is_floating_point:
            return param.dtype
    return None
