"""`hal bench`: how fast a trainer's weights reach an engine, against the transport's floor.

    hal bench --preset qwen2.5-0.5b --json out.json --plot out.png
    hal bench --preset tiny --repeats 2 --methods floor,hal_bucketed
    hal bench --engine vllm ...          # into a live vLLM engine (hal.tools.bench.vllm_engine)

`--engine transfer` (the default) runs hal.tools.bench.transfer: a sender and a receiver process
joined by gloo, measuring `floor`, `per_tensor`, `hal_bucketed`, `hal_shm` (and the
read-in-place variants) on synthetic weights from hal.tools.bench.presets. The JSON holds
{"preset", "results": [{"method", "seconds", "gib_per_s", "ratio_to_floor",
"peak_extra_bytes", ...}, ...]} plus the configuration and per-sync metrics.

    hal bench --receivers 3                       # 1 sender + 3 receivers, all on one node
    hal bench --receivers 4 --nodes 2 --methods floor,floor_leaders,hal_bucketed,hal_hier

`--receivers K` spawns K receiver processes (the floor becomes one flat broadcast to all
K); `--nodes N` spreads them over N simulated nodes (VERL_HAL_NODE per process) for
`hal_hier`. Each result then also carries "network_bytes_per_sync",
"ratio_to_floor_leaders", "peak_extra_bytes_per_rank", "cpu_s_per_rank" and
"verified_ranks"; the report "receivers", "nodes", "processes", "pids", "node_keys".

    hal bench --delta --lrs 1e-6,1e-5 --syncs 8   # delta sync after Adam steps (hal.tools.bench.delta)

`--delta` runs hal.tools.bench.delta instead: fp32 master weights shaped like the preset, one
Adam step on random gradients between syncs, each sync measured as `floor`, dense
`hal_bucketed`, `hal_delta_bytes` and `hal_delta_time` (SyncConfig.delta with
DeltaConfig.choose "bytes" and "time") with the wire dtype `--wire-dtype`;
the JSON holds {"preset", "mode": "delta", "results": [one summary per learning rate]}.
`--methods`, `--repeats`, `--warmup`, `--receivers`, `--nodes`, `--trace` and `--plot`
do not apply to it.

    hal bench --senders 2 --receivers 2 --preset qwen2.5-0.5b   # M-to-N (hal.tools.bench.senders)

`--senders M` runs hal.tools.bench.senders instead: M trainer ranks holding the preset as
FSDP2 `Shard(0)` DTensors, each sending only its own rows (hal.sync.sharded) to the
`--receivers` K, against one sender (the same code path with M = 1) into the same K; it
fails unless every trainer rank sent exactly its plan share and the receivers hold the
model bit for bit. The JSON holds {"preset", "mode": "senders", "ratio_senders_to_one",
"results": [one row per method, with its byte check]}. It takes `--preset`,
`--receivers`, `--repeats`, `--warmup`, `--bucket-mb`, `--sync-backend`, `--threads`,
`--timeout`, `--no-verify`, `--json` and `--tp T`: the trainer ranks hold a Megatron-shaped
layout of T tensor-parallel ranks x M / T pipeline stages instead (row and column blocks
under Hugging Face names, norms replicated over TP: hal.tools.bench.senders_megatron), and
each rank's bytes are checked against that layout (docs/megatron.md, "Numbers").

    VERL_DEVICE=cuda hal bench --delta-kernels --segment-mb 32   # hal.tools.bench.delta_kernels

`--delta-kernels` times `hal.kernels.delta_encode` / `delta_check` / `delta_apply` on one
segment on the current backend's device, for shares of its words changed from 0 to 1,
with a plain copy for scale: how fast this device finds and patches changes (the JSON
holds {"mode": "delta-kernels", "results": [one row per share]}). It takes `--repeats`
and `--json` only.

    VERL_DEVICE=cuda hal bench --device-transfer      # hal.tools.bench.device_transfer

`--device-transfer` keeps the weights and the receivers' destinations in the current
backend's device memory: `floor_ipc` (one device-to-device copy per receiver through
device IPC) against hal.sync over IpcTransport (plain, verified, host-staged) and over
the gloo group (`--device-methods` picks). It takes `--preset`, `--receivers`,
`--repeats`, `--warmup`, `--bucket-mb`, `--timeout`, `--no-verify` and `--json`.

With `--json PATH`, every mode's report begins with "run": when it started (UTC), the
command line, the git commit of the hal checkout, and the machine (hal.tools.bench.record),
so the file is a record that stands alone: docs/results/ keeps them (docs/benchmarks.md).

`--engine vllm` hands the parsed arguments to `hal.tools.bench.vllm_engine.run(args)`, which
returns a dict; that module is imported only then (it needs vllm). If it defines
`add_arguments(parser)`, its options are declared here too.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from hal.tools.bench.arg_types import comma_list, float_list, non_negative_int, positive_float, positive_int
from hal.tools.bench.presets import PRESETS

__all__ = ["add_arguments", "main"]

ENGINES = ("transfer", "vllm")
_DEVICE_METHODS = ("floor_ipc", "hal_ipc", "hal_ipc_verified", "hal_ipc_staged", "hal_gloo")  # hal.tools.bench.device_transfer.METHODS
_VLLM_MODULE = "hal.tools.bench.vllm_engine"


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
        "(hal.sync.sharded) to --receivers, against 1 sender into the same receivers; checks every rank's bytes",
    )
    senders.add_argument(
        "--tp", type=positive_int, default=None, metavar="T",
        help="with --senders M: the trainer ranks hold a Megatron-shaped layout of T tensor-parallel ranks x M/T pipeline "
        "stages (row and column blocks under Hugging Face names, norms replicated over TP; hal.tools.bench.senders_megatron) "
        "instead of FSDP2's Shard(0) rows; the bytes each rank sends are checked against that layout",
    )
    device = parser.add_argument_group("--device-transfer (hal.tools.bench.device_transfer)")
    device.add_argument(
        "--device-transfer", action="store_true",
        help="weights on the current backend's device (VERL_DEVICE) into receivers' device memory: floor_ipc, hal_ipc, ...",
    )
    device.add_argument(
        "--device-methods", type=comma_list(_DEVICE_METHODS, "method"), default=None,
        help=f"comma-separated subset of {','.join(_DEVICE_METHODS)} (default: all; floor_ipc always)",
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
        vllm_engine = importlib.import_module(_VLLM_MODULE)
    except ImportError:
        return
    add = getattr(vllm_engine, "add_arguments", None)
    if callable(add):
        try:
            add(parser.add_argument_group("--engine vllm"))
        except argparse.ArgumentError as exc:
            print(f"hal bench: ignoring options of {_VLLM_MODULE}: {exc}", file=sys.stderr)


# Seconds before every benchmark process is killed when --timeout is not given, per
# benchmark; resolved once in `main`, so every benchmark reads a number from `args.timeout`.
DEFAULT_TIMEOUT_S = {"senders": 600.0, "delta-kernels": 300.0, "device-transfer": 600.0, "delta": 1800.0, "vllm": 300.0, "transfer": 300.0}


def _benchmark(args: argparse.Namespace) -> str:
    """Which benchmark `args` ask for (a key of DEFAULT_TIMEOUT_S)."""
    if getattr(args, "senders", None) is not None:
        return "senders"
    for flag, name in (("delta_kernels", "delta-kernels"), ("device_transfer", "device-transfer"), ("delta", "delta")):
        if getattr(args, flag, False):
            return name
    return "vllm" if getattr(args, "engine", "transfer") == "vllm" else "transfer"


def main(args: argparse.Namespace) -> int:
    from hal.tools.bench import record

    started, load_average = record.utc_now(), record.load_average()
    if getattr(args, "timeout", None) is None:
        args.timeout = DEFAULT_TIMEOUT_S[_benchmark(args)]
    if getattr(args, "profile", False) and _benchmark(args) != "device-transfer":
        raise SystemExit("hal bench: --profile applies to --device-transfer only")
    if getattr(args, "layout", "flat") != "flat" and _benchmark(args) != "transfer":
        raise SystemExit(f"hal bench: --layout applies to the transfer benchmark only, not to {_benchmark(args)}")
    if getattr(args, "tp", None) is not None and getattr(args, "senders", None) is None:
        raise SystemExit("hal bench: --tp T describes the layout of --senders M trainer ranks: give --senders too")
    if getattr(args, "senders", None) is not None:
        from hal.tools.bench.senders import format_table as format_senders_table, run_from_args

        report = run_from_args(args)
        print(format_senders_table(report))
    elif getattr(args, "delta_kernels", False):
        from hal.tools.bench.delta_kernels import KernelBenchConfig, format_table as format_kernel_table, run_delta_kernels

        if getattr(args, "delta", False):
            raise SystemExit("hal bench: --delta and --delta-kernels are two benchmarks: give one")
        try:
            config = KernelBenchConfig(segment_bytes=int((args.segment_mb or 32.0) * (1 << 20)), repeats=args.repeats)
        except ValueError as exc:
            raise SystemExit(f"hal bench: {exc}") from None
        report = run_delta_kernels(config)
        print(format_kernel_table(report))
    elif getattr(args, "segment_mb", None) is not None:
        raise SystemExit("hal bench: --segment-mb applies to --delta-kernels only")
    elif getattr(args, "device_transfer", False):
        report = _run_device_transfer(args)
        from hal.tools.bench.device_transfer import format_table as format_device_table

        print(format_device_table(report))
    elif getattr(args, "delta", False):
        from hal.tools.bench.delta_report import format_table as format_delta_table

        report = _run_delta(args)
        print(format_delta_table(report))
    elif args.engine == "vllm":
        report = importlib.import_module(_VLLM_MODULE).run(args)  # prints its own summary
    else:
        report = _run_transfer(args)
        from hal.tools.bench.transfer_table import format_table

        print(format_table(report))
    if args.json:  # the run's date, machine, commit and command line: a record that stands alone
        run = record.describe_run(_benchmark(args), getattr(args, "argv", None), date=started, load_average_start=load_average)
        report = record.stamp(report, run)
    _write(report, args)
    return 0


def _run_transfer(args: argparse.Namespace) -> dict[str, Any]:
    from hal.tools.bench.transfer import run_transfer
    from hal.tools.bench.transfer_config import default_methods

    receivers, nodes = getattr(args, "receivers", 1), getattr(args, "nodes", 1)
    if nodes > receivers:
        raise SystemExit(f"hal bench: --nodes {nodes} needs at least as many --receivers (got {receivers})")
    methods = tuple(args.methods) if args.methods is not None else default_methods(receivers, nodes)
    try:
        config = _transfer_config(args, methods, receivers, nodes)
    except ValueError as exc:  # e.g. shared-memory methods on several simulated nodes
        raise SystemExit(f"hal bench: {exc}") from None
    return run_transfer(config)


def _run_device_transfer(args: argparse.Namespace) -> dict[str, Any]:
    from hal.tools.bench.device_transfer import DeviceTransferConfig, run_device_transfer

    unsupported = [
        flag
        for flag, given in (
            ("--engine vllm", args.engine != "transfer"), ("--delta", args.delta), ("--methods", args.methods is not None),
            ("--nodes", args.nodes != 1), ("--trace", args.trace), ("--plot", bool(args.plot)),
        )
        if given
    ]
    if unsupported:
        raise SystemExit(f"hal bench: --device-transfer does not take {', '.join(unsupported)}")
    methods = args.device_methods or _DEVICE_METHODS
    if "floor_ipc" not in methods:
        methods = ("floor_ipc", *methods)
    try:
        config = DeviceTransferConfig(
            preset=args.preset, methods=tuple(methods), receivers=args.receivers, repeats=args.repeats, warmup=args.warmup,
            bucket_bytes=int(args.bucket_mb * 1024 * 1024) if args.bucket_mb is not None else None,
            timeout_s=args.timeout, verify=args.verify, profile=args.profile,
        )
    except ValueError as exc:
        raise SystemExit(f"hal bench: {exc}") from None
    return run_device_transfer(config)


def _run_delta(args: argparse.Namespace) -> dict[str, Any]:
    from hal.tools.bench.delta import run_delta
    from hal.tools.bench.delta_config import WIRE_DTYPES, DeltaBenchConfig

    unsupported = [
        flag
        for flag, given in (
            ("--engine vllm", args.engine != "transfer"),
            ("--methods", args.methods is not None),
            ("--receivers", args.receivers != 1),
            ("--nodes", args.nodes != 1),
            ("--trace", args.trace),
            ("--plot", bool(args.plot)),
        )
        if given
    ]
    if unsupported:
        raise SystemExit(f"hal bench: --delta does not take {', '.join(unsupported)}")
    try:
        config = DeltaBenchConfig(
            preset=args.preset,
            lrs=tuple(args.lrs),
            syncs=args.syncs,
            wire_dtype=WIRE_DTYPES[args.wire_dtype],
            bucket_bytes=_bucket_bytes(args, WIRE_DTYPES[args.wire_dtype].itemsize),
            anchor_every=args.anchor_every,
            baseline=args.baseline,
            link_gb_per_s=args.link_gbps,
            threads=args.threads,
            timeout_s=args.timeout,
            verify=args.verify,
        )
    except ValueError as exc:
        raise SystemExit(f"hal bench: {exc}") from None
    return run_delta(config)


def _transfer_config(args: argparse.Namespace, methods: tuple[str, ...], receivers: int, nodes: int) -> Any:
    from hal.tools.bench.transfer_config import TransferConfig

    return TransferConfig(
        preset=args.preset,
        methods=methods,
        receivers=receivers,
        nodes=nodes,
        repeats=args.repeats,
        warmup=args.warmup,
        bucket_bytes=_bucket_bytes(args),
        timeout_s=args.timeout,
        verify=args.verify,
        threads=args.threads,
        trace=args.trace,
        sync_backend=args.sync_backend,
        layout=args.layout,
    )


def _bucket_bytes(args: argparse.Namespace, itemsize: int | None = None) -> int:
    """The --bucket-mb given, else the size a Sender with SyncConfig(bucket_bytes=None)
    would choose for this preset on the cpu backend (the benchmark's weights live in host
    memory), so that the default run measures hal's default."""
    if args.bucket_mb is not None:
        return int(args.bucket_mb * 1024 * 1024)
    import hal
    from hal.tools.bench.presets import get_preset
    from hal.sync import default_bucket_bytes

    params = get_preset(args.preset).params()
    # `itemsize`: the wire element size when it is not the preset's (hal bench --delta)
    largest = max(p.nbytes if itemsize is None else p.nbytes // p.dtype.itemsize * itemsize for p in params)
    return default_bucket_bytes(hal.get_backend("cpu"), largest)


def _write(report: dict[str, Any], args: argparse.Namespace) -> None:
    results = report.get("results") if isinstance(report, dict) else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
            f.write("\n")
        print(f"wrote {args.json}")
    if args.plot:
        if not results:
            raise ValueError("--plot: the benchmark returned no results to plot")
        from hal.tools.bench.plot import plot_results

        plot_results(report, args.plot)
        print(f"wrote {args.plot}")
