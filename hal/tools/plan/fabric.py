"""The link model of `hal plan`: what the links allow, the figure used and where it comes from.

The floor of a sync is the time its busiest port needs at the fabric's bandwidth: one port
(NIC, NVLink port, HCCS interface) per GPU or NPU on both sides, each moving its bytes in
one direction at `per_port` bytes/s, so max(largest worker in, largest sender out) /
per_port. On a mesh without a switch (Ascend 910B HCCS) a pair of devices shares one
link of `per_pair` bytes/s (1/7 of a device's total), so the largest link binds too:
max(that, largest link / per_pair). It ignores packing, landing and processing: it is what
the links allow, which is what the plan decides. Figures per direction, GB = 10^9 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Fabric:
    name: str
    per_port: float
    """Bytes/s per GPU/NPU per direction."""
    what: str
    source: str
    per_pair: float | None = None
    """Bytes/s per direction of one pair's link, on a mesh without a switch; None: no such limit."""
    third_party: bool = False
    """The figure is not the vendor's own."""


GB = 1e9
FABRICS = {
    "ib-ndr": Fabric(
        "ib-ndr", 50 * GB, "InfiniBand NDR, one 400 Gb/s NIC per GPU: 50 GB/s per direction",
        "ConnectX-7 NDR line rate (400 Gb/s); DeepSeek-V3's paper and deepseek-ai/DeepSeek-V3 issue #28 use 'IB (50 GB/s)'"),
    "nvlink4": Fabric(
        "nvlink4", 450 * GB, "NVLink4, H100 SXM: 450 GB/s per GPU per direction (900 GB/s both ways)",
        "NVIDIA H100 datasheet (900 GB/s NVLink); NVIDIA/nccl issue #1264 measured ~783 GB/s all-reduce bus bandwidth of the 900"),
    "hccs-910b": Fabric(
        "hccs-910b", 196 * GB,
        "Ascend 910B HCCS, Atlas 800T A2 (8 NPUs, full mesh, no switch): 28 GB/s per pair and 196 GB/s per NPU per direction",
        "third-party figure, not Huawei's: arthurchiao.art, 'GPU Performance (Data Sheets) Quick Reference' (56 GB/s per pair, "
        "392 GB/s per NPU, both ways); to be replaced by a measured one", per_pair=28 * GB, third_party=True),
}


def given(gb_per_s: float) -> Fabric:
    """`--bandwidth`: a figure of the user's, per port per direction."""
    if not gb_per_s > 0:
        raise ValueError(f"--bandwidth {gb_per_s}: a bandwidth in GB/s per port per direction, above 0")
    return Fabric("given", gb_per_s * GB, f"{gb_per_s:g} GB/s per port per direction", "given on the command line (--bandwidth)")


@dataclass(frozen=True, slots=True)
class Floor:
    seconds: float
    binds: str
    """What takes the longest: the busiest worker's port, the busiest sender's, or the largest link."""


def floor(fabric: Fabric, largest_in: int, largest_out: int, largest_link: int) -> Floor:
    times = {"the busiest engine worker's port (bytes in)": largest_in / fabric.per_port,
             "the busiest trainer rank's port (bytes out)": largest_out / fabric.per_port}
    if fabric.per_pair is not None:
        times["the largest link (one pair of devices)"] = largest_link / fabric.per_pair
    binds = max(times, key=times.__getitem__)
    return Floor(times[binds], binds)
