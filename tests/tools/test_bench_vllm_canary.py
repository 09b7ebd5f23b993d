"""`hal bench --engine vllm`'s model presets and canary timing, without an engine (the engine
run itself is in tests/test_docs_commands.py, in its cheap form)."""

from __future__ import annotations

import argparse

import pytest
import torch

from hal.canary import Canary, CanaryConfig, Probe
from hal.tools.bench import vllm_engine
from hal.tools.bench import vllm_engine_report

pytestmark = [pytest.mark.cpu]


def test_probe_shapes_parse_and_refuse_by_value():
    assert vllm_engine._probe_shapes("4x32") == ((4, 32),)
    assert vllm_engine._probe_shapes("4x32, 2X16") == ((4, 32), (2, 16))
    for bad in ("4", "4x1", "0x8", "axb"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad.strip())):
            vllm_engine._probe_shapes(bad)


def test_the_05b_preset_has_qwen25_05bs_shape():
    spec = vllm_engine.vllm_spec("qwen2.5-0.5b", tied=False)
    assert (spec.architecture, spec.tie_word_embeddings, spec.vocab_size, spec.num_hidden_layers) == ("qwen2", True, 151936, 24)
    assert spec.nbytes_fp32() // 4 == 494_032_768  # Qwen2.5-0.5B's parameters (hal.tools.bench.presets: 988,065,536 bytes in bf16)
    assert vllm_engine.vllm_spec("llama-bench-fp32", tied=True).tie_word_embeddings
    tiny = vllm_engine.vllm_spec("tiny", tied=False)
    assert tiny.nbytes_fp32() < 2**21 and not tiny.tie_word_embeddings
    assert vllm_engine.vllm_spec("tiny", tied=True).tie_word_embeddings
    with pytest.raises(ValueError, match="--vllm-preset"):
        vllm_engine.vllm_spec("gpt2", tied=False)


def test_canary_summary_gives_medians_and_its_share_of_a_sync():
    canary = Canary(CanaryConfig(mode="log", probe=Probe.of([[1, 2, 3]])))
    runs = []
    for seconds in (0.3, 0.1, 0.2):
        report = canary.judge(1, canary.probe, [[-1.0, -2.0]], {"llm": [[-1.0, -2.0001]]}, dtypes=(torch.float32,),
                              seconds={"llm": seconds / 2}, reference_s=seconds)
        report.seconds = seconds
        runs.append(report)
    summary = vllm_engine_report.canary_summary(runs, (1, 3), sync_seconds=2.0, first=runs[0])
    assert summary["seconds"] == pytest.approx(0.2) and summary["all_seconds"] == [0.3, 0.1, 0.2]
    assert summary["reference_seconds"] == pytest.approx(0.2) and summary["engine_seconds"] == pytest.approx(0.1)
    assert summary["over_sync"] == pytest.approx(0.1) and summary["every_10_over_sync"] == pytest.approx(0.01)
    assert summary["every_100_over_sync"] == pytest.approx(0.001) and summary["first_seconds"] == 0.3  # the default's share
    assert summary["probe"] == "1x3" and summary["probe_tokens"] == 2 and not summary["fired"]
    assert summary["max_abs"] == pytest.approx(1e-4, rel=1e-3)
