"""An engine's processes, and the named shared memory they hold, gone after a stop.

vLLM's engines with several workers share memory through names in /dev/shm (the
message queue between its processes, `psm_*`, about 240 MiB for TP=2 on the CPU; the
CPU communicator's `vllm_dist_*`). The process that creates a name unlinks it at exit,
if it gets to: one killed (vLLM's own shutdown escalates to SIGKILL after its grace
period; a Ray actor is killed outright) leaves the name, and its memory, behind until
reboot. So whoever stops an engine through hal records, before the stop, which
processes are the engine's and which /dev/shm names they map or hold open; after the
stop it waits for those processes, kills what is left of them, and unlinks each
recorded name that no live process holds any more.

Why this and not an engine whose names cannot outlive it: the names are vLLM's (Python's
`multiprocessing.shared_memory` and vLLM's C++ communicator pick them), and a private
/dev/shm (a mount namespace) needs privileges a user's trainer rarely has. Recording is
exact instead: only names the engine's own processes held are candidates, a name is
unlinked only if it still is the same file (its inode) and nothing alive holds it.

Linux only (it reads /proc); elsewhere recording finds nothing and release does nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

_PROC = Path("/proc")
_SHM_PREFIX = "/dev/shm/"
_DELETED = " (deleted)"

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProcessId:
    """A process as it was when recorded: its pid and its start time (so that a pid the
    kernel hands to a new process later is not mistaken for it)."""

    pid: int
    started: int  # field 22 of /proc/<pid>/stat, clock ticks since boot


@dataclass(frozen=True, slots=True)
class ShmName:
    """A /dev/shm file as it was when recorded: its path and its inode."""

    path: str
    inode: int


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces), or None if gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _identify(pid: int) -> ProcessId | None:
    fields = _stat_fields(pid)
    return None if fields is None else ProcessId(pid, int(fields[19]))


def _alive(proc: ProcessId) -> bool:
    """Still running (a zombie holds no memory: it counts as gone)."""
    fields = _stat_fields(proc.pid)
    return fields is not None and fields[0] != "Z" and int(fields[19]) == proc.started


def _all_pids() -> list[int]:
    try:
        return [int(p) for p in os.listdir(_PROC) if p.isdigit()]
    except OSError:
        return []


def _tree(roots: Iterable[int]) -> list[ProcessId]:
    """`roots` and every descendant of theirs, as they are now."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        fields = _stat_fields(pid)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(pid)
    seen: list[int] = []
    todo = [r for r in roots]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        todo.extend(children.get(pid, ()))
    return [p for p in map(_identify, seen) if p is not None]


def _held_by(pid: int) -> set[ShmName]:
    """The /dev/shm names process `pid` maps or holds open (names already unlinked excluded)."""
    held: set[ShmName] = set()
    try:
        lines = (_PROC / str(pid) / "maps").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith(_SHM_PREFIX) and not parts[5].endswith(_DELETED):
            held.add(ShmName(parts[5], int(parts[4])))
    fd_dir = _PROC / str(pid) / "fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(fd_dir / fd)
            if target.startswith(_SHM_PREFIX) and not target.endswith(_DELETED):
                held.add(ShmName(target, os.stat(fd_dir / fd).st_ino))
        except OSError:
            continue  # closed meanwhile
    return held


def held_anywhere() -> set[ShmName]:
    """Every /dev/shm name some live process (that this user may inspect) maps or holds open."""
    held: set[ShmName] = set()
    for pid in _all_pids():
        held |= _held_by(pid)
    return held


@dataclass(slots=True)
class EngineProcesses:
    """What an engine ran as, recorded before it is stopped: `release()` after the stop."""

    processes: list[ProcessId] = field(default_factory=list)
    names: set[ShmName] = field(default_factory=set)

    @classmethod
    def record(cls, roots: Iterable[int]) -> EngineProcesses:
        """The processes `roots` and their descendants, and the /dev/shm names they hold now.
        The caller's own process is never one of them (it is not stopped)."""
        me = os.getpid()
        processes = [p for p in _tree(r for r in roots if r != me) if p.pid != me]
        names: set[ShmName] = set()
        for p in processes:
            names |= _held_by(p.pid)
        return cls(processes, names)

    def merged(self, other: EngineProcesses) -> EngineProcesses:
        """Both records at once: an engine recorded while it ran (every process alive) and
        again at its stop (a process that died meanwhile is only in the first)."""
        known = set(self.processes)
        return EngineProcesses([*self.processes, *(p for p in other.processes if p not in known)], self.names | other.names)

    def release(self, *, grace_s: float = 5.0) -> list[str]:
        """After the stop: wait up to `grace_s` for the recorded processes to exit, kill
        those still running (and wait for them as long again), then unlink every recorded
        name that is still the recorded file and that no live process holds. Returns the
        paths unlinked. Never raises for a process or file that is already gone."""
        self._wait(grace_s)
        for proc in self.processes:
            if _alive(proc):
                log.warning("engine process %d still running %.0f s after its stop: killing it", proc.pid, grace_s)
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self._wait(grace_s)
        if not self.names:
            return []
        still_held = held_anywhere()
        unlinked = []
        for name in sorted(self.names, key=lambda n: n.path):
            if name in still_held:
                continue
            try:
                if os.stat(name.path).st_ino != name.inode:
                    continue  # the name was reused for another file
                os.unlink(name.path)
            except OSError:
                continue  # its owner unlinked it: the usual case
            unlinked.append(name.path)
        if unlinked:
            log.info("unlinked %d /dev/shm name(s) the engine's processes left: %s", len(unlinked), ", ".join(unlinked))
        return unlinked

    def _wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while any(map(_alive, self.processes)) and time.monotonic() < deadline:
            time.sleep(0.05)
