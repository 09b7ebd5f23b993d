"""The `verl.plugins` entry point, verl's platform "hal" and the checkpoint engine's settings.

Questions to verl's platform singleton (`get_platform()`, resolved once per process) run
in fresh interpreters; the platform class itself is asked directly.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

import hal

pytestmark = [pytest.mark.verl, pytest.mark.cpu]

pytest.importorskip("verl", reason="needs verl 0.9.1: make setup-verl, then run the verl lane (ci/verl.sh)")

from tests.conftest import run_python  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def test_one_entry_point_and_verls_device_code_through_hal():
    """In one fresh interpreter (importing verl takes seconds): `import verl` loads our
    entry point, which registers the platform and the checkpoint engine and does nothing
    else; then the issue's command, and more of `verl.utils.device`, with VERL_PLATFORM=hal."""
    ours = [ep for ep in entry_points(group="verl.plugins") if ep.value.startswith("hal.")]
    assert [(ep.name, ep.value) for ep in ours] == [("hal", "hal.integrations.verl.plugin")]
    proc = run_python(
        """
        import json, sys
        import verl  # loads every verl.plugins entry point, ours among them
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.plugin.platform import PlatformRegistry, get_platform
        import hal.device
        from hal.integrations.verl import internals as verl_internals
        registered = {
            "platform": PlatformRegistry.get("hal").__qualname__,
            "engine": CheckpointEngineRegistry.get("hal").__qualname__,
            "platforms": sorted(PlatformRegistry.registered_names()),
            "optional": sorted(m for m in sys.modules if m.split(".")[0] in ("torch_npu", "vllm")),
            "resolved": hal.device._resolved is not None,
            "platform_chosen": verl_internals.platform_chosen(),
        }
        from verl.utils.device import get_device_name
        print(get_device_name())  # the issue's command
        from verl.utils import device as d
        p = get_platform()
        d.manual_seed(5); d.manual_seed_all(5); d.set_expandable_segments(True)
        with p.nvtx_range("step"):
            pass
        p.profiler_start(); p.profiler_stop(); p.synchronize(); p.empty_cache()
        answers = [d.get_device_name(), d.get_nccl_backend(), d.get_resource_name(), d.get_vendor(),
                   d.get_visible_devices_keyword(), d.get_device_id(), d.get_torch_device().__name__,
                   d.is_device_available(), d.is_support_ipc(), list(d.get_device_capability()),
                   p.ray_resource_options(1), p.ray_noset_envvars(), type(p).__name__]
        print(json.dumps([registered, answers]))
        """,
        env={"VERL_PLATFORM": "hal", "VERL_DEVICE": "cpu"},
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    *_, command_output, last = proc.stdout.strip().splitlines()
    assert command_output == "cpu"
    registered, answers = json.loads(last)
    assert registered == {
        "platform": "HalPlatform",
        "engine": "HalCheckpointEngine",
        "platforms": ["amd", "hal", "huawei", "nvidia"],  # verl's three and ours
        "optional": [],  # no torch_npu, no vLLM
        "resolved": False,  # importing resolved no backend
        "platform_chosen": False,  # and chose no platform
    }
    assert answers == [
        "cpu", "gloo", "CPU", "cpu", "CUDA_VISIBLE_DEVICES", 0, "torch.cpu", True, False, [None, None], {}, [], "HalPlatform",
    ]


def test_the_docs_check_commands_print_what_the_doc_says():
    """docs/verl.md's first bash block, run as written (its `.venv-verl/bin/python` is this
    interpreter, wherever VENV_VERL put it), prints the text block after it: `cpu`, then
    hal's one-line error naming the valid backends. The two run side by side."""
    doc = (REPO_ROOT / "docs" / "verl.md").read_text()
    commands = re.search(r"```bash\n(.*?)```", doc, re.S).group(1).strip().splitlines()
    expected = re.search(r"```text\n(.*?)```", doc, re.S).group(1).strip().splitlines()
    assert len(commands) == len(expected) == 2
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_DEVICE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            ["bash", "-c", command.replace(".venv-verl/bin/python", shlex.quote(sys.executable))],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for command in commands
    ]
    outputs = [proc.communicate(timeout=240) for proc in procs]
    for command, (out, err), want in zip(commands, outputs, expected):
        assert out.strip().splitlines()[-1:] == [want], f"{command}\nstdout: {out}\nstderr: {err}"


