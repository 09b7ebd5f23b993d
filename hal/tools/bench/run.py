"""`hal bench`'s run: which benchmark the options ask for, its time limit, running it,
and writing its report (a record that stands alone with `--json`)."""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

from hal.tools.bench.options import DEVICE_METHODS, VLLM_MODULE

# Seconds before every benchmark process is killed when --timeout is not given, per
# benchmark; resolved once in `main`, so every benchmark reads a number from `args.timeout`.
DEFAULT_TIMEOUT_S = {"senders": 600.0, "delta-kernels": 300.0, "device-transfer": 600.0, "delta": 1800.0, "vllm": 300.0, "transfer": 300.0}


def _benchmark(args: argparse.Namespace) -> str:
    """Which benchmark `args` ask for (a key of DEFAULT_TIMEOUT_S)."""
    if getattr(args, "senders", None) is not None:
        # into a live engine (`--engine vllm --senders M`): the vllm benchmark, its report's "mode" "senders"
        return "vllm" if getattr(args, "engine", "transfer") == "vllm" else "senders"
    for flag, name in (("delta_kernels", "delta-kernels"), ("device_transfer", "device-transfer"), ("delta", "delta")):
        if getattr(args, flag, False):
            return name
    return "vllm" if getattr(args, "engine", "transfer") == "vllm" else "transfer"


def main(args: argparse.Namespace) -> int:
    from hal.tools.bench import record

    started, load_average = record.utc_now(), record.load_average()
    if getattr(args, "timeout", None) is None:
        args.timeout = DEFAULT_TIMEOUT_S[_benchmark(args)]
        if _benchmark(args) == "vllm" and getattr(args, "senders", None) is not None:
            args.timeout = DEFAULT_TIMEOUT_S["senders"]  # the trainer ranks' deadline: set-up, syncs and the engine's check
    if getattr(args, "profile", False) and _benchmark(args) != "device-transfer":
        raise SystemExit("hal bench: --profile applies to --device-transfer only")
    if getattr(args, "layout", "flat") != "flat" and _benchmark(args) != "transfer":
        raise SystemExit(f"hal bench: --layout applies to the transfer benchmark only, not to {_benchmark(args)}")
    if getattr(args, "tp", None) is not None and getattr(args, "senders", None) is None:
        raise SystemExit("hal bench: --tp T describes the layout of --senders M trainer ranks: give --senders too")
    if _benchmark(args) != "vllm" and (getattr(args, "engine_tp", 1) != 1 or getattr(args, "receive", "auto") != "auto"):
        raise SystemExit("hal bench: --engine-tp and --receive describe the engine of --engine vllm: give --engine vllm too")
    if _benchmark(args) == "senders":
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
    elif args.engine == "vllm" and getattr(args, "senders", None) is not None:
        from hal.tools.bench.vllm_senders import run as run_vllm_senders

        report = run_vllm_senders(args)  # prints its own summary
    elif args.engine == "vllm":
        report = importlib.import_module(VLLM_MODULE).run(args)  # prints its own summary
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
    methods = args.device_methods or DEVICE_METHODS
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
