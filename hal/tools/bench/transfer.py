"""The transfer benchmark: one sender process, K receiver processes (default 1), gloo between them.

Weights live in host memory and hal's sync runs on the `cpu` backend whatever
VERL_DEVICE says: this measures the same-node CPU path, where the floor is gloo over
loopback. (Device-to-device NCCL/HCCL runs are not covered here.)

All 1 + K processes are spawned fresh and joined by one gloo group that is created once
and reused by every method (as a trainer-engine group would be). The parent process only
waits, with a deadline: a rank that fails or outlives the deadline gets every rank
killed, so no process is left behind.

What each method must leave at every receiver is the same: every tensor's bytes in
receiver-owned memory (a preallocated destination tensor per parameter).

    floor          one broadcast of one flat tensor holding all the bytes, to all K
                   receivers; the weights and the destinations are views into those flat
                   tensors, so nothing is packed or copied: the transport's floor.
    per_tensor     one broadcast per parameter, straight into its destination (what most
                   trainers do today).
    hal_bucketed   hal.sync's Sender/Receiver over BroadcastTransport (send/recv pairs for
                   one receiver on gloo, broadcasts for two or more) into the receiver's
                   destinations through `copy_into` (hal's apply for preallocated
                   tensors): a tensor that travels in transfers of its own is sent
                   from the sender's tensor and received straight into its
                   destination; small tensors travel packed in buckets and are copied.
    hal_shm        the same over IpcTransport (same-node shared memory; every tensor is
                   copied out of the shared slot). Not with --nodes >= 2: shared memory
                   needs every rank on one node, which the simulated nodes deny.
    hal_hier       the same over HierarchicalTransport: ranks grouped by node key
                   (VERL_HAL_NODE, set per process: "trainer" for the sender, node<i> for
                   the receivers: all on node0 without --nodes, else spread over N nodes in
                   contiguous blocks). Per node one leader receives over the network, the
                   others read its shared buffer; the sender's `network_bytes` must grow
                   by exactly nodes x the sync's segment bytes per sync (checked).
    hal_bucketed_copy
                   hal_bucketed with an apply callable that copies every view (a
                   load_weights-style target that names no destinations).
    floor_with_copy
                   the flat broadcast, started asynchronously, while each process copies
                   as many bytes as the model holds (through a 64 MiB scratch pair): where
                   a bucketed sync (one pack copy at the sender, one apply copy at the
                   receiver) would land if its copies overlapped the transfer perfectly.
    floor_pipelined
                   the model's bytes in the sync's segments (SyncConfig.segment_bytes,
                   at most a bucket) through two slots, with torch.distributed alone
                   (send/recv pairs for one receiver, broadcasts for more): each segment
                   copied into a slot just before it is sent and out of one just after it
                   arrived, while the next is on the wire. A bucketed sync's structure with nothing per tensor, no
                   header and no statuses; floor_with_copy runs the same copies at once,
                   as no sync can (a segment is copied out only after it arrived).
    floor_leaders  one flat broadcast to one receiver per node only (the hal_hier leaders,
                   over a subgroup of the sender and the leaders): the network floor of
                   the hierarchical path, run in the same rounds. With every receiver on
                   one node it is the 1-receiver floor. Only the leaders hold the bytes
                   (and are checked).
    *_read         the hal methods again with an apply callable that reads every byte of
                   the views (a sum of their 8-byte words) and copies nothing: what a
                   consumer that uses the bucket in place would pay. NOT comparable to
                   floor: nothing is left in receiver-owned memory afterwards.

Timing: each repetition starts after a garbage collection (of the bench's own objects,
outside the timed region, as `timeit` does) and a barrier; its time is the latest end minus the
earliest start over all processes (`time.perf_counter`, CLOCK_MONOTONIC, shared by the
processes of a node). First every method, one after the other, creates its objects and
runs its warm-up repetitions (at least one; memory is measured here, see below). Then
the measured repetitions run in interleaved rounds: round r runs every method once,
starting at method r, so a burst of load from other work on the machine hits all methods
alike. `seconds` is the median over rounds (the best is reported too); `ratio_to_floor`
is the median over rounds of the method's time over the floor's time in the same round. After every repetition the
receiver checks every byte of the destinations against the sender's (deterministic)
pattern and clears them, both outside the timed region (every receiver that a method
fills: `verified_ranks` in the JSON), and only once every rank has left it (a barrier),
so that no receiver checks or clears its bytes while another still receives.

Network bytes per sync (`network_bytes_per_sync`): what crossed the network (here gloo
over loopback) in one sync: K models for the flat broadcasts (every receiver gets its
bytes over a socket, however gloo routes them), K x the plan's segment bytes for
BroadcastTransport, the nodes' leaders' count x model (or segment) bytes for
floor_leaders, 0 for shared memory, and for hal_hier what the sender's
HierarchicalTransport counted (`network_bytes`). Control messages are not counted.

CPU: `time.process_time()` around each repetition in each process (all its threads, user
and system, so gloo's socket copies count); the medians are reported as `sender_cpu_s` and
`receiver_cpu_s` (the largest over the receivers), every rank's in `cpu_s_per_rank`. On
a machine with fewer free cores than busy threads, their sum divided by the cores bounds
the time from below.

Memory: per process, the Linux resident-set high-water mark (VmHWM) is reset through
/proc/self/clear_refs just before a method's objects (transports, senders, receivers) are
created (the baseline), and again after each warm-up repetition's verification; the
largest `VmHWM - baseline` read right after a warm-up repetition is that process's peak
extra memory: everything the method allocated and touched beyond the weights, the
destinations (allocated and touched before any method runs) and the objects of the
methods set up before it (alive from their setup to the end of the run).
`peak_extra_bytes` is the largest over the processes; every rank's is in
`peak_extra_bytes_per_rank`. Pages of a shared-memory file count in the RSS of every
process that touches them.

The code: hal.tools.bench.transfer_config (the method names, `TransferConfig`, the node
layout), hal.tools.bench.transfer_methods (each method's setup on one rank),
hal.tools.bench.transfer_rank (one rank: set-up, warm-up, interleaved rounds, checks),
hal.tools.bench.transfer_table (the printed table); this module spawns the ranks and
turns their reports into the results.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from typing import Any

from hal.procs import free_port, spawn_ranks
from hal.tools.bench.common import GIB, RECEIVER, SENDER
from hal.tools.bench.presets import get_preset
from hal.tools.bench.transfer_config import FILLS_DESTINATIONS, SHM_METHODS, TransferConfig, fills, node_keys, node_leaders, plan_segment_bytes
from hal.tools.bench.transfer_rank import rank_main


def _spawn_and_wait(config: TransferConfig) -> list[dict[str, Any]]:
    def role_failed(rank: int, text: str) -> None:
        role = "sender" if rank == SENDER else f"receiver {rank}" if config.receivers > 1 else "receiver"
        raise RuntimeError(f"hal bench: the {role} (rank {rank}) failed:\n{text}")

    try:
        return spawn_ranks(
            rank_main, 1 + config.receivers, args=(free_port(), config), timeout_s=config.timeout_s, label="hal-bench-rank", on_failure=role_failed
        )
    except TimeoutError as exc:
        raise TimeoutError(f"hal bench: {exc}") from None


def _median_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return {k: float(statistics.median(r[k] for r in rows if k in r)) for k in keys}


def network_bytes(method: str, config: TransferConfig, total: int, segment_bytes: int, measured: list[int]) -> tuple[int | None, str]:
    """Bytes that crossed the network in one sync of `method`, and how they were counted
    (see the module doc). `measured`: the sender's per-sync counts (hal_hier only)."""
    k = config.receivers
    if method == "hal_hier":
        return (int(statistics.median(measured)) if measured else None), "measured: the sender's HierarchicalTransport.network_bytes"
    if method in SHM_METHODS:
        return 0, "0: shared memory (control messages only)"
    if method == "floor_leaders":
        return config.nodes * total, f"{config.nodes} leader(s) x model bytes"
    if method.startswith("hal_"):  # BroadcastTransport
        return k * segment_bytes, f"{k} receiver(s) x segment bytes"
    return k * total, f"{k} receiver(s) x model bytes"