def test_sim_answers_as_the_cpu_it_computes_on(hal_reset, monkeypatch):
    from hal.integrations.verl.platform import HalPlatform

    monkeypatch.setenv("VERL_DEVICE", "sim")
    platform = HalPlatform()
    assert (platform.device_name, platform.communication_backend_name(), platform.ray_resource_name()) == ("cpu", "gloo", "CPU")
    assert platform.is_available() and hal.current().name == "sim"
    platform.synchronize()  # waits for the simulated streams


def test_a_driver_without_the_device_still_plans_for_it(hal_reset, monkeypatch):
    """A CPU-only Ray driver with VERL_DEVICE=cuda: the declared answers come from the
    backend's class, device work raises hal's reason."""
    from hal.backends.types import BackendUnavailableError
    from hal.backends.cuda import CudaBackend
    from hal.integrations.verl.platform import HalPlatform

    if CudaBackend.is_available():
        pytest.skip("a usable GPU here: the planning-only path is not taken")
    monkeypatch.setenv("VERL_DEVICE", "cuda")
    p = HalPlatform()
    assert [p.device_name, p.communication_backend_name(), p.ray_resource_name(), p.visible_devices_envvar()] == [
        "cuda", "nccl", "GPU", "CUDA_VISIBLE_DEVICES",
    ]
    assert p.ray_resource_options(0.5) == {"num_gpus": 0.5}
    assert p.ray_noset_envvars() == ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]
    assert p.vendor_name == "nvidia" and p.is_available() is False
    with pytest.raises(BackendUnavailableError, match="backend 'cuda' is not usable"):
        p.synchronize()
    monkeypatch.setenv("VERL_DEVICE", "bogus")
    hal.reset()
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        p.device_name  # noqa: B018


def test_the_installed_verl_is_one_the_plugin_was_checked_against(monkeypatch):
    from hal.integrations.verl import internals as verl_internals

    assert verl_internals.unsupported_verl() is None, verl_internals.verl_version()
    monkeypatch.setattr(verl_internals, "verl_version", lambda: "0.10.0")
    assert verl_internals.unsupported_verl() == (
        "verl-hal's verl plugin was checked against verl 0.9.x; verl 0.10.0 is installed (see hal/integrations/verl/internals.py)"
    )


def test_hal_is_never_auto_detected():
    from hal.integrations.verl.platform import HalPlatform

    assert HalPlatform().is_platform_available(use_smi_check=True) is False


def test_allocator_settings_and_seeds(hal_reset, monkeypatch, caplog):
    from hal.integrations.verl.platform import HalPlatform

    monkeypatch.setenv("VERL_DEVICE", "cpu")
    platform = HalPlatform()
    caplog.set_level("DEBUG", logger="hal.integrations.verl.platform")
    platform.set_allocator_settings("expandable_segments:True")
    assert "has no caching allocator" in caplog.text
    with pytest.raises(ValueError, match="allocator setting 'max_split_size_mb:128' is not supported"):
        platform.set_allocator_settings("max_split_size_mb:128")
    with pytest.raises(ValueError, match="expected True or False"):
        platform.set_allocator_settings("expandable_segments:maybe")
    platform.manual_seed(11)
    first = torch.rand(3)
    platform.manual_seed_all(11)
    assert torch.equal(first, torch.rand(3))  # on the CPU the device generator is torch's own
    assert platform.device_module is torch.cpu and platform.cudart() is None
    assert platform.get_device_capability(0) == (None, None)
    with pytest.raises(ValueError, match="out of range"):
        platform.get_device_capability(3)


