"""docs/results/: every record parses and stands alone, and `hal bench --json` writes such records.

A record is what `hal bench --json PATH` writes, "run" object first (hal.tools.bench.record);
docs/benchmarks.md ("Records") says how a run goes in and how the transcribed ones were made.
docs/results/runs/ holds the lanes' run log (docs/ci.md, "The run log"): one record per
session of runs, "run" first as well (`check_run_record` below).
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from hal import cli
from hal.tools.bench import record

pytestmark = pytest.mark.cpu

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
RUNS = RESULTS / "runs"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_record_in_docs_results_parses_and_stands_alone():
    records = record.load_records(RESULTS)
    assert records, "docs/results/ holds no record"
    for path, rec in records:
        assert record.check_record(rec) == [], f"{path.name}: {record.check_record(rec)}"
    files = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    assert files == sorted(p.name for p, _ in records), "docs/results/ holds files that are not records (*.json)"
    assert [p.name for p in RESULTS.iterdir() if not p.is_file()] == ["runs"], "docs/results/ holds folders other than runs/"


def test_a_record_is_named_by_its_date_and_benchmark():
    for path, rec in record.load_records(RESULTS):
        run = rec["run"]
        assert path.name.startswith(f"{run['date'][:10]}-{run['benchmark']}-"), path.name


def test_a_transcribed_record_says_where_its_numbers_were_printed():
    transcribed = [(p, r) for p, r in record.load_records(RESULTS) if r["run"]["source"] == "transcribed"]
    for path, rec in transcribed:
        origin = rec["run"]["transcribed_from"]
        assert origin["file"] in ("docs/benchmarks.md", "docs/ci.md"), path.name
        assert origin["section"].strip(), path.name


def test_the_pages_link_only_to_records_that_exist():
    links = 0
    for page in PAGES:
        for name in re.findall(r"results/((?:runs/)?[\w.\-]+\.json)", page.read_text()):
            links += 1
            assert (RESULTS / name).is_file(), f"{page.name} links to results/{name}, which does not exist"
    assert links, "no page links to a record"


# ---- the run log (docs/results/runs/) ----------------------------------------------------------
LANES = ("cpu", "verl", "megatron", "vllm-versions", "cuda", "npu", "host-sources", "lent-machine", "make test")


def check_run_record(rec) -> list[str]:
    """What a record of the run log lacks to stand alone; [] when nothing. A session of lane
    runs: "run" (schema, kind "lanes", the lanes, the date, the machine, and where it was
    transcribed from or the commit that ran), "results" (one object per run or measurement) and "notes" (text)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("run"), dict):
        return ["no 'run' object"]
    run, problems = rec["run"], []
    if run.get("schema") != 1:
        problems.append(f"run.schema is {run.get('schema')!r}, not 1")
    if run.get("kind") != "lanes":
        problems.append(f"run.kind is {run.get('kind')!r}, not 'lanes'")
    lanes = run.get("lanes")
    if not isinstance(lanes, list) or not lanes or any(lane not in LANES for lane in lanes):
        problems.append(f"run.lanes {lanes!r} is not a list of {', '.join(LANES)}")
    if not record._is_date(run.get("date")):
        problems.append(f"run.date {run.get('date')!r} is not an ISO 8601 date")
    machine = run.get("machine")
    if not isinstance(machine, dict) or not isinstance(machine.get("description"), str) or not machine["description"].strip():
        problems.append("run.machine has no description")
    origin = run.get("transcribed_from")
    if run.get("source") == "transcribed":  # the log docs/ci.md kept until 2026-11-28
        if not (isinstance(origin, dict) and origin.get("file") == "docs/ci.md"
                and re.fullmatch(r"[0-9a-f]{40}", str(origin.get("commit"))) and origin.get("section")):
            problems.append("run.transcribed_from does not name docs/ci.md, a full commit and a section")
    elif run.get("source") == "run":  # written from a run's own output: the commit that ran
        if not re.fullmatch(r"[0-9a-f]{40}", str(run.get("git_commit"))):
            problems.append("run.git_commit is not the full commit that ran")
    else:
        problems.append("run.source is neither 'transcribed' (with run.transcribed_from) nor 'run' (with run.git_commit)")
    results = rec.get("results")
    if not isinstance(results, list) or not results or not all(isinstance(r, dict) and r for r in results):
        problems.append("no 'results' list of objects")
    notes = rec.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        problems.append("'notes' is not a list of strings")
    return problems


def test_every_record_of_the_run_log_parses_and_stands_alone():
    records = record.load_records(RUNS)
    assert records, "docs/results/runs/ holds no record"
    assert sorted(p.name for p in RUNS.iterdir()) == sorted(p.name for p, _ in records), "docs/results/runs/ holds files that are not records"
    for path, rec in records:
        assert check_run_record(rec) == [], f"{path.name}: {check_run_record(rec)}"
        assert path.name.startswith(rec["run"]["date"][:10] + "-"), f"{path.name} is not named by its date"


