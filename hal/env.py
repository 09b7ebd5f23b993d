"""Every environment variable verl-hal reads, in one table.

Read through these helpers only, so that a reader finds here what can change the
library's behaviour from outside.
"""

from __future__ import annotations

import os

# Which backend `hal.current()` resolves: auto | cpu | cuda | npu | sim | a registered name.
VERL_DEVICE = "VERL_DEVICE"
# Seconds the simulated accelerator sleeps before each operation on a stream (default 0).
# Makes a missing wait visible: a read that races the copy sees the old bytes.
VERL_HAL_SIM_LATENCY = "VERL_HAL_SIM_LATENCY"


def device_name() -> str:
    """The requested backend name, lower-cased; `auto` when unset or empty."""
    return (os.environ.get(VERL_DEVICE) or "auto").strip().lower()


def sim_latency_seconds() -> float:
    raw = os.environ.get(VERL_HAL_SIM_LATENCY, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{VERL_HAL_SIM_LATENCY}={raw!r}: expected a number of seconds") from None
    if value < 0:
        raise ValueError(f"{VERL_HAL_SIM_LATENCY}={raw!r}: must not be negative")
    return value


# Root of the Ascend CANN toolkit; only the npu backend's `runtime_versions()` reads it
# (hal.backends.npu.read_npu_versions), to find the toolkit's version file. Default: where
# the CANN installer puts it.
ASCEND_HOME_PATH = "ASCEND_HOME_PATH"
ASCEND_HOME_DEFAULT = "/usr/local/Ascend/ascend-toolkit/latest"


def ascend_home() -> str:
    return os.environ.get(ASCEND_HOME_PATH) or ASCEND_HOME_DEFAULT


# The secret a trainer must prove it knows before an engine accepts its weights (the
# vLLM "hal" engines read it at start; the trainer-side `WeightSync` reads it too unless
# given `token=`). Unset: engines accept any trainer that reaches them, and warn at start.
# docs/security.md has the threat model.
VERL_HAL_SYNC_TOKEN = "VERL_HAL_SYNC_TOKEN"


def sync_token() -> str | None:
    """The sync token, or None when unset or empty."""
    return os.environ.get(VERL_HAL_SYNC_TOKEN) or None


# Which node this process is on, for transports that cross the network once per node
# (`hal.sync.HierarchicalTransport`): ranks with equal keys share memory. Default: the host
# name. Set it to give processes on one machine different keys (tests, benchmarks), or to
# one key for hosts that share memory some other way.
VERL_HAL_NODE = "VERL_HAL_NODE"


def node_key() -> str:
    """This process's node key: VERL_HAL_NODE, else the host name."""
    import socket

    return os.environ.get(VERL_HAL_NODE) or socket.gethostname()