def test_cuda_answers_through_the_backend_hooks(monkeypatch):
    """With a fake torch.cuda: every answer is the cuda backend's (no device branch in the plugin)."""
    from hal.backends.cuda import CudaBackend
    from hal.integrations.verl.platform import HalPlatform

    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize",)))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: calls.append(("manual_seed", s)))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: calls.append(("manual_seed_all", s)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append(("profiler_start",)))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append(("profiler_stop",)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda msg: calls.append(("push", msg)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    monkeypatch.setattr(torch.version, "hip", None)
    settings = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append, raising=False)
    with hal.use(CudaBackend()):
        platform = HalPlatform()
        assert (platform.device_name, platform.vendor_name, platform.communication_backend_name()) == ("cuda", "nvidia", "nccl")
        assert platform.device_module is torch.cuda
        assert platform.ray_resource_options(1) == {"num_gpus": 1}
        assert platform.current_device() == 1 and platform.device_count() == 2
        platform.synchronize()
        platform.synchronize(0)  # another device: selected for the call, then the current one again
        platform.manual_seed(3)
        platform.manual_seed_all(4)
        with platform.nvtx_range("rollout"):
            pass
        platform.profiler_start()
        platform.profiler_stop()
        platform.set_allocator_settings("expandable_segments:False")
        assert platform.get_device_capability(1) == (9, 0)
        assert platform.is_ipc_supported() is True
        monkeypatch.setattr(torch.version, "hip", "6.2")
        assert platform.vendor_name == "amd" and platform.is_ipc_supported() is False
    assert calls == [
        ("synchronize",),
        ("set_device", 0), ("synchronize",), ("set_device", 1),
        ("manual_seed", 3), ("manual_seed_all", 4),
        ("push", "rollout"), ("pop",),
        ("profiler_start",), ("profiler_stop",),
    ]
    assert settings == ["expandable_segments:False"]


# ---- the checkpoint engine's settings ---------------------------------------------------------
def test_settings_map_onto_sync_config_by_field_name():
    from hal.integrations.verl.checkpoint import HalCheckpointEngine, sync_config_from

    default = 2048 << 20  # verl's update_weights_bucket_megabytes default: hal sizes the buckets
    assert sync_config_from(default, {}).bucket_bytes is None
    assert sync_config_from(128 << 20, {}).bucket_bytes == 128 << 20  # the user said otherwise
    config = sync_config_from(default, {"bucket_bytes": 1 << 20, "verify": True, "wire_dtype": "bfloat16", "timeout_s": 5})
    assert (config.bucket_bytes, config.verify, config.wire_dtype, config.timeout_s) == (1 << 20, True, torch.bfloat16, 5)
    engine = HalCheckpointEngine(bucket_size=default, is_master=True, transport="broadcast", bypass_cpu=False, segment_bytes=None)
    assert (engine.config.bypass_cpu, engine.config.segment_bytes, engine.is_master) == (False, None, True)
    from hal.sync import DeltaConfig

    assert sync_config_from(default, {"delta": {"anchor_every": 8, "choose": "bytes"}}).delta == DeltaConfig(anchor_every=8, choose="bytes")
    assert sync_config_from(default, {"delta": True}).delta == DeltaConfig()
    assert sync_config_from(default, {"delta": False}).delta is None and sync_config_from(default, {}).delta is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"bucket_size_mb": 1}, "unknown setting(s) 'bucket_size_mb' in engine_kwargs['hal']; valid: the SyncConfig fields bucket_bytes"),
        ({"rebuild_group": True}, "unknown setting(s) 'rebuild_group'"),
        ({"wire_dtype": "bf17"}, "wire_dtype 'bf17' is not a torch dtype name"),
        ({"timeout_s": 0}, "SyncConfig.timeout_s must be positive"),
        ({"delta": {"anchor_every": 8, "every": 2}}, "unknown delta setting(s) 'every'; valid: anchor_every, baseline, choose"),
        ({"delta": "yes"}, "delta must be true, false or a mapping"),
        ({"delta": {"choose": "speed"}}, "DeltaConfig.choose must be 'time' or 'bytes'"),
    ],
)
def test_an_unknown_or_bad_setting_is_refused_by_name(settings, message):
    from hal.integrations.verl.checkpoint import HalCheckpointEngine

    with pytest.raises(ValueError) as error:
        HalCheckpointEngine(bucket_size=2048 << 20, **settings)
    assert message in str(error.value)


def test_two_bucket_sizes_that_disagree_are_refused():
    from hal.integrations.verl.checkpoint import sync_config_from

    with pytest.raises(ValueError, match=r"update_weights_bucket_megabytes says 128 MiB .*bucket_bytes says 1048576: set one"):
        sync_config_from(128 << 20, {"bucket_bytes": 1 << 20})
    with pytest.raises(ValueError, match="transport must be one of auto, broadcast, ipc, hierarchical"):
        from hal.integrations.verl.checkpoint import HalCheckpointEngine

        HalCheckpointEngine(bucket_size=1 << 20, transport="nccl-ish")


