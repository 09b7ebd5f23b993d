"""hal's checkpoint engine with `senders: all` and verl's Megatron training engine: what
`prepare` reports of a stand-in with the attributes hal reads from verl 0.9.1's
`MegatronEngine` (hal.integrations.megatron.verl_engine names the lines). verl's real
Megatron engine cannot be built here (Megatron-Bridge, Python >= 3.12, Transformer Engine,
apex, CUDA torch 2.11); the sync of its shards runs in the megatron lane
(tests/integrations/megatron/test_megatron.py) against the same stand-in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.cpu]

pytest.importorskip("verl", reason="needs verl 0.9.1: make setup-verl, then run the verl lane (ci/verl.sh)")


class MegatronEngine:
    """verl's MegatronEngine as hal reads it: `engine_config.strategy`, `module` (the list
    of chunks), `peft_cls`, `_qat_enabled`, `_is_offload_param`, `model_config.hf_config`."""

    def __init__(self, **attributes):
        self.engine_config = SimpleNamespace(strategy="megatron")
        self.module = [SimpleNamespace(decoder=None, config=None)]
        self.peft_cls = None
        self._qat_enabled = False
        self._is_offload_param = False
        self.model_config = SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen2", vocab_size=64))
        vars(self).update(attributes)

    def get_per_tensor_param(self):
        raise AssertionError("never gathered")


def prepared(engine):
    from hal.integrations.verl.checkpoint import HalCheckpointEngine

    class Worker:  # verl's TrainingWorker: `engine` and `checkpoint_engine`
        def __init__(self):
            self.engine = engine
            self.checkpoint_engine = HalCheckpointEngine(bucket_size=1 << 20, senders="all")

        def execute_checkpoint_engine(self, method):
            return getattr(self.checkpoint_engine, method)()

    return Worker().execute_checkpoint_engine("prepare")


@pytest.mark.parametrize(
    "attributes, refused",
    [
        ({}, None),
        ({"peft_cls": object}, "a LoRA (Megatron peft) model"),
        ({"_qat_enabled": True}, "QAT is on"),
        ({"_is_offload_param": True}, "param_offload is on"),
        ({"model_config": SimpleNamespace(hf_config=SimpleNamespace(model_type="deepseek_v3"))}, "model type 'deepseek_v3'"),
    ],
)
def test_prepare_accepts_verls_megatron_engine_and_names_what_it_refuses(attributes, refused):
    report = prepared(MegatronEngine(**attributes))
    assert report["senders"] == "all"
    if refused is None:
        assert not report.get("refused"), report
    else:
        assert refused in report["refused"], report
