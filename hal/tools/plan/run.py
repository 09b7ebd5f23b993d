"""`hal plan`'s run: the layouts, the checkpoint, each worker's needs, the trainer's
holdings, the M x N plan, each step timed; the lines printed and the record written."""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import time
from typing import Any

import torch

from hal.sync.plan.mxn import no_collection
from hal.tools.plan.checkpoint import checkpoint_specs_of, model_folder, read_config
from hal.tools.plan.fabric import FABRICS, given
from hal.tools.plan.layouts import holdings, parse_engine, parse_trainer
from hal.tools.plan.report import engine_lines, header_lines, summarize

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return 0


def run(args: argparse.Namespace) -> int:
    from hal.tools.bench import record

    date, load_start = record.utc_now(), record.load_average()
    if args.per_node < 1:
        raise ValueError(f"--per-node {args.per_node}: at least one engine worker a node")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers {args.layers}: at least one decoder layer")
    trainer, engines = parse_trainer(args.trainer), [parse_engine(text) for text in args.engine]
    fabric = given(args.bandwidth) if args.bandwidth is not None else FABRICS[args.fabric]
    folder = model_folder(args.model)
    config = read_config(folder)
    if args.layers is not None:
        config = {**config, "num_hidden_layers": args.layers}
    dtype = DTYPES[args.dtype]
    if trainer.kind == "megatron":  # refused here, by name, before anything is imported or built
        from hal.integrations.megatron.local import megatron_shape

        megatron_shape(config, trainer.grid, 0)

    shared: dict[str, Any] = {}
    started = time.perf_counter()
    import transformers  # noqa: F401 - timed apart: the planner's own time is what follows
    import vllm  # noqa: F401

    shared["imports_s"] = time.perf_counter() - started
    shared["rss_after_imports_bytes"] = _rss_bytes()
    # no cyclic collection while plans are made and freed: left to the collector at exit, their
    # millions of acyclic objects cost more than the whole plan (40 s for DeepSeek-V3, FSDP2 x 64)
    with no_collection():
        rows = _plans(args, trainer, engines, fabric, folder, config, dtype, shared)
    shared["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

    model = {"name": folder.name, "model_type": config.get("model_type"), "dtype": args.dtype, "layers": args.layers,
             "config": str(folder / "config.json")}
    for line in header_lines(model, trainer.describe(), rows[0][1], shared):
        print(line)
    for engine, numbers, timing in rows:
        print()
        for line in engine_lines(engine.describe(), numbers, timing):
            print(line)
    if args.json:
        run_info = record.describe_run("plan", getattr(args, "argv", None), date=date, load_average_start=load_start)
        run_info["source"] = "hal plan --json"
        results = [{"layout": f"{trainer.describe()} -> vLLM {engine.describe()}", "engine": text, **numbers, "timing": {**shared, **timing}}
                   for text, (engine, numbers, timing) in zip(args.engine, rows)]
        report = {"run": run_info, "model": model, "trainer": args.trainer, "results": results}
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _plans(args: argparse.Namespace, trainer: Any, engines: list[Any], fabric: Any, folder: pathlib.Path, config: dict[str, Any],
           dtype: torch.dtype, shared: dict[str, Any]) -> list[tuple[Any, dict[str, Any], dict[str, Any]]]:
    """Per engine layout: (the layout, the plan's numbers, its timing); `shared` gets the
    seconds of what every layout shares (the checkpoint, the trainer's holdings). Each
    plan's objects are freed before the next is made."""
    from hal.integrations.vllm.meta_engine import MetaEngine
    from hal.sync.plan.mxn import build_mxn_plan

    at = time.perf_counter()
    specs = tuple(checkpoint_specs_of(folder, dtype, args.layers))
    shared["checkpoint_s"] = time.perf_counter() - at
    at = time.perf_counter()
    held = holdings(trainer, list(specs), config, dtype)
    shared["holdings_s"] = time.perf_counter() - at
    rows = []
    for engine in engines:
        timing: dict[str, Any] = {}
        at = time.perf_counter()
        meta = MetaEngine(str(folder), dtype, engine, templates=not args.no_templates, layers=args.layers)
        timing["engine_config_s"] = time.perf_counter() - at
        at = time.perf_counter()
        needs = meta.all_needs(specs)
        timing["needs_s"] = time.perf_counter() - at
        at = time.perf_counter()
        plan = build_mxn_plan(held, needs)
        timing["mxn_s"] = time.perf_counter() - at
        at = time.perf_counter()
        numbers = summarize(plan, fabric, engine.per_engine, args.per_node)
        timing["summary_s"] = time.perf_counter() - at
        timing["plan_s"] = shared["checkpoint_s"] + shared["holdings_s"] + sum(timing.values())
        timing["layer_templates"] = None if args.no_templates else sorted(set(meta.template_of.values()))
        rows.append((engine, numbers, timing))
        del meta, needs, plan  # freed here, before the next layout's are made
    return rows
