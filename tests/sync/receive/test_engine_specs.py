"""A rollout worker built from engine-side information alone.

The receiving process reads its specs from the checkpoint header, allocates only the
engine's own weights, never imports transformers or peft, never constructs a module,
and still ends up with the trainer's weights bit for bit.

This module must not import transformers or peft at import time: the receiver process
imports it to find its worker function.
"""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch

from hal.sync import TensorSpec
from hal.sync.receive import allocate, specs_from_safetensors, total_bytes
from hal.sync.sink import copy_into
from hal.sync.receive.engine_specs import specs_from_config, specs_from_module
from tests.multiproc import run_group

pytestmark = pytest.mark.cpu


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )


def _trainer_model(seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_llama_config())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _live_tensor_bytes() -> int:
    """Bytes of every distinct storage held by a live tensor in this process."""
    import gc
    import warnings

    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on deprecated torch objects warns
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                    s = obj.untyped_storage()
                    storages[s.data_ptr()] = s.nbytes()
            except Exception:  # noqa: BLE001 - some objects misbehave under inspection
                continue
    return sum(storages.values())


def rollout_worker(rank: int, world_size: int, ckpt: str, steps: int):
    import sys

    from hal.sync import BroadcastTransport, ModuleSource, Receiver, Sender, SyncConfig

    config = SyncConfig(bucket_bytes=64 * 1024, timeout_s=30.0)
    transport = BroadcastTransport(src=0)

    if rank == 0:  # the trainer
        model = _trainer_model()
        sender = Sender(transport, config)
        sent = []
        for step in range(steps):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            metrics = sender.send(ModuleSource(model), version=step)
            buf = io.BytesIO()
            torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, buf)
            sent.append((metrics.bytes, buf.getvalue()))
        return sent

    # the rollout worker: count every module constructed from here on
    constructed: list[str] = []
    original_init = torch.nn.Module.__init__

    def counting_init(self, *args, **kwargs):
        constructed.append(type(self).__name__)
        original_init(self, *args, **kwargs)

    torch.nn.Module.__init__ = counting_init
    try:
        baseline = _live_tensor_bytes()
        specs = specs_from_safetensors(ckpt)  # the engine's checkpoint header, no tensor data
        weights = allocate(specs, fill=float("nan"))
        receiver = Receiver(transport, specs, timeout_s=30.0)
        received = []
        for _ in range(steps):
            metrics = receiver.receive(copy_into(weights))
            received.append(metrics.bytes)
        slots = transport.buffer(0).nbytes + transport.buffer(1).nbytes  # the two reused bucket slots
        reassembly = receiver.reassembly_bytes  # kept for tensors larger than a bucket
        live = _live_tensor_bytes() - baseline
        buf = io.BytesIO()
        torch.save(weights, buf)
        return dict(
            modules_constructed=constructed,
            heavy_imports=sorted(m for m in ("transformers", "peft", "vllm") if m in sys.modules),
            engine_bytes=sum(t.numel() * t.element_size() for t in weights.values()),
            spec_bytes=total_bytes(specs),
            largest_spec_bytes=max(s.nbytes for s in specs),
            slot_bytes=slots,
            reassembly_bytes=reassembly,
            live_bytes=live,
            received=received,
            version=receiver.version,
            state=buf.getvalue(),
        )
    finally:
        torch.nn.Module.__init__ = original_init


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.torch import save_file

    model = _trainer_model(seed=123)  # the engine starts from some earlier checkpoint
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(path))
    return str(path)


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend_name", ["cpu", "sim"])
def test_rollout_worker_builds_no_trainer_model(checkpoint, backend_name):
    steps = 2
    trainer, rollout = run_group(
        rollout_worker, 2, args=(checkpoint, steps), timeout=180, collective_timeout=60, env={"VERL_DEVICE": backend_name}
    )
    # nothing of the trainer's model in the rollout process
    assert rollout["heavy_imports"] == []
    assert rollout["modules_constructed"] == []
    # parameter memory there is the engine's own weights, exactly what its specs describe
    assert rollout["engine_bytes"] == rollout["spec_bytes"]
    # Beyond the engine weights, the two bucket slots and the reassembly buffers of chunked
    # tensors, at most one tensor may still be alive; a trainer model would add its whole
    # size (= spec_bytes) here.
    assert rollout["reassembly_bytes"] <= 2 * rollout["largest_spec_bytes"]
    overhead = rollout["live_bytes"] - rollout["engine_bytes"] - rollout["slot_bytes"] - rollout["reassembly_bytes"]
    assert overhead <= rollout["largest_spec_bytes"] < rollout["spec_bytes"] // 2, (
        f"{overhead} bytes of tensors beyond the engine weights and the two slots"
    )
    # and the sync delivered the trainer's weights, bit for bit
    assert rollout["version"] == steps - 1
    last_bytes, last_state = trainer[-1]
    assert rollout["received"] == [b for b, _ in trainer] and last_bytes == rollout["spec_bytes"]
    expected = torch.load(io.BytesIO(last_state), weights_only=True)
    got = torch.load(io.BytesIO(rollout["state"]), weights_only=True)
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(_bits(got[name]), _bits(t)), name