def _metadata(node: str, *, master: bool = False, group=None, rank=None, host_ipc=True, transport="auto", senders=None, port=30000):
    m = {"master": master, "node": node, "group": group, "rank": rank}
    if senders is not None:
        m["senders"] = senders
    if master or senders == "all":
        m.update(address=f"10.0.0.{port % 100}", port=port, local_port=port + 1, transport=transport, host_ipc=host_ipc)
    if senders == "all":
        m["refused"] = None
    return m


def test_topology_sync_ranks_transport_and_group_reuse():
    from hal.integrations.verl.checkpoint import HalCheckpointEngine

    build = HalCheckpointEngine.build_topology
    one_node = [_metadata("a", master=True), _metadata("a"), _metadata("a"), _metadata("a")]
    actor, rollout = build(2, 2, one_node)
    assert actor["rank"] == [0, -1] and rollout["rank"] == [1, 2]
    spec = actor["spec"][0]
    assert (spec.address, spec.port, spec.world_size) == ("127.0.0.1", 30001, 3)  # one node: loopback only
    assert actor["transport"] == ["ipc", "ipc"] and rollout["reuse"] == [False, False]
    # device memory IPC is opt-in: auto goes over the collective library
    assert build(2, 2, [_metadata("a", master=True, host_ipc=False), *one_node[1:]])[0]["transport"][0] == "broadcast"
    # two nodes: the rendezvous on the master's address; one rollout worker per node: broadcast
    two = [_metadata("a", master=True), _metadata("a"), _metadata("b"), _metadata("c")]
    actor, _ = build(2, 2, two)
    assert (actor["spec"][0].address, actor["transport"][0]) == ("10.0.0.0", "broadcast")
    three = [_metadata("a", master=True), _metadata("a"), _metadata("b"), _metadata("b")]
    assert build(2, 2, three)[0]["transport"][0] == "hierarchical"
    # every member still in the same group under the same rank: kept
    key = ("127.0.0.1", 40000, 3)
    kept = [_metadata("a", master=True, group=key, rank=0), _metadata("a"), _metadata("a", group=key, rank=1), _metadata("a", group=key, rank=2)]
    actor, rollout = build(2, 2, kept)
    assert rollout["reuse"] == [True, True] and actor["spec"][0].port == 40000
    # a new rollout worker (no group): everyone meets in a new one
    kept[3] = _metadata("a")
    assert build(2, 2, kept)[1]["reuse"] == [False, False]
    with pytest.raises(ValueError, match="trainer rank 0, and only it"):
        build(2, 2, [_metadata("a"), _metadata("a", master=True), _metadata("a"), _metadata("a")])


def test_senders_is_a_setting_refused_by_name_when_invalid():
    from hal.integrations.verl.checkpoint import HalCheckpointEngine

    assert HalCheckpointEngine(bucket_size=1 << 20).senders == "gather"  # the default, in hal.sync's words
    assert HalCheckpointEngine(bucket_size=1 << 20, senders="master").senders == "gather"  # its former name
    assert HalCheckpointEngine(bucket_size=1 << 20, senders="all").senders == "all"
    for bad in ("every", "ALL", "one", True, None):
        with pytest.raises(ValueError, match=r"senders must be one of gather, all, got "):
            HalCheckpointEngine(bucket_size=1 << 20, senders=bad)
    with pytest.raises(ValueError, match="valid: the SyncConfig fields .*, and canary, is_master, senders, transport"):
        HalCheckpointEngine(bucket_size=1 << 20, sender="all")  # a near miss is an unknown setting


def _all(trainers: int, rollouts: int, nodes: str = "a" * 8, groups=None, ranks=None) -> list[dict]:
    """prepare()'s metadata of every worker with senders "all"; trainer rank r listens on port 31000 + 10 r."""
    metadata = []
    for index in range(trainers + rollouts):
        group = groups[index] if groups else None
        rank = ranks[index] if ranks else None
        metadata.append(_metadata(nodes[index], master=index == 0, group=group, rank=rank, senders="all", port=31000 + 10 * index))
    return metadata