def _good_run() -> dict:
    return {"run": {"schema": 1, "kind": "lanes", "lanes": ["cuda"], "date": "2026-11-23T03:44Z", "machine": {"description": "one H100"},
                    "source": "transcribed", "transcribed_from": {"file": "docs/ci.md", "commit": "f" * 40, "section": "On an H100"}},
            "results": [{"what ran": "ci/cuda.sh", "result": "64 passed"}], "notes": ["installed as above"]}


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda r: r.pop("run"), "no 'run' object"),
        (lambda r: r["run"].update(lanes=["gpu"]), "run.lanes"),
        (lambda r: r["run"].update(date="the 23rd"), "not an ISO 8601 date"),
        (lambda r: r["run"].pop("machine"), "no description"),
        (lambda r: r["run"]["transcribed_from"].update(commit="f710d95"), "a full commit"),
        (lambda r: r["run"].update(source="by hand"), "neither 'transcribed'"),
        (lambda r: r["run"].update(source="run", git_commit="1654bee"), "the full commit that ran"),
        (lambda r: r.update(results=[]), "no 'results' list"),
        (lambda r: r.update(notes="text"), "'notes'"),
    ],
)
def test_check_run_record_names_what_a_record_lacks(change, problem):
    assert check_run_record(_good_run()) == []
    rec = _good_run()
    change(rec)
    assert any(problem in p for p in check_run_record(rec)), check_run_record(rec)


def _good() -> dict:
    return {
        "run": {"schema": 1, "benchmark": "transfer", "date": "2026-11-27T10:00:00Z", "command": "hal bench --preset tiny",
                "git_commit": "8b9ea990773dee95141f4160d96809cf3ca36aad", "source": "hal bench --json",
                "machine": {"description": "2 CPUs", "cpus": 2, "os": "Linux", "python": "3.11.7", "torch": "2.13.0+cpu", "backend": "cpu"}},
        "results": [{"method": "floor", "seconds": 0.3}],
    }


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda r: r.pop("run"), "no 'run' object"),
        (lambda r: r["run"].pop("date"), "run.date missing"),
        (lambda r: r["run"].update(date="yesterday"), "is not an ISO 8601 date"),
        (lambda r: r["run"].update(date="2026-11-27"), "has no time of day"),
        (lambda r: r["run"].update(benchmark="speed"), "run.benchmark 'speed'"),
        (lambda r: r["run"].update(command="python bench.py"), "is not a `hal bench` command line"),
        (lambda r: r["run"].update(git_commit="main"), "neither null nor a commit"),
        (lambda r: r["run"]["machine"].pop("description"), "run.machine has no description"),
        (lambda r: r["run"]["machine"].pop("torch"), "run.machine.torch missing"),
        (lambda r: r["run"].update(source="transcribed"), "has no run.transcribed_from"),
        (lambda r: r.update(results=[]), "no 'results' list"),
        (lambda r: r["results"][0].pop("method"), "results[0] has no 'method'"),
    ],
)
def test_check_record_names_what_a_record_lacks(change, problem):
    assert record.check_record(_good()) == []
    rec = _good()
    change(rec)
    assert any(problem in p for p in record.check_record(rec)), record.check_record(rec)


def test_a_transcribed_record_may_have_a_date_without_a_time_but_names_its_origin():
    rec = _good()
    rec["run"].update(source="transcribed", date="2026-11-23", machine={"description": "one NVIDIA H100"},
                      transcribed_from={"file": "docs/benchmarks.md", "commit": "8b9ea99", "section": "Weights in device memory"})
    assert record.check_record(rec) == ["run.transcribed_from.commit is not a full commit hash"]
    rec["run"]["transcribed_from"]["commit"] = "8b9ea990773dee95141f4160d96809cf3ca36aad"
    assert record.check_record(rec) == []


@pytest.mark.multiprocess
def test_a_tiny_run_dropped_into_a_results_folder_as_is_is_a_record(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    argv = ["bench", "--preset", "tiny", "--methods", "floor,hal_bucketed", "--repeats", "1", "--warmup", "0",
            "--timeout", "240", "--json", str(folder / "run.json")]
    assert cli.main(argv) == 0
    [(path, rec)] = record.load_records(folder)
    assert record.check_record(rec) == []
    run = rec["run"]
    assert run["benchmark"] == "transfer" and run["command"].endswith("hal " + " ".join(argv))
    assert run["machine"]["load_average_start"] is not None and run["machine"]["memory_total_bytes"] > 0
    assert run["git_commit"] is None or len(run["git_commit"]) == 40  # this checkout's commit, when hal is one


def test_the_vllm_engine_report_is_stamped_too(tmp_path, monkeypatch):
    """`--engine vllm` goes through the same stamp; the engine itself is replaced (it takes minutes)."""
    from hal.tools.bench import vllm_engine

    monkeypatch.setattr(vllm_engine, "run", lambda args: {"engine": "vllm", "results": [{"method": "hal", "seconds": 0.5}]})
    out = tmp_path / "vllm.json"
    argv = ["bench", "--engine", "vllm", "--repeats", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    rec = json.loads(out.read_text())
    assert record.check_record(rec) == [] and rec["run"]["benchmark"] == "vllm"
    assert list(rec) == ["run", "engine", "results"]


def test_without_json_nothing_is_asked_of_git_or_the_machine(monkeypatch, capsys):
    """The run object is made only for --json: a plain run prints its table as before."""
    from hal.tools.bench import vllm_engine

    monkeypatch.setattr(record, "describe_run", lambda *a, **k: pytest.fail("describe_run without --json"))
    monkeypatch.setattr(vllm_engine, "run", lambda args: {"engine": "vllm", "results": [{"method": "hal", "seconds": 0.5}]})
    assert cli.main(["bench", "--engine", "vllm", "--repeats", "1"]) == 0