# ---- the spec helpers, in this process ------------------------------------------------------


def test_specs_from_safetensors_reads_the_header_only(tmp_path):
    from safetensors.torch import save_file

    tensors = {
        "b.weight": torch.zeros(3, 4, dtype=torch.bfloat16),
        "a.bias": torch.zeros(5, dtype=torch.float32),
        "c.idx": torch.zeros(2, 2, dtype=torch.int64),
    }
    save_file(tensors, str(tmp_path / "m.safetensors"))
    specs = specs_from_safetensors(tmp_path / "m.safetensors")
    assert {s.name: s for s in specs} == {n: TensorSpec.of(n, t) for n, t in tensors.items()}


def test_specs_from_a_sharded_directory(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"y": torch.zeros(3, dtype=torch.float16)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    specs = specs_from_safetensors(tmp_path)
    assert specs == [TensorSpec("x", (2,), torch.float32), TensorSpec("y", (3,), torch.float16)]
    save_file({"x": torch.zeros(2)}, str(tmp_path / "model-00003-of-00002.safetensors"))
    with pytest.raises(ValueError, match="tensor 'x' is in both"):
        specs_from_safetensors(tmp_path)


def test_specs_from_safetensors_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such safetensors"):
        specs_from_safetensors(tmp_path / "missing.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors file"):
        specs_from_safetensors(tmp_path)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"abc")
    with pytest.raises(ValueError, match="bad.safetensors: not a safetensors file"):
        specs_from_safetensors(bad)
    header = json.dumps({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}).encode()
    odd = tmp_path / "odd.safetensors"
    odd.write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    with pytest.raises(ValueError, match="tensor 'w' has dtype 'Q9'"):
        specs_from_safetensors(odd)


def test_specs_from_config_match_the_trainer_and_use_no_memory():
    model = _trainer_model()
    expected = [TensorSpec.of(n, p) for n, p in model.named_parameters()]
    assert specs_from_config(_llama_config()) == expected
    assert {s.dtype for s in specs_from_config(_llama_config(), dtype=torch.bfloat16)} == {torch.bfloat16}


def test_specs_from_module_with_buffers():
    m = torch.nn.BatchNorm1d(4)
    names = [s.name for s in specs_from_module(m)]
    assert names == ["weight", "bias"]
    with_buffers = [s.name for s in specs_from_module(m, buffers=True)]
    assert with_buffers == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]


def test_copy_into_is_a_sink_whose_tensors_are_the_destinations():
    from hal.sync import Sink

    weights = allocate([TensorSpec("w", (2, 2), torch.float32)], fill=0.0)
    sink = copy_into(weights, record=True)
    assert isinstance(sink, Sink) and sink.policy.in_place
    assert sink.destination("w") is weights["w"] and sink.destination("v") is None
    sink.apply([("w", weights["w"])])  # the receiver wrote it; apply records it
    assert sink.received == ["w"]
    with pytest.raises(KeyError, match="parameter 'v': the engine holds no tensor"):
        sink.apply([("v", torch.ones(2, 2))])
    assert copy_into(weights, in_place=False).policy.in_place is False
    # By default nothing is kept per sync: a sink kept for a whole run does not grow.
    quiet = copy_into(weights)
    quiet.apply([("w", weights["w"])] * 3)
    assert quiet.received == [] and quiet.record is False
    with pytest.raises(TypeError, match="record must be a bool, got 'yes'"):
        copy_into(weights, record="yes")
    with pytest.raises(ValueError, match="parameter 'w' is listed twice"):
        allocate([TensorSpec("w", (1,), torch.float32)] * 2)