def test_topology_every_trainer_rank_its_own_group_with_every_rollout_worker():
    from hal.integrations.verl.checkpoint import HalCheckpointEngine

    build = HalCheckpointEngine.build_topology
    actor, rollout = build(2, 3, _all(2, 3))
    assert actor["rank"] == [0, 0] and rollout["rank"] == [1, 2, 3]  # each trainer rank the sender of its group
    assert "spec" not in actor and "spec" not in rollout
    (own0,), (own1,) = actor["specs"]
    assert [(s.address, s.port, s.world_size) for s in (own0, own1)] == [("127.0.0.1", 31001, 4), ("127.0.0.1", 31011, 4)]
    assert rollout["specs"] == [[own0, own1]] * 3  # every rollout worker joins both, in trainer-rank order
    assert actor["transports"] == [["ipc"], ["ipc"]] and rollout["transports"] == [["ipc", "ipc"]] * 3
    assert actor["reuse"] == [False, False] and rollout["reuse"] == [False] * 3
    # trainer rank 1 on another node: its group meets at its address, over the network
    actor, rollout = build(2, 2, _all(2, 2, nodes="abaa"))
    assert actor["specs"][0][0].address == "127.0.0.1" and actor["transports"][0] == ["ipc"]
    assert (actor["specs"][1][0].address, actor["specs"][1][0].port) == ("10.0.0.10", 31010)
    assert actor["transports"][1] == ["hierarchical"] and rollout["transports"][0] == ["ipc", "hierarchical"]
    # every member reports the groups under the same ranks: kept
    k0, k1 = ("127.0.0.1", 40000, 3), ("127.0.0.1", 40010, 3)
    kept = _all(2, 2, groups=[(k0,), (k1,), (k0, k1), (k0, k1)], ranks=[0, 0, 1, 2])
    actor, rollout = build(2, 2, kept)
    assert actor["reuse"] == [True, True] and rollout["reuse"] == [True, True]
    assert [s[0].port for s in actor["specs"]] == [40000, 40010] and rollout["specs"][0][1].port == 40010
    for changed in (
        _all(2, 2, groups=[(k0,), None, (k0, k1), (k0, k1)], ranks=[0, None, 1, 2]),  # trainer rank 1 dropped its group
        _all(2, 2, groups=[(k0,), (k1,), (k0, k1), (k1, k0)], ranks=[0, 0, 1, 2]),  # not in trainer-rank order
        _all(2, 2, groups=[(k0,), (k1,), (k0, k1), (k0, k1)], ranks=[0, 0, 2, 1]),  # rollout ranks swapped
    ):
        assert build(2, 2, changed)[1]["reuse"] == [False, False]


def test_topology_refuses_workers_that_disagree_on_senders_or_a_refused_engine():
    from hal.integrations.verl.checkpoint import HalCheckpointEngine

    build = HalCheckpointEngine.build_topology
    mixed = _all(2, 2)
    mixed[3] = _metadata("a", senders="master")  # its former name: the word "gather"
    with pytest.raises(ValueError, match="senders differs between workers: trainer rank 0 says 'all', rollout worker 1 says 'gather'"):
        build(2, 2, mixed)
    unset = [_metadata("a", master=True), _metadata("a"), _metadata("a", senders="all"), _metadata("a")]
    with pytest.raises(ValueError, match="rollout worker 0 says 'all'"):
        build(2, 2, unset)  # a worker without the key says "gather" (an engine of before the setting)
    refused = _all(2, 2)
    refused[1]["refused"] = "a LoRA (peft) model"
    with pytest.raises(ValueError, match="senders 'all' is refused on trainer rank 1: a LoRA"):
        build(2, 2, refused)