def run_transfer(config: TransferConfig) -> dict[str, Any]:
    """Run the benchmark and return {"preset", "config", "results": [...]} (see module doc)."""
    began = time.perf_counter()
    reports = _spawn_and_wait(config)
    wall = time.perf_counter() - began
    total = reports[SENDER]["total_bytes"]
    params = get_preset(config.preset).params()
    segment_bytes = plan_segment_bytes(params, config.bucket_bytes)
    receivers = range(1, 1 + config.receivers)
    full = max(1, config.warmup) + config.repeats  # repetitions a verifying rank checks
    results = []
    per_round: dict[str, list[float]] = {}
    for method in config.methods:
        per_rank = [r["methods"][method] for r in reports]
        times = [
            max(ends) - min(starts)
            for starts, ends in zip(zip(*(m["starts"] for m in per_rank)), zip(*(m["ends"] for m in per_rank)))
        ]
        extras = [m["peak_extra_bytes"] for m in per_rank]
        receiver_extras = extras[1:]
        cpu = [statistics.median(m["cpu_s"]) for m in per_rank]
        seconds = statistics.median(times)
        per_round[method] = times
        net, net_how = network_bytes(method, config, total, segment_bytes, per_rank[SENDER].get("network_bytes") or [])
        trace: dict[str, Any] = {}
        if "trace" in per_rank[SENDER]:
            trace = {"trace": {"sender": per_rank[SENDER]["trace"], "receiver": per_rank[RECEIVER].get("trace", [])}}
            if config.receivers > 1:
                trace["trace"]["other_receivers"] = [per_rank[r].get("trace", []) for r in receivers if r != RECEIVER]
        results.append(
            {
                "method": method,
                "seconds": seconds,
                "gib_per_s": total / seconds / GIB,
                "ratio_to_floor": None,
                "peak_extra_bytes": None if None in extras else max(extras),
                "best_seconds": min(times),
                "all_seconds": times,
                "sender_peak_extra_bytes": extras[SENDER],
                "receiver_peak_extra_bytes": None if None in receiver_extras else max(receiver_extras),
                "leaves_receiver_owned_copy": method in FILLS_DESTINATIONS,
                "sender_cpu_s": cpu[SENDER],
                "receiver_cpu_s": max(cpu[1:]),
                **trace,
                "sender_metrics": _median_metrics(per_rank[SENDER]["metrics"]),
                "receiver_metrics": _median_metrics(per_rank[RECEIVER]["metrics"]),
                # several receivers / nodes (also filled for one)
                "ratio_to_floor_leaders": None,
                "network_bytes_per_sync": net,
                "network_bytes_how": net_how,
                "network_bytes_all": per_rank[SENDER].get("network_bytes") or [],
                "peak_extra_bytes_per_rank": extras,
                "cpu_s_per_rank": cpu,
                "verified_ranks": [r for r in receivers if per_rank[r].get("verified", 0) == full and fills(method, r, config)],
                "receiver_metrics_per_rank": [_median_metrics(per_rank[r]["metrics"]) for r in receivers],
            }
        )
    floor, leaders = per_round.get("floor"), per_round.get("floor_leaders")
    for r in results:
        # The median of the per-round ratios: both times of a ratio come from the same round.
        r["ratio_to_floor"] = statistics.median(t / f for t, f in zip(per_round[r["method"]], floor)) if floor else None
        if leaders:
            r["ratio_to_floor_leaders"] = statistics.median(t / f for t, f in zip(per_round[r["method"]], leaders))
    keys = node_keys(config.receivers, config.nodes)
    return {
        "preset": config.preset,
        "bytes": total,
        "tensors": len(params),
        "storages_per_rank": [r["storages"] for r in reports],  # allocations the tensors live in: 1 with the flat layout
        "config": {**{k: v for k, v in asdict(config).items() if k != "methods"}, "methods": list(config.methods)},
        "timing": f"median of {config.repeats} interleaved rounds after {max(1, config.warmup)} warm-up",
        "torch_threads_per_process": config.threads,
        "setup_wall_s": max(r["setup_wall_s"] for r in reports),
        "wall_s": wall,
        "results": results,
        "receivers": config.receivers,
        "nodes": config.nodes,
        "processes": len(reports),
        "pids": [r["pid"] for r in reports],
        "node_keys": keys,
        "node_leaders": node_leaders(config.receivers, config.nodes),
        "segment_bytes_per_sync": segment_bytes,
    }
