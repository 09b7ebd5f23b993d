"""The GitHub Actions workflows parse, and every lane of ci/ runs in one of their jobs
(cpu and verl on hosted Linux runners, cuda and npu on self-hosted runners by label)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="needs PyYAML (the test extra has it)")

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO / ".github" / "workflows"
# Where each lane runs: a hosted runner image, or the labels a self-hosted runner carries.
HOSTED = {"cpu", "verl", "vllm-versions", "megatron"}
SELF_HOSTED_LABELS = {"cuda": "gpu", "npu": "ascend"}


def _lanes() -> list[str]:
    """ci/<lane>.sh, without the helpers the lanes share (names starting with "_")."""
    return sorted(p.stem for p in (REPO / "ci").glob("*.sh") if not p.name.startswith("_"))


def _workflows() -> dict[str, dict]:
    files = sorted([*WORKFLOWS.glob("*.yml"), *WORKFLOWS.glob("*.yaml")])
    assert files, f"no workflow in {WORKFLOWS}"
    return {f.name: yaml.safe_load(f.read_text()) for f in files}


def _jobs() -> dict[str, dict]:
    jobs = {}
    for name, workflow in _workflows().items():
        for job_id, job in workflow["jobs"].items():
            jobs[f"{name}:{job_id}"] = job
    return jobs


def _lanes_run_by(job: dict) -> set[str]:
    text = "\n".join(str(step.get("run", "")) for step in job.get("steps", []))
    return set(re.findall(r"\bci/([a-z0-9_-]+)\.sh\b", text))


def test_every_workflow_parses_with_triggers_and_jobs():
    for name, workflow in _workflows().items():
        assert isinstance(workflow, dict), name
        # YAML 1.1 (PyYAML) reads the key `on` as True
        assert "on" in workflow or True in workflow, f"{name}: no triggers"
        assert workflow.get("jobs"), f"{name}: no jobs"
        for job_id, job in workflow["jobs"].items():
            assert job.get("runs-on"), f"{name}: job {job_id} has no runs-on"
            assert isinstance(job.get("timeout-minutes"), int), f"{name}: job {job_id} has no timeout-minutes"
            for step in job.get("steps", []):
                assert ("uses" in step) != ("run" in step), f"{name}: job {job_id}: a step needs one of uses/run: {step}"
                if "uses" in step:
                    assert re.fullmatch(r"[\w.-]+/[\w.-]+@v\d+", step["uses"]), f"{name}: job {job_id}: unpinned action {step['uses']}"


def test_every_lane_runs_in_exactly_one_job_on_its_runner():
    lanes = _lanes()
    assert {"cpu", "verl", "cuda", "npu"} <= set(lanes), lanes
    jobs = _jobs()
    for lane in lanes:
        running = [job_id for job_id, job in jobs.items() if lane in _lanes_run_by(job)]
        assert len(running) == 1, f"ci/{lane}.sh is run by {running or 'no job'}; exactly one job must run it"
        runs_on = jobs[running[0]]["runs-on"]
        labels = [runs_on] if isinstance(runs_on, str) else list(runs_on)
        if lane in HOSTED:
            assert len(labels) == 1 and labels[0].startswith("ubuntu-"), f"ci/{lane}.sh must run on a hosted Linux runner, not {labels}"
        elif lane in SELF_HOSTED_LABELS:
            assert "self-hosted" in labels and SELF_HOSTED_LABELS[lane] in labels, (
                f"ci/{lane}.sh must run on a self-hosted runner labelled {SELF_HOSTED_LABELS[lane]!r}, not {labels}"
            )
        else:
            pytest.fail(f"ci/{lane}.sh: a new lane; say in this test where it runs (HOSTED or SELF_HOSTED_LABELS)")
