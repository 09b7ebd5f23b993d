"""Copies between host tensors made ready once (the host backends' `prepare_copies`).

torch's multi-tensor copy costs about a microsecond per pair on the host (each pair is a
full `copy_`: dispatch, overlap checks, an iterator), which for a segment of thousands
of 4 KiB tensors is several times the memcpy itself. A pair of small contiguous host
tensors of one dtype is a plain byte copy: made ready once as two memoryviews of their
bytes, it runs as a slice assignment (a memcpy) inside `map`, a fraction of that cost.
The rest (a cast, strides, larger tensors, another device) stays torch's copy.

The views hold their tensors, so their memory stays alive; they are valid while each
tensor keeps it (the same address and strides), which the sync checks before running
them again (hal.sync.plan.steady).
"""

from __future__ import annotations

import operator
from itertools import repeat

import torch

from hal.backends.hooks import copy_many_non_blocking

# Pairs up to this size go as bytes: past it torch's cost per pair is noise next to the
# copy, and torch copies large tensors with more threads, releasing the GIL meanwhile.
SMALL_BYTES = 1 << 20
# A memoryview copy holds the GIL; it is offered to other threads between runs of this many bytes.
RUN_BYTES = 4 << 20
_ALL = slice(None)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _as_bytes(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether a pair can be a plain byte copy: host tensors, one dtype, both contiguous,
    nothing lazy about them (a conjugate or negative view), small."""
    return (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and 0 < dst.nbytes == src.nbytes <= SMALL_BYTES
        and dst.is_contiguous()
        and src.is_contiguous()
        and not (dst.is_conj() or src.is_conj() or dst.is_neg() or src.is_neg())
        and type(dst) in (torch.Tensor, torch.nn.Parameter)
        and type(src) in (torch.Tensor, torch.nn.Parameter)
    )


class HostCopies:
    """`copy_many_(dsts, srcs)` made ready (see the module doc); `run()` does it."""

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        self.runs: list[tuple[list[memoryview], list[memoryview]]] = []
        self.dsts: list[torch.Tensor] = []
        self.srcs: list[torch.Tensor] = []
        run_dsts: list[memoryview] = []
        run_srcs: list[memoryview] = []
        run_bytes = 0
        for dst, src in zip(dsts, srcs):
            if not _as_bytes(dst, src):
                self.dsts.append(dst)
                self.srcs.append(src)
                continue
            run_dsts.append(_bytes_of(dst))
            run_srcs.append(_bytes_of(src))
            run_bytes += dst.nbytes
            if run_bytes >= RUN_BYTES:
                self.runs.append((run_dsts, run_srcs))
                run_dsts, run_srcs, run_bytes = [], [], 0
        if run_dsts:
            self.runs.append((run_dsts, run_srcs))

    def run(self) -> None:
        setitem = operator.setitem
        for dsts, srcs in self.runs:
            # one memcpy per pair, inside `map`: no Python step per tensor; `any` consumes it
            any(map(setitem, dsts, repeat(_ALL), srcs))
        if self.dsts:
            copy_many_non_blocking(self.dsts, self.srcs)
