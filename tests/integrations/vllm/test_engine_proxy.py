"""hal.integrations.vllm.engine_proxy: an engine's calls served on 127.0.0.1 and the
`RemoteEngine` other processes drive it through (no vLLM: a plain object stands in)."""

from __future__ import annotations

import socket

import pytest

from hal.integrations.vllm.engine_proxy import ENGINE_CALLS, RemoteEngine, serve_engine

pytestmark = [pytest.mark.cpu]


class Recorder:
    """Every `Engine` call, recorded; `get_weight_version` answers the last version set."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.version = ""

    def __getattr__(self, name: str):
        if name not in ENGINE_CALLS:
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, *args))
            if name in ("finish_weight_update", "update_weight_version") and args and args[0]:
                self.version = args[0]
            if name == "start_weight_update" and self.version == "refuse":
                raise ValueError("the engine refuses: parameter 'lm_head.weight' has shape (3, 4)")
            return self.version if name == "get_weight_version" else None

        return call


def test_a_remote_engine_drives_the_served_one_and_raises_its_errors():
    engine = Recorder()
    with serve_engine(engine, extra={"greedy": lambda prompts: [p[::-1] for p in prompts]}) as address:
        assert address[0] == "127.0.0.1"  # this machine's processes only
        remote = RemoteEngine(address, name="tp2", num_workers=2)
        remote.init_weight_transfer_engine({"master_port": 1234, "rendezvous": [{"address": "127.0.0.1", "port": 1}]})
        remote.start_weight_update()
        remote.update_weights({"version": 3})
        remote.finish_weight_update("3")
        assert remote.get_weight_version() == "3"
        assert remote.call("greedy", [[1, 2, 3]]) == [[3, 2, 1]]  # an extra call, named
        remote.update_weight_version("refuse")
        with pytest.raises(RuntimeError, match=r"ValueError: the engine refuses: parameter 'lm_head.weight' has shape \(3, 4\)"):
            remote.start_weight_update()
        with pytest.raises(RuntimeError, match=r"KeyError: .*no call 'generate' \(served: .*greedy.*\)"):
            remote.call("generate", [1])
    assert engine.calls[:4] == [
        ("init_weight_transfer_engine", {"master_port": 1234, "rendezvous": [{"address": "127.0.0.1", "port": 1}]}),
        ("start_weight_update",), ("update_weights", {"version": 3}), ("finish_weight_update", "3"),
    ]
    # the server stopped with its block: nothing listens there any more
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=5).close()


def test_a_rank_without_an_address_only_names_and_counts_the_engine():
    remote = RemoteEngine(None, name="tp2", num_workers=2)
    assert (remote.name, remote.num_workers, remote.same_node) == ("tp2", 2, False)
    with pytest.raises(RuntimeError, match="engine 'tp2': start_weight_update called on a trainer rank that holds no address"):
        remote.start_weight_update()


def test_extra_calls_may_not_replace_the_engines_own():
    with pytest.raises(ValueError, match=r"extra calls \['update_weights'\] would replace the engine's own"):
        with serve_engine(Recorder(), extra={"update_weights": lambda info: None}):
            pass


def test_a_client_that_connects_and_says_nothing_does_not_hold_the_server():
    """Its read is bounded (`timeout_s`), and the block ends all the same while it is open."""
    with serve_engine(Recorder(), timeout_s=1.0) as address:
        silent = socket.create_connection(address, timeout=60)
        try:
            assert RemoteEngine(address).get_weight_version() == ""  # served beside it
            assert silent.recv(1 << 16)  # the server gave up on it: an error line, then the end
        finally:
            silent.close()
