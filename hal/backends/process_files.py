"""Files a device runtime leaves in /dev/shm for a process that shared device memory.

A process that exports CUDA memory (an IPC event handle, which torch makes for every shared
storage) gets a small file from the driver, `/dev/shm/cuda.shm.<n>.<pid in hex>.<n>`,
that the driver leaves behind when the process ends, however it ends (seen on an H200,
2026-11-27). torch's IPC reference counters (`/dev/shm/torch_<pid>_<n>_<n>`) are removed
by torch's own exit code, which a multiprocessing child (it ends with `os._exit`) or a
killed process never runs. Backends declare their runtime's names as `process_files`
(glob patterns, formatted with `pid`); each file's name carries its process's id, so a file of a
process that has ended is nobody's.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
from typing import Iterable

SHM_DIR = "/dev/shm"
# torch's reference counters of shared device storages (torch and torch_npu name them alike)
TORCH_COUNTERS = "torch_{pid}_*"

_at_exit: set[tuple[int, tuple[str, ...]]] = set()


def remove_process_files(pid: int, formats: Iterable[str]) -> list[str]:
    """Unlink the files of process `pid` that match `formats`; the names removed."""
    patterns = [f.format(pid=pid) for f in formats]
    if not patterns:
        return []
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = []
    for entry in entries:
        if any(fnmatch.fnmatchcase(entry, p) for p in patterns):
            with contextlib.suppress(OSError):  # another cleaner got there first
                os.unlink(os.path.join(SHM_DIR, entry))
                removed.append(entry)
    return removed


def remove_at_exit(formats: tuple[str, ...]) -> None:
    """Remove this process's files named by `formats` when it ends normally, also as a
    multiprocessing child: multiprocessing runs its finalizers there before `os._exit`
    (and through `atexit` in a main process), where an `atexit` hook alone never runs.
    Once per process and formats; a forked child registers again under its own pid."""
    key = (os.getpid(), formats)
    if not formats or key in _at_exit:
        return
    _at_exit.add(key)
    from multiprocessing import util

    util.Finalize(None, _remove_own_files, args=(os.getpid(), formats), exitpriority=-100)


def _remove_own_files(pid: int, formats: tuple[str, ...]) -> None:
    # A child forked by hand (os.fork) inherits the finalizer: only the process that
    # registered it removes its files; the parent's live ones stay (an importer of its
    # event handles opens them by name).
    if os.getpid() == pid:
        remove_process_files(pid, formats)
