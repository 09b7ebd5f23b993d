"""The recording of a worker's needs (hal.integrations.vllm.recording) against fake loaders:
what it records (boxes, strided destinations, fills), and what it refuses by name. No
engine, no vLLM (test_recording.py drives vLLM's own loaders)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from hal.integrations.vllm.recording import Recorder
from hal.sync.plan.needs import Need, UnexpressibleLoad, WorkerNeeds, decode_needs
from hal.sync.spec import TensorSpec

# ---- fake loaders, no engine: what is recorded, what is refused ------------------------------
W = TensorSpec("model.w", (4, 6), torch.float32)


def record_fake(loader: Callable[..., Any], shape: tuple[int, ...] = (4, 6), specs: tuple[TensorSpec, ...] = (W,)) -> WorkerNeeds:
    """`loader(param, loaded_weight)` of one meta parameter of `shape` fed each spec's stand-in."""
    param = torch.nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
    recorder = Recorder(specs, "cpu")
    param.weight_loader = recorder.stamp("layer", "weight", loader)
    recorder.watch([("layer", "weight", param, 0)])
    recorder.run(lambda weights: [param.weight_loader(param, w) for _, w in weights])
    return recorder.needs()


def column_parallel(param: torch.Tensor, w: torch.Tensor, rank: int = 1) -> None:
    param.data.copy_(w.narrow(1, rank * 3, 3))


def vocab_padded(param: torch.Tensor, w: torch.Tensor) -> None:
    param[: w.shape[0]].data.copy_(w)
    param[w.shape[0]:].data.fill_(0)


def test_views_and_fills_are_recorded_as_boxes_and_regions():
    (need,) = record_fake(column_parallel, shape=(4, 3)).needs
    assert need == Need(0, (0, 3), (4, 3), 0, 0, (3, 1))
    padded = record_fake(vocab_padded, shape=(6, 6))
    assert [(n.offsets, n.sizes) for n in padded.needs] == [((0, 0), (4, 6))]
    assert [(f.offset, f.shape, f.value) for f in padded.fills] == [(24, (2, 6), 0.0)]

    def by_index(param, w):  # param[i] = w[j], param[k] = 0
        param.data[1:3] = w[0:2]
        param.data[0] = 0
        param.data[3] = 0

    record = record_fake(by_index)
    assert [(n.offsets, n.sizes, n.dst_offset) for n in record.needs] == [((0, 0), (2, 6), 6)]
    assert sorted(f.offset for f in record.fills) == [0, 18]


REFUSED = {
    "a cast": (lambda p, w: p.data.copy_(w.to(torch.bfloat16)), "applies to(torch.bfloat16) to checkpoint tensor 'model.w', a cast"),
    "arithmetic": (lambda p, w: p.data.copy_(w * 2), "applies mul to checkpoint tensor 'model.w', which makes a new tensor"),
    "a broadcasting copy": (lambda p, w: p.data.copy_(w[0]), "applies copy_ to checkpoint tensor 'model.w', [6] into a region of [4, 6] (a broadcast)"),
    "a packed column block": (lambda p, w: p.data[:, :3].copy_(w[:, 3:].contiguous()), "applies contiguous to checkpoint tensor 'model.w'"),
    "a temporary": (lambda p, w: torch.empty(4, 6, device="meta").copy_(w), "copy_ to checkpoint tensor 'model.w' into a tensor that is none"),
    "a computed copy into the parameter": (lambda p, w: p.data.copy_(torch.ones(4, 6)), "applies copy_ to parameter 'layer.weight' with a computed value"),
    "arithmetic on the parameter": (lambda p, w: (p.data.copy_(w), p.data.mul_(2)), "applies mul_ to parameter 'layer.weight'"),
    "reading a value (GGUF's item())": (lambda p, w: p.data.fill_(w.item()), "applies item to checkpoint tensor 'model.w', which fails on a stand-in"),
    "a write into the checkpoint tensor": (lambda p, w: (w.mul_(2), p.data.copy_(w)), "applies mul_ to checkpoint tensor 'model.w' (a write into it)"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_the_record_cannot_express_is_refused_naming_parameter_loader_op_and_tensor(case):
    loader, words = REFUSED[case]
    with pytest.raises(UnexpressibleLoad) as caught:
        record_fake(loader)
    message = str(caught.value)
    assert message.startswith("parameter 'layer.weight': loader <lambda> applies "), message
    assert words in message and message.endswith("; a shard receive cannot express it"), message


def test_a_hole_is_refused_naming_the_parameter_and_where():
    with pytest.raises(UnexpressibleLoad, match=r"^parameter 'layer.weight': 12 of 24 elements are written by no loader \(rows 2..4"):
        record_fake(lambda p, w: p.data[:2].copy_(w[:2]))


def test_a_region_that_is_no_box_is_refused():
    with pytest.raises(UnexpressibleLoad, match=r"copies from checkpoint tensor 'model.w' the region .* which is not one box"):
        record_fake(lambda p, w: p.data[:2].copy_(w[::2]))


def test_a_refusal_a_loader_swallows_is_raised_after_the_load():
    def swallowing(param, w):
        try:
            param.data.copy_(w * 2)
        except Exception:  # noqa: BLE001 - what a careless loader does
            param.data.copy_(w)

    with pytest.raises(UnexpressibleLoad, match="applies mul to"):
        record_fake(swallowing)