def test_prepare_reports_senders_and_refuses_an_engine_whose_shards_differ_from_the_generator():
    """`prepare()` finds the training engine of the worker that holds it (verl passes it no
    reference) and says why its shards could not stand for verl's generator."""
    import torch.nn as nn

    from hal.integrations.verl.checkpoint import HalCheckpointEngine

    class Engine:  # what verl's FSDP engine offers: module, engine_config.strategy, get_per_tensor_param
        def __init__(self, module, strategy="fsdp"):
            self.module = module
            self.engine_config = type("Config", (), {"strategy": strategy})()

        def get_per_tensor_param(self):
            raise AssertionError("never gathered")

    class Worker:  # verl's TrainingWorker: `engine` and `checkpoint_engine`
        def __init__(self, engine):
            self.engine = engine
            self.checkpoint_engine = HalCheckpointEngine(bucket_size=1 << 20, senders="all")

        def execute_checkpoint_engine(self, method):
            return getattr(self.checkpoint_engine, method)()

    reports = Worker(Engine(nn.Linear(4, 4))).execute_checkpoint_engine("prepare")
    assert reports["senders"] == "all" and "port" in reports  # every worker offers a rendezvous
    assert "not FSDP-wrapped" in reports["refused"]
    assert "is not verl's FSDP engine" in Worker(Engine(nn.Linear(4, 4), strategy="veomni")).execute_checkpoint_engine("prepare")["refused"]
    # verl's Megatron engine is read by hal.integrations.megatron.verl_engine: one without its list of chunks is refused there
    megatron = Worker(Engine(nn.Linear(4, 4), strategy="megatron")).execute_checkpoint_engine("prepare")["refused"]
    assert "the Megatron engine Engine has no list of model chunks" in megatron
    alone = HalCheckpointEngine(bucket_size=1 << 20, senders="all").prepare()  # no worker holds it: nothing to check
    from hal.integrations.verl.internals import is_training_engine

    engine = Engine(nn.Linear(4, 4))
    assert is_training_engine(engine)  # what verl passes to send_weights of shard-operating backends
    assert not is_training_engine(iter([("w", None)])) and not is_training_engine(x for x in ())  # its generators
    assert alone["refused"] is None
    assert "refused" not in HalCheckpointEngine(bucket_size=1 << 20).prepare()


# ---- the canary's settings (engine_kwargs["hal"]["canary"]) -------------------------------------
def test_canary_settings_map_onto_canary_config_by_field_name():
    from hal.integrations.verl.checkpoint import HalCheckpointEngine
    from hal.integrations.verl.settings import canary_settings
    from hal.canary import DEFAULT_EVERY, CanaryConfig, Probe

    default = HalCheckpointEngine(bucket_size=1 << 20)  # no `canary` in engine_kwargs["hal"]: on, by default
    assert default.canary.by_default and default.canary.config == CanaryConfig(mode="log", every=DEFAULT_EVERY)
    for off in (None, False, {"mode": "off"}):  # YAML's `canary: null`, `canary: false`, `canary: {mode: off}`
        assert HalCheckpointEngine(bucket_size=1 << 20, canary=off).canary is None
    given = HalCheckpointEngine(bucket_size=1 << 20, canary={"every": 10}).canary  # a mapping is a canary: "log" unless it says
    assert given.config == CanaryConfig(mode="log", every=10) and not given.by_default
    engine = HalCheckpointEngine(
        bucket_size=1 << 20,
        canary={"mode": "enforce", "every": 5, "seed": 7, "tolerance": 0.05, "sequences": 2, "length": 8,
                "engine_logprobs": "mypkg.canary:logprobs", "timeout_s": 30},
    )
    assert engine.canary is not None and engine.canary.config == CanaryConfig(
        mode="enforce", every=5, seed=7, tolerance=0.05, sequences=2, length=8
    )
    assert (engine.canary_settings.engine_logprobs, engine.canary_settings.timeout_s) == ("mypkg.canary:logprobs", 30.0)
    assert canary_settings({"mode": "log", "probe": [[1, 2, 3], [4, 5]]}).config.probe == Probe.of([[1, 2, 3], [4, 5]])
    assert canary_settings(None).config == CanaryConfig(mode="off") == canary_settings(False).config


