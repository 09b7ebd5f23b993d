"""`hal plan`: the M x N plan of a sync at any scale, on paper, from the same code.

    hal plan --model qwen3-235b-a22b --trainer fsdp2:8 --engine tp=1,dp=8,ep --engine tp=8
    hal plan --model deepseek-v3 --trainer fsdp2:64 --engine tp=8,ep --fabric nvlink4 --json plan.json
    hal plan --model PATH/config.json --dtype bf16 --trainer megatron:tp=4,pp=2,ep=8,etp=1 --engine tp=8,engines=2
    hal plan --model qwen3-235b-a22b --trainer one --engine tp=8 --layers 2          # a quick look

The model is a `config.json` (a preset's, `presets/`, or any folder's: its safetensors
headers when it has them); nothing is downloaded and no weight is allocated. Each engine
worker's needs are recorded by vLLM's own model class built on the meta device at that
worker (hal.integrations.vllm.meta_engine), the trainer's holdings come from the shapes
(hal.tools.plan.layouts), and `build_mxn_plan` (hal.sync.plan.mxn) is the function a live
engine plans with; every `--engine` is planned from the same trainer. It prints, per engine
layout, the bytes each worker takes in (its shard and what other workers of its engine
need too), each node of `--per-node` workers (together, and the distinct boxes they need:
what one receiver per node would take in once), each trainer rank sends, the largest link, what no worker needs, and the floor
at a fabric (hal.tools.plan.fabric: the figure and its source, and the floors at the other
named fabrics), with the plan's own wall time and peak memory (hal.tools.plan.run). `--json PATH` writes a record that stands alone
(hal.tools.bench.record; docs/results/).
"""

from __future__ import annotations

import argparse
import os

from hal.tools.plan.checkpoint import presets

DTYPES = ("bf16", "fp16", "fp32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help=f"a preset ({', '.join(presets())}) or PATH/config.json (its folder)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="what the trainer sends and the engine computes in (default bf16)")
    parser.add_argument("--trainer", required=True, help="one | fsdp2:M | megatron:tp=T,pp=P,ep=E,etp=X[,dp=D]")
    parser.add_argument("--engine", required=True, action="append",
                        help="the vLLM engine: tp=T[,dp=D][,ep][,engines=R] (ep: experts over its TP x DP workers; R independent engines); "
                             "again for another layout, planned from the same trainer")
    fabric = parser.add_mutually_exclusive_group()
    fabric.add_argument("--fabric", choices=("ib-ndr", "nvlink4", "hccs-910b"), default="ib-ndr", help="the link model of the floor (default ib-ndr)")
    fabric.add_argument("--bandwidth", type=float, metavar="GB/s", help="the floor at this bandwidth per port per direction instead")
    parser.add_argument("--per-node", type=int, default=8, metavar="N",
                        help="engine workers a node, in worker order (default 8): bytes into each node, and the distinct boxes its workers need")
    parser.add_argument("--layers", type=int, metavar="N", help="plan the model's first N decoder layers only (a quick look)")
    parser.add_argument("--no-templates", action="store_true", help="record every layer of every worker (slow; the templates' check)")
    parser.add_argument("--json", metavar="PATH", help="write the plan as a record (docs/results/)")


def main(args: argparse.Namespace) -> int:
    # no network, quiet engines: set before vLLM or transformers is imported
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from hal.tools.plan.run import run

    return run(args)


__all__ = ["add_arguments", "main"]
