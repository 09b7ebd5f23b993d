"""What the vLLM engine keeps around vLLM's layerwise reload (hal.integrations.vllm).

- `CarryArena`: memory for received tensors that wait for the rest of their layer.
- `kernel_layout` / `layout_changes`: the shapes and dtypes the model computes with, taken
  when the engine starts and compared before each sync. The reload copies each layer's
  processed tensors back into the layer's kernel tensors, so a parameter that something
  else laid out anew in between (vllm-ascend 0.23's `NPUWorker.wake_up` transposes MoE
  expert weights back to the checkpoint's layout) would make it fail half-way.
"""

from __future__ import annotations

import torch

import hal


class CarryArena:
    """Reused memory for received tensors that a layerwise reload keeps past their bucket.

    A layer split across buckets is only processed when its last tensor arrives; its
    earlier tensors must outlive their bucket. Copying them here instead of cloning
    avoids allocating (and page-faulting) fresh memory every sync. Reset at the start of
    each sync only, so tensors that vLLM keeps until the end of the reload stay valid.
    Grows to the most a sync needed, up to `cap_bytes`; beyond that, tensors are cloned.
    """

    ALIGN = 64

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.buf: torch.Tensor | None = None
        self.used = 0
        self.wanted = 0

    def reset(self) -> None:
        if self.wanted > (0 if self.buf is None else self.buf.numel()):
            self.buf = None  # free before allocating the larger one
            self.buf = hal.current().empty(min(self.wanted, self.cap_bytes))
        self.used = 0
        self.wanted = 0

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        end = self.used + -(-nbytes // self.ALIGN) * self.ALIGN
        self.wanted = max(self.wanted, end)
        if self.buf is None or end > self.buf.numel() or not tensor.is_contiguous():
            return tensor.clone()
        out = self.buf[self.used : self.used + nbytes].view(tensor.dtype).view(tensor.shape)
        hal.current().copy_(out, tensor)  # on the current stream, which the loader's copies follow
        self.used = end
        return out


def kernel_layout(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, tuple[int, ...], torch.dtype]]:
    """`{name: (parameter, shape, dtype)}` of every parameter `model` computes with, now."""
    return {name: (p, tuple(p.shape), p.dtype) for name, p in model.named_parameters()}


def layout_changes(layout: dict[str, tuple[torch.Tensor, tuple[int, ...], torch.dtype]], model: torch.nn.Module) -> list[str]:
    """Each parameter of `model` that is not the tensor `layout` holds for its name, or not of
    its shape and dtype, named with both layouts. A layerwise reload keeps each kernel tensor
    (it copies into it), so a different tensor means something else laid the weights out
    anew; by shape alone a transpose of a square matrix would pass."""
    changes = []
    for name, p in model.named_parameters():
        was = layout.get(name)
        if was is None:
            continue
        kernel, shape, dtype = was
        now = (tuple(p.shape), p.dtype)
        if p is not kernel or now != (shape, dtype):
            what = "another tensor" if p is not kernel else "the same tensor"
            changes.append(f"parameter {name!r}: {what} since the engine started (shape {shape}, {dtype} at start, now {now[0]}, {now[1]})")
    return changes