@pytest.mark.parametrize(
    ("canary", "message"),
    [
        ({"mode": "loud"}, "engine_kwargs['hal'].canary.mode: CanaryConfig.mode must be one of ['off', 'log', 'enforce'], got 'loud'"),
        ({"mode": "log", "every": 0}, "engine_kwargs['hal'].canary.every: CanaryConfig.every must be an int >= 1, got 0"),
        ({"mode": "log", "tolerance": -1.0}, "engine_kwargs['hal'].canary.tolerance: CanaryConfig.tolerance must be None or a positive"),
        ({"mode": "log", "length": 1}, "engine_kwargs['hal'].canary.length: CanaryConfig.length must be an int >= 2"),
        ({"mode": "log", "calibrate": "yes"}, "engine_kwargs['hal'].canary.calibrate: CanaryConfig.calibrate must be a bool"),
        ({"mode": "log", "probe": [[1]]}, "engine_kwargs['hal'].canary.probe must be a list of token-id lists: Probe.sequences[0]"),
        ({"mode": "log", "evry": 3}, "engine_kwargs['hal'].canary: unknown field(s) 'evry'; valid: mode, every, probe"),
        ({"mode": "log", "engine_logprobs": "no_colon"}, "canary.engine_logprobs must be 'package.module:function', got 'no_colon'"),
        ({"mode": "log", "timeout_s": 0}, "canary.timeout_s must be None or a positive number of seconds, got 0"),
        ("enforce", "engine_kwargs['hal'].canary must be a mapping of mode, every"),
    ],
)
def test_a_bad_canary_setting_is_refused_by_name(canary, message):
    from hal.integrations.verl.checkpoint import HalCheckpointEngine

    with pytest.raises(ValueError) as error:
        HalCheckpointEngine(bucket_size=1 << 20, canary=canary)
    assert message in str(error.value)


def test_a_rollout_worker_answers_through_its_hook_or_its_adapter_or_says_why_not():
    from hal.integrations.verl.canary import engine_answer
    from hal.integrations.verl.settings import canary_settings

    class Adapter:
        def prompt_logprobs(self, sequences):
            return [[-1.0] * (len(s) - 1) for s in sequences]

    class AsyncAdapter:
        async def prompt_logprobs(self, sequences):
            return [[-2.0] * (len(s) - 1) for s in sequences]

    settings = canary_settings({"mode": "log"})
    assert engine_answer(settings, Adapter())([[1, 2, 3]]) == [[-1.0, -1.0]]
    assert engine_answer(settings, AsyncAdapter())([[1, 2]]) == [[-2.0]]  # verl's adapters are async
    with pytest.raises(ValueError, match="has no prompt_logprobs.*canary.engine_logprobs names no hook"):
        engine_answer(settings, object())([[1, 2]])
    hooked = canary_settings({"mode": "log", "engine_logprobs": "tests.verl.test_plugin:_hook"})
    assert engine_answer(hooked, Adapter())([[5, 6, 7]]) == [[0.5, 0.5]]
    missing = canary_settings({"mode": "log", "engine_logprobs": "tests.verl.test_plugin:no_such_hook"})
    with pytest.raises(ValueError, match="canary.engine_logprobs 'tests.verl.test_plugin:no_such_hook': AttributeError"):
        engine_answer(missing, Adapter())([[1, 2]])  # raised when asked: the trainer's report names it


def _hook(adapter, sequences):
    return [[0.5] * (len(s) - 1) for s in sequences]


def test_the_canary_refuses_an_engine_it_cannot_run_the_probe_through_and_loads_an_offloaded_one():
    import contextlib

    from hal.integrations.verl import internals

    class Engine:
        module = torch.nn.Linear(2, 2)
        ulysses_sequence_parallel_size = 1
        is_param_offload_enabled = False
        loaded = 0

        @contextlib.contextmanager
        def eval_mode(self):
            Engine.loaded += 1
            yield

    engine = Engine()
    assert internals.canary_refusal(engine) is None
    with internals.module_on_device(engine):
        pass
    assert Engine.loaded == 0  # no offload: nothing to load
    engine.is_param_offload_enabled = True
    with internals.module_on_device(engine):
        pass
    assert Engine.loaded == 1  # verl's own eval_mode() loads the offloaded parameters
    engine.ulysses_sequence_parallel_size = 2
    assert "Ulysses sequence parallelism is on (ulysses_sequence_parallel_size=2)" in internals.canary_refusal(engine)
    engine.module = [torch.nn.Linear(2, 2)]  # Megatron's: a list of model chunks
    assert "has no torch module to run the probe through" in internals.canary_refusal(engine)
