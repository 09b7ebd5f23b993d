"""What the weight-sync code may assume of a collective library (gloo, NCCL, HCCL).

These are properties of the library that moves the bytes, not of the device: a CUDA
tensor in a gloo group behaves like gloo. So they are looked up by the
`torch.distributed` backend name (`collective_traits(backend.dist_backend)`), never
declared by a device backend. Code here may assume nothing but the name it is given;
it imports no collective library.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CONSERVATIVE_TRAITS", "CollectiveTraits", "collective_traits", "known_collective_libraries", "takes_device"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveTraits:
    """How one collective library orders work and which transfers it moves fastest."""

    follows_streams: bool
    """A collective issued while a device stream is current is ordered after the work
    already queued on that stream, so no host wait is needed before it. From the
    libraries' stream semantics: NCCL and HCCL enqueue the operation on a communication
    stream that first waits on the issuing stream (torch.distributed's ProcessGroupNCCL /
    torch_npu's ProcessGroupHCCL). gloo runs on host threads and reads the tensor when
    the call is made: the host must wait for the producing work first. False is always
    correct (the host then waits); True where it is not true corrupts data."""

    point_to_point_for_one_receiver: bool
    """With exactly one receiver, a sync's transfers go as send/recv pairs rather than as
    broadcasts. Measured, not derived: gloo runs each broadcast through its worker
    threads at about 1 ms each on a small host, and send/recv avoids that
    (docs/device.md, "Collective traits"). Not measured for NCCL/HCCL, so
    they keep broadcasts, which are always correct."""

    point_to_point_device_memory: bool
    """send/recv read and write device memory. gloo's send/recv hand the tensor's pointer
    to the socket, so a CUDA tensor fails there ("writev ... Bad address", seen on an
    H100 with torch 2.11), while its broadcast and all-reduce stage device tensors
    themselves; NCCL and HCCL move device memory only. False is always correct (a
    device tensor is staged through host memory for its point-to-point transfers)."""


# Safe for any library: the host waits before every collective, transfers are broadcasts,
# and device tensors go through host memory for point-to-point transfers.
CONSERVATIVE_TRAITS = CollectiveTraits(follows_streams=False, point_to_point_for_one_receiver=False, point_to_point_device_memory=False)

# torch.distributed backend name (lower case) -> its traits; see the field docs for sources.
_TRAITS: dict[str, CollectiveTraits] = {
    "gloo": CollectiveTraits(follows_streams=False, point_to_point_for_one_receiver=True, point_to_point_device_memory=False),
    "nccl": CollectiveTraits(follows_streams=True, point_to_point_for_one_receiver=False, point_to_point_device_memory=True),
    "hccl": CollectiveTraits(follows_streams=True, point_to_point_for_one_receiver=False, point_to_point_device_memory=True),
}


def known_collective_libraries() -> tuple[str, ...]:
    """The names `collective_traits` has measured or documented traits for."""
    return tuple(sorted(_TRAITS))


def collective_traits(dist_backend: str) -> CollectiveTraits:
    """The traits of the `torch.distributed` backend named `dist_backend` (case-insensitive).

    An unknown name (an out-of-tree library, or a mixed string such as
    ``"cuda:nccl,cpu:gloo"``, which names more than one) gets `CONSERVATIVE_TRAITS`:
    the host waits before each collective and transfers are broadcasts, which is
    correct for any library, only perhaps slower.

    >>> collective_traits("NCCL").follows_streams
    True
    """
    if not isinstance(dist_backend, str):
        raise TypeError(f"collective_traits: dist_backend must be a str, got {type(dist_backend).__name__}")
    return _TRAITS.get(dist_backend.strip().lower(), CONSERVATIVE_TRAITS)


def takes_device(dist_backend: str, device_type: str) -> bool:
    """Whether the `torch.distributed` backend named `dist_backend` runs collectives on
    tensors of `device_type` at all ("cpu", "cuda", "npu"), by torch's own table
    (`torch.distributed.Backend.backend_capability`, which torch_npu extends with "hccl"
    when imported).

    A group keeps one library per device type and fails a tensor of a device type it has
    none for ("No backend type associated with device type npu"): gloo serves "cpu" and
    "cuda" only, so a PrivateUse1 device such as torch_npu's NPU must move every transfer
    through host memory in a gloo group, broadcasts and all-reduces included, not only
    the point-to-point ones that `point_to_point_device_memory` covers.

    A library torch's table does not list (an out-of-tree one not imported yet, a mixed
    string) answers False, which is always correct (a host tensor staged through host
    memory is not copied at all).

    >>> takes_device("gloo", "npu")
    False
    """
    if not isinstance(dist_backend, str) or not isinstance(device_type, str):
        raise TypeError(f"takes_device: expected two str, got {type(dist_backend).__name__} and {type(device_type).__name__}")
    from torch.distributed import Backend  # imports no collective library

    capability = getattr(Backend, "backend_capability", {})
    return device_type.strip().lower() in capability.get(dist_backend.strip().lower(), ())


def control_on_host(dist_backend: str) -> bool:
    """Whether a group of the `torch.distributed` backend named `dist_backend` carries its
    small control messages (headers, statuses, agreements) in host memory: when one of its
    libraries takes host tensors (gloo, or a mixed "cuda:nccl,cpu:gloo" group), by
    `takes_device`. NCCL or HCCL alone move device memory only: the messages are then
    device tensors.

    >>> control_on_host("cuda:nccl,cpu:gloo"), control_on_host("nccl")
    (True, False)
    """
    if not isinstance(dist_backend, str):
        raise TypeError(f"control_on_host: dist_backend must be a str, got {type(dist_backend).__name__}")
    libraries = [item.rpartition(":")[2] for item in dist_backend.split(",") if item.strip()]
    return any(takes_device(library, "cpu") for library in libraries)

