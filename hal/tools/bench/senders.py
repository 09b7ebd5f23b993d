"""`hal bench --senders M --receivers K`: every trainer rank sends its own rows (M-to-N).

    hal bench --senders 2 --receivers 2 --preset qwen2.5-0.5b --json mn.json

M trainer ranks (ranks 0..M-1) hold the preset's weights as FSDP2 would after
`fully_shard`: every parameter a `Shard(0)` DTensor over a 1-d DeviceMesh of the trainer
group, whose local tensor is the rows `torch.chunk` gives that rank (what FSDP2's
`to_local()` returns). The DTensors are built with `DTensor.from_local` on views into one
flat buffer per rank, so a trainer rank holds only its own rows (nothing is gathered or
scattered to build them). K receivers (ranks M..M+K-1) hold one preallocated destination
per parameter, all views into one flat buffer.

Two methods run in interleaved rounds on the same K receivers:

    sharded     hal.sync.send.sharded: every trainer rank r has a gloo sync group of its own
                with the K receivers ([r, M..M+K-1]) and sends only its shares through
                `ShardedSender(BroadcastTransport(group_r))`; every receiver takes all M at
                once through `ShardedReceiver([transport per sender], specs)` into
                `copy_into(destinations)`.
    one_sender  the same code path with M = 1: trainer rank 0 holds the whole model (plain
                tensors, which the layout declares `whole`) and sends it alone through a
                `ShardedSender` whose trainer group is [0], over a group [0, M..M+K-1] of
                its own, into a `ShardedReceiver` of one transport on every receiver. The
                other trainer ranks wait. This is what one sending rank costs with the
                same receivers, the same sinks and the same core: the ratio
                sharded / one_sender is the benchmark's answer.
    plain_sender
                the existing single-sender path, for scale: trainer rank 0's whole model
                through hal.sync's `Sender` / `Receiver` over `BroadcastTransport` (a
                group [0, M..M+K-1] of its own) into the same `copy_into` destinations,
                as `hal bench`'s `hal_bucketed` does. What the sharded machinery (the
                layout exchange, M receiving threads, the assembly of whole tensors)
                costs over it shows as one_sender / plain_sender.

Checked, not only printed (the run fails, `hal bench` exits non-zero, otherwise):

- bytes: every sync of trainer rank r sent `SyncMetrics.bytes` == its plan share
  (`ShardedSender.plan.bytes_of(r)`), which must equal both the bytes of the rows
  `torch.chunk` gives it (computed here from the preset alone) and the bytes of the local
  tensors it holds; the shares sum to the model (`SyncMetrics.model_bytes`, the preset's
  bytes), and when every parameter's rows divide by M each share is exactly model / M
  (when they do not, the report says which parameters and how far the shares are from
  model / M). `check_byte_shares` is the check.
- receivers: every receiver's every sync reports the model's bytes, and (unless
  `--no-verify`) after every sync every receiver's destinations are compared byte for
  byte (libc memcmp) with the deterministic pattern the trainer ranks filled their rows
  with (`hal.tools.bench.buffers`), outside the timed region, then zeroed.

Timing as in hal.tools.bench.transfer: a garbage collection and a barrier before every
sync, its time from the earliest start to the latest end over the ranks that take part,
warm-up syncs first (one after the other per method, memory measured there), then
`repeats` interleaved rounds; `seconds` is the median over rounds and `ratio` the median
of the same-round ratios sharded / one_sender (and over plain_sender). Each process runs `threads` torch threads.
On a machine with fewer cores than M + K busy processes the times say little: the bytes
are what such a run shows.

The parent only waits, with a deadline (`timeout_s`): a rank that fails or outlives it
gets every rank killed (hal.procs.spawn_ranks), so no process is left behind.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict
from typing import Any, Iterable, Sequence


from hal.tools.bench.common import GIB, MIB
from hal.tools.bench.presets import Param, get_preset
from hal.tools.bench.senders_config import METHODS, SendersConfig, ShareError, chunk_rows, row_nbytes

__all__ = ["METHODS", "SendersConfig", "ShareError", "check_byte_shares", "chunk_rows", "row_nbytes", "run_senders"]

def expected_shares(params: Iterable[Param], senders: int) -> list[int]:
    """The bytes of the rows each of `senders` trainer ranks holds (and so must send)."""
    shares = [0] * senders
    for p in params:
        per_row = row_nbytes(p)
        for r, (lo, hi) in enumerate(chunk_rows(p.shape[0], senders)):
            shares[r] += (hi - lo) * per_row
    return shares


def uneven_params(params: Iterable[Param], senders: int) -> list[str]:
    """The parameters whose rows do not divide by `senders`."""
    return [p.name for p in params if p.shape[0] % senders]


def check_byte_shares(
    *,
    model_bytes: int,
    expected: Sequence[int],
    plan: Sequence[int],
    sent: Sequence[Sequence[int]],
    held: Sequence[int] | None = None,
    reported_model: Iterable[int] = (),
    received: Iterable[int] = (),
    uneven: Sequence[str] = (),
) -> dict[str, Any]:
    """Check what the trainer ranks sent against their shares; raise ShareError if any differs.

    `model_bytes`: the whole model (the preset's bytes). Per trainer rank r: `expected[r]`
    the bytes of its Shard(0) rows (`expected_shares`), `plan[r]` its plan share
    (`ShardedSender.plan.bytes_of(r)`), `sent[r]` what it sent in each sync
    (`SyncMetrics.bytes`), `held[r]` the bytes of the local tensors it holds.
    `reported_model`: every `SyncMetrics.model_bytes` a sender reported; `received`: every
    `SyncMetrics.bytes` a receiver reported. `uneven`: the parameters whose rows do not
    divide by M. Returns a summary of what was checked (and how uneven the shares are).
    """
    senders = len(plan)
    problems: list[str] = []
    if len(expected) != senders or len(sent) != senders or (held is not None and len(held) != senders):
        problems.append(f"{senders} plan shares, {len(expected)} expected shares, {len(sent)} senders' counts")
    if sum(expected) != model_bytes:
        problems.append(f"the ranks' Shard(0) rows hold {sum(expected)} bytes, the model {model_bytes}")
    if sum(plan) != model_bytes:
        problems.append(f"the plan shares sum to {sum(plan)} bytes, the model is {model_bytes}")
    for r in range(min(senders, len(expected), len(sent))):
        if plan[r] != expected[r]:
            problems.append(f"trainer rank {r}: plan share {plan[r]} bytes, its Shard(0) rows are {expected[r]} bytes")
        if held is not None and held[r] != plan[r]:
            problems.append(f"trainer rank {r}: holds {held[r]} bytes of local tensors, its plan share is {plan[r]}")
        if not sent[r]:
            problems.append(f"trainer rank {r}: no sync counted")
        for i, count in enumerate(sent[r]):
            if count != plan[r]:
                problems.append(f"trainer rank {r}: sent {count} bytes in sync {i}, its plan share is {plan[r]}")
                break
    for count in set(reported_model):
        if count != model_bytes:
            problems.append(f"a sender reported model_bytes {count}, the model is {model_bytes}")
    for count in set(received):
        if count != model_bytes:
            problems.append(f"a receiver received {count} bytes in a sync, the model is {model_bytes}")
    even = not uneven and model_bytes % senders == 0
    ideal = model_bytes / senders if senders else 0.0
    if even:
        for r, share in enumerate(plan):
            if share != model_bytes // senders:
                problems.append(f"trainer rank {r}: share {share} bytes, model / {senders} = {model_bytes // senders} (every row divides evenly)")
    if problems:
        raise ShareError("bytes sent per trainer rank: " + "; ".join(problems))
    deviation = max((abs(s - ideal) for s in plan), default=0.0)
    return {
        "checked": True,
        "model_bytes": model_bytes,
        "plan_bytes_per_rank": list(plan),
        "sent_bytes_per_rank": [sorted(set(s)) for s in sent],
        "syncs_checked_per_rank": [len(s) for s in sent],
        "sum_equals_model": True,
        "rows_divide_evenly": even,
        "uneven_params": list(uneven),
        "max_deviation_from_model_over_m_bytes": deviation,
        "max_deviation_from_model_over_m": deviation / ideal if ideal else 0.0,
    }


# ---------------------------------------------------------------------------------------
# the run


def _spawn_and_wait(config: SendersConfig) -> list[dict[str, Any]]:
    from hal.procs import free_port, spawn_ranks
    from hal.tools.bench.senders_rank import rank_main

    def role_failed(rank: int, text: str) -> None:
        role = f"trainer rank {rank}" if rank < config.senders else f"receiver {rank - config.senders}"
        raise RuntimeError(f"hal bench --senders: the {role} (rank {rank}) failed:\n{text}")

    try:
        return spawn_ranks(
            rank_main, config.world_size, args=(free_port(), config), timeout_s=config.timeout_s, label="hal-bench-senders-rank",
            on_failure=role_failed,
        )
    except TimeoutError as exc:
        raise TimeoutError(f"hal bench --senders: {exc}") from None


def run_senders(config: SendersConfig) -> dict[str, Any]:
    """Run the benchmark, check the bytes (ShareError) and the receivers, return the report."""
    began = time.perf_counter()
    reports = _spawn_and_wait(config)
    wall = time.perf_counter() - began
    params = get_preset(config.preset).params()
    model = sum(p.nbytes for p in params)
    m, receivers = config.senders, range(config.senders, config.world_size)
    syncs = config.warmup + config.repeats
    results, per_round = [], {}
    checks: dict[str, Any] = {}
    for method in config.methods:
        ranks = config.participants(method)
        rows = [reports[r]["methods"][method] for r in ranks]
        times = [max(ends) - min(starts) for starts, ends in zip(zip(*(x["starts"] for x in rows)), zip(*(x["ends"] for x in rows)))]
        per_round[method] = times
        senders = m if method == "sharded" else 1
        trainer_rows = rows[:senders]
        expected = expected_shares(params, senders)
        uneven = uneven_params(params, senders)
        if method == "sharded" and config.tp is not None:  # the Megatron-shaped layout's shares, from the preset alone
            from hal.tools.bench.senders_megatron import expected_megatron_shares, unevenly_split

            expected = expected_megatron_shares(params, config.tp, config.pp)
            uneven = unevenly_split(params, config.tp, config.pp)
        share = check_byte_shares(
            model_bytes=model,
            expected=expected,
            plan=[x["plan_bytes"] for x in trainer_rows],
            sent=[x["sent_bytes"] for x in trainer_rows],
            held=[x["held_bytes"] for x in trainer_rows],
            reported_model=[b for x in trainer_rows for b in x["model_bytes"]],
            received=[b for r in receivers for b in reports[r]["methods"][method]["received_bytes"]],
            uneven=uneven,
        )
        short = [(i, x["segment_bytes"]) for i, x in enumerate(trainer_rows) if any(b < x["plan_bytes"] for b in x["segment_bytes"])]
        if short:
            raise ShareError(f"{method}: trainer rank {short[0][0]} handed its transport {min(short[0][1])} bytes in a sync, less than its share")
        if any(len(x["sent_bytes"]) != syncs for x in trainer_rows):
            raise ShareError(f"{method}: a trainer rank counted {[len(x['sent_bytes']) for x in trainer_rows]} syncs, expected {syncs}")
        verified = [reports[r]["methods"][method]["verified"] for r in receivers]
        if config.verify and verified != [syncs] * config.receivers:
            raise RuntimeError(f"{method}: the receivers verified {verified} syncs, expected {syncs} each")
        checks[method] = share
        seconds = statistics.median(times)
        extras = [x["peak_extra_bytes"] for x in rows]
        results.append(
            {
                "method": method,
                "senders": senders,
                "seconds": seconds,
                "best_seconds": min(times),
                "all_seconds": times,
                "gib_per_s": model / seconds / GIB,
                "ratio_to_one_sender": None,
                "ratio_to_plain_sender": None,
                "peak_extra_bytes": None if None in extras else max(extras),
                "peak_extra_bytes_per_rank": dict(zip(ranks, extras)),
                "cpu_s_per_rank": dict(zip(ranks, (statistics.median(x["cpu_s"]) for x in rows))),
                "segment_bytes_per_rank": [max(x["segment_bytes"]) for x in trainer_rows],  # the most in any sync
                "bytes_per_rank": share["plan_bytes_per_rank"],
                "share_check": share,
                "verified_syncs_per_receiver": verified,
            }
        )
    def ratio(method: str, to: str) -> float | None:
        if method not in per_round or to not in per_round:
            return None
        return statistics.median(t / o for t, o in zip(per_round[method], per_round[to]))

    for r in results:
        r["ratio_to_one_sender"] = ratio(r["method"], "one_sender")
        r["ratio_to_plain_sender"] = ratio(r["method"], "plain_sender")
    return {
        "preset": config.preset,
        "mode": "senders",
        "bytes": model,
        "tensors": len(params),
        "senders": m,
        "receivers": config.receivers,
        "config": {**{k: v for k, v in asdict(config).items() if k != "methods"}, "methods": list(config.methods)},
        "timing": f"median of {config.repeats} interleaved rounds after {config.warmup} warm-up sync(s) per method",
        "torch_threads_per_process": config.threads,
        "layout": "fsdp2" if config.tp is None else f"megatron tp={config.tp} pp={config.pp}",
        "ratio_senders_to_one": ratio("sharded", "one_sender"),
        "ratio_senders_to_plain": ratio("sharded", "plain_sender"),
        "results": results,
        "processes": len(reports),
        "pids": [r["pid"] for r in reports],
        "setup_wall_s": max(r["setup_wall_s"] for r in reports),
        "wall_s": wall,
    }


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """`hal bench --senders ...`: the run its arguments ask for (the other modes' flags refused by name)."""
    unsupported = [
        flag
        for flag, given in (
            ("--engine vllm", getattr(args, "engine", "transfer") != "transfer"), ("--delta", getattr(args, "delta", False)),
            ("--delta-kernels", getattr(args, "delta_kernels", False)), ("--device-transfer", getattr(args, "device_transfer", False)),
            ("--methods", getattr(args, "methods", None) is not None), ("--nodes", getattr(args, "nodes", 1) != 1),
            ("--trace", getattr(args, "trace", False)), ("--plot", bool(getattr(args, "plot", None))),
        )
        if given
    ]
    if unsupported:
        raise SystemExit(f"hal bench: --senders does not take {', '.join(unsupported)}")
    try:
        config = SendersConfig(
            preset=args.preset, senders=args.senders, receivers=args.receivers, repeats=args.repeats, warmup=args.warmup,
            bucket_bytes=int(args.bucket_mb * 1024 * 1024) if args.bucket_mb is not None else None,
            timeout_s=args.timeout, verify=args.verify, threads=args.threads, sync_backend=args.sync_backend,
            tp=getattr(args, "tp", None),
        )
    except ValueError as exc:
        raise SystemExit(f"hal bench: {exc}") from None
    return run_senders(config)


def _layout_words(layout: str) -> str:
    return "Shard(0) DTensors" if layout == "fsdp2" else f"a Megatron-shaped layout ({layout}: row and column blocks, norms replicated over TP)"


def format_table(report: dict[str, Any]) -> str:
    """What `hal bench --senders` prints."""
    m, k = report["senders"], report["receivers"]
    model = report["bytes"]
    lines = [
        f"preset {report['preset']}: {model / GIB:.3f} GiB in {report['tensors']} tensors; {m} trainer rank(s) holding "
        f"{_layout_words(report.get('layout', 'fsdp2'))} -> {k} receiver(s); {report['timing']}; "
        f"{report['torch_threads_per_process']} torch thread(s) per process",
        f"{'method':<12} {'senders':>7} {'seconds':>8} {'best':>8} {'GiB/s':>7} {'x one_sender':>12} {'x plain':>8} {'peak extra MiB':>15}  bytes sent per trainer rank",
    ]
    for r in report["results"]:
        one = "-" if r["ratio_to_one_sender"] is None else f"{r['ratio_to_one_sender']:.2f}"
        plain = "-" if r["ratio_to_plain_sender"] is None else f"{r['ratio_to_plain_sender']:.2f}"
        peak = "n/a" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / MIB:.0f}"
        shares = ", ".join(f"{b:,}" for b in r["bytes_per_rank"])
        lines.append(
            f"{r['method']:<12} {r['senders']:>7} {r['seconds']:>8.3f} {r['best_seconds']:>8.3f} {r['gib_per_s']:>7.2f} {one:>12} {plain:>8} {peak:>15}  {shares}"
        )
    if report["ratio_senders_to_one"] is not None:
        lines.append(f"{m} senders / 1 sender (the same path, M = 1): {report['ratio_senders_to_one']:.2f}x (median of same-round ratios)")
    if report.get("ratio_senders_to_plain") is not None:
        lines.append(f"{m} senders / 1 sender (hal.sync's Sender / Receiver): {report['ratio_senders_to_plain']:.2f}x")
    for r in report["results"]:
        c = r["share_check"]
        n = r["senders"]
        if c["rows_divide_evenly"]:
            how = f"each = model / {n} = {model // n:,} exactly (every parameter's rows divide by {n})"
        else:
            names = c["uneven_params"]
            listed = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
            split = "rows do NOT divide evenly by" if report.get("layout", "fsdp2") == "fsdp2" or n == 1 else "the layout does not split evenly over"
            how = (
                f"{split} {n} for {len(names)} parameter(s) ({listed}): the shares differ from "
                f"model / {n} by up to {c['max_deviation_from_model_over_m_bytes']:,.0f} bytes ({c['max_deviation_from_model_over_m']:.2%})"
            )
        syncs = c["syncs_checked_per_rank"][0] if c["syncs_checked_per_rank"] else 0
        if n == 1:
            lines.append(f"checked {r['method']}: trainer rank 0 sent the whole model ({model:,} bytes, its plan share) in each of {syncs} sync(s)")
        else:
            held = "Shard(0) rows" if report.get("layout", "fsdp2") == "fsdp2" else "blocks, and its rows of its stage's norms"
            lines.append(
                f"checked {r['method']}: every trainer rank sent its plan share (= the bytes of its {held}) in each of {syncs} "
                f"sync(s); the shares sum to the model ({model:,} bytes); {how}"
            )
        lines.append(
            "  bytes handed to the transport per trainer rank (segments, with their padding): "
            + ", ".join(f"{b:,.0f}" for b in r["segment_bytes_per_rank"])
        )
        if r["verified_syncs_per_receiver"] and any(r["verified_syncs_per_receiver"]):
            lines.append(f"checked {r['method']}: {len(r['verified_syncs_per_receiver'])} receiver(s) bit-exact after every sync")
    return "\n".join(lines)
