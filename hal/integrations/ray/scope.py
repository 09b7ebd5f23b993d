"""`ActorScope`: every Ray actor and placement group added to it is gone when it closes.

Gone as Ray reports it (actors dead, placement groups removed) and, for an actor on this
node, as the operating system does (its process and the processes it started exited, and
the /dev/shm names they held unlinked: hal.engine_processes), so that a test or a demo
leaves nothing running behind. Imports Ray only when it closes.
"""

from __future__ import annotations

import os
import time
from typing import Any, TypeVar

from hal.engine_processes import EngineProcesses
from hal.integrations._shared import import_ray

_A = TypeVar("_A")


def _whereabouts(_actor: Any) -> tuple[str, int]:
    """Run inside an actor through `__ray_call__`: its node and process id."""
    import os as _os

    import ray as _ray

    return _ray.get_runtime_context().get_node_id(), _os.getpid()


class ActorScope:
    """Every actor and placement group added here is gone after `close()` (or the `with`).

    `close()` kills each actor, waits until Ray reports it dead and, for an actor on this
    node, until its process has exited; the processes it started are then killed if still
    running, and the /dev/shm names they held unlinked if nothing alive holds them; then
    removes each placement group and waits until Ray reports it removed. Past `timeout_s` it raises TimeoutError naming what is left.
    """

    def __init__(self, *, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._actors: list[tuple[Any, Any]] = []  # (handle, where it runs: an ObjectRef of _whereabouts)
        self._groups: list[Any] = []

    def add(self, actor: _A) -> _A:
        """Track `actor` (returned, so that `scope.add(Cls.remote())` reads naturally)."""
        self._actors.append((actor, actor.__ray_call__.remote(_whereabouts)))
        return actor

    def add_placement_group(self, placement_group: _A) -> _A:
        self._groups.append(placement_group)
        return placement_group

    def __enter__(self) -> ActorScope:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        ray = import_ray()
        deadline = time.monotonic() + self.timeout_s
        actors, self._actors = self._actors, []
        groups, self._groups = self._groups, []
        if not ray.is_initialized():
            return  # Ray is gone, and everything it ran with it
        here = ray.get_runtime_context().get_node_id()
        processes: list[int] = []
        refs = [where for _, where in actors]
        if refs:  # an actor added a moment ago may not have answered yet: give it a second
            ray.wait(refs, num_returns=len(refs), timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        for actor, where in actors:
            ready, _ = ray.wait([where], timeout=0)
            if ready:
                try:
                    node, pid = ray.get(where)
                    if node == here:
                        processes.append(pid)
                except ray.exceptions.RayError:
                    pass  # it never started or already died
        # what the local actors run (an engine actor's vLLM workers) and the /dev/shm names
        # they hold: a killed actor's engine cannot unlink its shared memory itself
        leftovers = EngineProcesses.record(processes)
        for actor, _ in actors:
            ray.kill(actor, no_restart=True)
        left = [_wait_dead(ray, actor, deadline) for actor, _ in actors]
        left = [str(a) for a in left if a is not None]
        left += [f"process {pid}" for pid in processes if not _wait_exited(pid, deadline)]
        leftovers.release(grace_s=max(1.0, min(10.0, deadline - time.monotonic())))
        from ray.util.placement_group import placement_group_table, remove_placement_group

        for pg in groups:
            remove_placement_group(pg)
        for pg in groups:
            while placement_group_table(pg).get("state") != "REMOVED" and time.monotonic() < deadline:
                time.sleep(0.05)
            if placement_group_table(pg).get("state") != "REMOVED":
                left.append(f"placement group {pg.id.hex()}")
        if left:
            raise TimeoutError(f"ActorScope: still there after {self.timeout_s:g} s: {', '.join(left)}")


def _wait_dead(ray: Any, actor: Any, deadline: float) -> Any:
    """None once Ray reports `actor` dead; the actor if it is not by the deadline."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return actor
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=remaining)
        except ray.exceptions.ActorDiedError:
            return None
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.05)


def _wait_exited(pid: int, deadline: float) -> bool:
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return True  # a process of another user has that id now: ours is gone
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
