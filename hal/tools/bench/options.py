"""`hal bench`'s options (every benchmark's; `--engine vllm` adds its module's own)."""

from __future__ import annotations

import argparse
import importlib
import sys

from hal.tools.bench.arg_types import comma_list, float_list, non_negative_int, positive_float, positive_int
from hal.tools.bench.presets import PRESETS

ENGINES = ("transfer", "vllm")
DEVICE_METHODS = ("floor_ipc", "hal_ipc", "hal_ipc_verified", "hal_ipc_staged", "hal_gloo")  # hal.tools.bench.device_transfer.METHODS
VLLM_MODULE = "hal.tools.bench.vllm_engine"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hal.tools.bench.transfer_config import ALL_METHODS, LAYOUTS, METHODS, SHM_METHODS, TOPOLOGY_METHODS

    parser.add_argument("--engine", choices=ENGINES, default="transfer", help="transfer: process-to-process benchmark (default); vllm: into a live vLLM engine")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-0.5b", help="synthetic weight set (default: qwen2.5-0.5b)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="measured repetitions per method; the median is reported (default: 5)")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="discarded repetitions per method first (default: 1)")
    parser.add_argument(
        "--bucket-mb",
        type=positive_float,
        default=None,
        help="bucket size in MiB for the hal methods (default: what hal.sync picks by itself: default_bucket_bytes "
        "from free memory and the preset's largest tensor)",
    )
    parser.add_argument(
        "--methods",
        type=comma_list(METHODS, "method"),
        default=None,
        help=f"comma-separated subset of {','.join(METHODS)} (default: {','.join(ALL_METHODS)}; with --receivers >= 2 "
        f"or --nodes >= 2 also {','.join(TOPOLOGY_METHODS)}, and with --nodes >= 2 without {','.join(SHM_METHODS)}: "
        "shared memory needs every rank on one node)",
    )
    parser.add_argument(
        "--receivers",
        type=positive_int,
        default=1,
        help="receiver processes (default: 1); the benchmark spawns 1 + K processes on one gloo group, and `floor` "
        "becomes one flat broadcast to all K. This 2-core machine holds about 2 busy processes per core.",
    )
    parser.add_argument(
        "--nodes",
        type=positive_int,
        default=1,
        help="simulated nodes the receivers are spread over, in contiguous blocks (default: 1): each receiver gets "
        "VERL_HAL_NODE=node<i>, the sender 'trainer'. hal_hier then moves one model per node over the network and "
        "floor_leaders broadcasts to one receiver per node. At most --receivers.",
    )
    parser.add_argument(
        "--sync-backend", choices=("cpu", "sim"), default="cpu",
        help="backend of the hal methods' syncs (weights stay in host memory either way): cpu (default) or sim, "
        "whose copies run on its streams' threads, so host us/tensor is the sync's own Python",
    )
    parser.add_argument(
        "--layout", choices=LAYOUTS, default="flat",
        help="where each process keeps its tensors: flat (default), views of one buffer in plan order, as a flat "
        "parameter or parameter buffer holds them; scattered, each its own allocation, as a model's parameters "
        "and an engine's weights are. The floors move the flat buffer either way",
    )
    parser.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads per benchmark process (default: 1; the two processes share the cores)")
    parser.add_argument(
        "--timeout", type=positive_float, default=None, help="seconds before every benchmark process is killed (default: 300; 600 with --device-transfer, 1800 with --delta)"
    )
    parser.add_argument("--no-verify", dest="verify", action="store_false", help="skip the (untimed) byte check at the receiver")
    parser.add_argument("--trace", action="store_true", help="record per-bucket transport/apply timings of the hal methods' last repetition in the JSON")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    delta = parser.add_argument_group("--delta (hal.tools.bench.delta)")
    delta.add_argument(
        "--delta",
        action="store_true",
        help="measure delta sync (SyncConfig.delta) after Adam steps on fp32 master weights, against dense hal_bucketed and floor",
    )
    delta.add_argument("--lrs", type=float_list, default=(1e-6, 1e-5), help="Adam learning rates, comma-separated (default: 1e-6,1e-5)")
    delta.add_argument("--syncs", type=positive_int, default=8, help="syncs per learning rate after the first, whole one (default: 8)")
    delta.add_argument("--wire-dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="SyncConfig.wire_dtype (default: bf16)")
    delta.add_argument("--anchor-every", type=positive_int, default=16, help="DeltaConfig.anchor_every (default: 16)")
    delta.add_argument("--baseline", choices=("device", "host"), default="device", help="DeltaConfig.baseline (default: device)")
    delta.add_argument(
        "--link-gbps", type=positive_float, default=None, metavar="GB_PER_S",
        help="emulate a link of this many GB/s (1e9 bytes/s) for every method: a send's bytes count as arrived only at "
        "that rate, overlapping the work around it (default: the transport as it is)",
    )
    senders = parser.add_argument_group("--senders (hal.tools.bench.senders)")
    senders.add_argument(
        "--senders", type=positive_int, default=None, metavar="M",
        help="M-to-N: M trainer ranks holding the preset as FSDP2 Shard(0) DTensors, each sending only its own rows "
        "(hal.sync.send.sharded) to --receivers, against 1 sender into the same receivers; checks every rank's bytes. "
        "With --engine vllm: M trainer ranks into the live engine of --engine-tp workers (hal.tools.bench.vllm_senders)",
    )
    senders.add_argument(
        "--tp", type=positive_int, default=None, metavar="T",
        help="with --senders M: the trainer ranks hold a Megatron-shaped layout of T tensor-parallel ranks x M/T pipeline "
        "stages (row and column blocks under Hugging Face names, norms replicated over TP; hal.tools.bench.senders_megatron) "
        "instead of FSDP2's Shard(0) rows; the bytes each rank sends are checked against that layout "
        "(the engine's tensor parallelism of --engine vllm is --engine-tp)",
    )
    device = parser.add_argument_group("--device-transfer (hal.tools.bench.device_transfer)")
    device.add_argument(
        "--device-transfer", action="store_true",
        help="weights on the current backend's device (VERL_DEVICE) into receivers' device memory: floor_ipc, hal_ipc, ...",
    )
    device.add_argument(
        "--device-methods", type=comma_list(DEVICE_METHODS, "method"), default=None,
        help=f"comma-separated subset of {','.join(DEVICE_METHODS)} (default: all; floor_ipc always)",
    )
    device.add_argument(
        "--profile", action="store_true",
        help="--device-transfer: cProfile every rank's measured rounds; the top functions by own time go in the report",
    )
    kernels = parser.add_argument_group("--delta-kernels (hal.tools.bench.delta_kernels)")
    kernels.add_argument(
        "--delta-kernels", action="store_true",
        help="time the delta kernels (encode, check, apply) on one segment on the current backend's device",
    )
    kernels.add_argument("--segment-mb", type=positive_float, default=None, help="segment size in MiB (default: 32)")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of the results")
    try:
        vllm_engine = importlib.import_module(VLLM_MODULE)
    except ImportError:
        return
    add = getattr(vllm_engine, "add_arguments", None)
    if callable(add):
        try:
            add(parser.add_argument_group("--engine vllm"))
        except argparse.ArgumentError as exc:
            print(f"hal bench: ignoring options of {VLLM_MODULE}: {exc}", file=sys.stderr)
