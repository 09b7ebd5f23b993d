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
FSDP2 `Shard(0)` DTensors, each sending only its own rows (hal.sync.send.sharded) to the
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

    hal bench --engine vllm --senders 2 --engine-tp 2 --receive shard   # hal.tools.bench.vllm_senders

`--engine vllm --senders M` spawns M trainer ranks holding FSDP2 `Shard(0)` rows of the
engine's model (`--tp T`: the Megatron-shaped layout above) that send into the live engine
of `--engine-tp` workers with `WeightSync(senders="all", receive=--receive)`, rank 0 driving
it (hal.integrations.vllm.engine_proxy); beside each sync's time it reports the bytes out of
each rank, into each worker and over the largest link, fails unless every worker took the
plan's bytes, and after the last sync checks the engine's log-probs against the weights the
ranks hold. The JSON holds {"engine": "vllm", "mode": "senders", "results": [the hal row],
"sender_bytes", "worker_bytes", "largest_link_bytes", "check"}.

`--engine vllm` hands the parsed arguments to `hal.tools.bench.vllm_engine.run(args)`, which
returns a dict; that module is imported only then (it needs vllm). If it defines
`add_arguments(parser)`, its options are declared here too.
"""

from __future__ import annotations

from hal.tools.bench.options import add_arguments
from hal.tools.bench.run import main

__all__ = ["add_arguments", "main"]
