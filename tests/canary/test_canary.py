"""The canary's engine-free core (hal.canary): probe, tolerance, comparison, policy, record."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hal.canary.policy import CALIBRATION_FLOORS, CALIBRATION_MARGIN, least_precise, tolerance_for
from hal.canary import (
    DEFAULT,
    DEFAULT_EVERY,
    TOLERANCES,
    Canary,
    CanaryConfig,
    CanaryError,
    CanaryReport,
    Probe,
    as_canary,
    default_config,
    module_logprobs,
    vocab_size_of,
)
from hal.canary.report import compare

pytestmark = [pytest.mark.cpu]


def test_a_drawn_probe_is_the_same_for_the_same_seed_and_within_the_vocabulary():
    a = Probe.draw(50, sequences=3, length=7, seed=4)
    assert a == Probe.draw(50, sequences=3, length=7, seed=4)
    assert a != Probe.draw(50, sequences=3, length=7, seed=5)
    assert [len(s) for s in a.sequences] == [7, 7, 7] and a.scored == 18
    assert 0 <= min(min(s) for s in a.sequences) and a.max_token < 50


@pytest.mark.parametrize(
    ("sequences", "named"),
    [([], "at least one sequence"), ([[1]], r"sequences\[0\]: a sequence needs at least 2 tokens"), ([[1, -2]], r"sequences\[0\]: token ids")],
)
def test_a_bad_probe_is_refused_naming_the_sequence(sequences, named):
    with pytest.raises(ValueError, match=named):
        Probe.of(sequences)


@pytest.mark.parametrize(
    ("field", "value"),
    [("mode", "loud"), ("every", 0), ("sequences", 0), ("length", 1), ("tolerance", -1.0), ("tolerance", math.inf),
     ("vocab_size", 0), ("calibrate", 1), ("probe", [[1, 2]])],
)
def test_config_refuses_a_bad_field_by_name(field, value):
    with pytest.raises(ValueError, match=f"CanaryConfig.{field}"):
        CanaryConfig(**{field: value})


def test_the_least_precise_dtype_sets_the_tolerance():
    assert least_precise([torch.float32, torch.bfloat16]) == torch.bfloat16
    assert least_precise([torch.float16, torch.bfloat16]) == torch.bfloat16
    assert least_precise([torch.float32, None]) == torch.float32
    assert least_precise([None]) == torch.float32
    assert tolerance_for([torch.float32, torch.float32]) == TOLERANCES[torch.float32]
    assert tolerance_for([torch.float32, torch.bfloat16]) == TOLERANCES[torch.bfloat16]


def test_compare_finds_the_worst_token_and_counts_a_nan_as_infinite():
    probe = Probe.of([[5, 6, 7], [8, 9, 10, 11]])
    reference = [[-1.0, -2.0], [-3.0, -4.0, -5.0]]
    got = [[-1.0, -2.001], [-3.0, -4.5, -5.0]]
    result = compare("e", probe, reference, got)
    assert (result.sequence, result.position, result.token) == (1, 2, 10)
    assert result.max_abs == pytest.approx(0.5) and result.mean_abs == pytest.approx(0.501 / 5)
    assert (result.trainer_logprob, result.engine_logprob, result.tokens) == (-4.0, -4.5, 5)
    nan = compare("e", probe, reference, [[-1.0, math.nan], [-3.0, -4.0, -5.0]])
    assert nan.max_abs == math.inf and (nan.sequence, nan.position) == (0, 2)
    both = compare("e", probe, [[-1.0, -math.inf], [-3.0, -4.0, -5.0]], [[-1.0, -math.inf], [-3.0, -4.0, -5.0]])
    assert both.max_abs == 0.0
    with pytest.raises(ValueError, match="engine 'e''s log-probs of sequence 1: 2 values, expected 3"):
        compare("e", probe, reference, [[-1.0, -2.0], [-3.0, -4.0]])


def _report(canary: Canary, version: int, delta: float, dtypes=(torch.float32,)) -> CanaryReport:
    probe = canary.probe_for(100)
    reference = [[-1.0] * (len(s) - 1) for s in probe.sequences]
    got = [[-1.0 - delta] + [-1.0] * (len(s) - 2) for s in probe.sequences]
    return canary.judge(version, probe, reference, {"llm": got}, dtypes=dtypes)


def test_runs_on_the_first_sync_and_every_nth_after():
    canary = Canary(CanaryConfig(mode="log", every=3))
    assert [canary.due() for _ in range(7)] == [True, False, False, True, False, False, True]
    off = Canary(CanaryConfig(mode="off"))
    assert not any(off.due() for _ in range(3)) and as_canary(CanaryConfig(mode="off")) is None
    assert as_canary(CanaryConfig(every=10)).enabled  # a config is a canary: "log" unless it says otherwise
    assert as_canary(None) is None


def test_the_default_is_on_in_log_mode_at_the_first_sync_and_every_hundredth_after():
    canary = as_canary(DEFAULT)
    assert canary.by_default and canary.config == CanaryConfig(mode="log", every=DEFAULT_EVERY) == default_config()
    assert DEFAULT_EVERY == 100
    checked = [n for n in range(1, 302) if canary.due()]
    assert checked == [1, 101, 201, 301]
    assert not as_canary(CanaryConfig(mode="log", every=100)).by_default  # the same settings, given: errors stay errors
    assert as_canary(DEFAULT) is not canary  # one per sync


def test_the_default_says_once_what_it_did_not_check_and_sets_aside_an_engine_that_computed_nothing(caplog):
    canary = Canary.default()
    caplog.set_level("DEBUG", logger="hal.canary")
    for _ in range(3):
        canary.not_checked("the sync's source (dict)", "it is not a module")
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "the sync's source (dict) is not checked: it is not a module" in warned[0].getMessage()
    assert "canary=None (verl: engine_kwargs['hal'].canary: null) turns the default off" in warned[0].getMessage()
    assert canary.unchecked == {"the sync's source (dict)": "it is not a module"}
    got = {"a": [[-1.0]], "b": RuntimeError("refused")}
    assert canary.set_aside(got) == {"a": [[-1.0]]} and "engine 'b'" in canary.unchecked
    given = Canary(CanaryConfig(mode="log"))
    assert given.set_aside(got) == got  # an engine that computed nothing fires a canary of the user's


def test_enforce_raises_naming_engine_position_and_delta_and_log_does_not():
    canary = Canary(CanaryConfig(mode="enforce", probe=Probe.of([[3, 4, 5]])))
    report = _report(canary, 7, 0.25)
    assert report.fired and report.engines["llm"].max_abs == pytest.approx(0.25)
    with pytest.raises(CanaryError, match=r"version 7.*engine 'llm': max \|Δ log-prob\| 0\.25 at sequence 0, position 1 \(token 4") as fired:
        canary.enforce(report)
    assert fired.value.report is report
    quiet = _report(canary, 8, 1e-5)
    assert not quiet.fired
    canary.enforce(quiet)  # nothing raised
    logged = Canary(CanaryConfig(mode="log"))
    logged.enforce(_report(logged, 1, 0.25))  # fired, logged, not raised


def test_an_engine_that_computed_nothing_fires():
    canary = Canary(CanaryConfig(mode="enforce", probe=Probe.of([[3, 4, 5]])))
    probe = canary.probe_for(None)
    report = canary.judge(1, probe, [[-1.0, -1.0]], {"llm": RuntimeError("refused")}, dtypes=(torch.float32,))
    assert report.fired and report.engines["llm"].error == "RuntimeError: refused"
    with pytest.raises(CanaryError, match="engine 'llm' computed no log-probs on the canary's probe: RuntimeError: refused"):
        canary.enforce(report)


def test_calibration_tightens_to_a_margin_over_the_first_check_within_floor_and_table():
    canary = Canary(CanaryConfig(mode="enforce", calibrate=True))
    first = _report(canary, 1, 0.1, dtypes=(torch.float32, torch.bfloat16))
    assert first.calibrated and not first.fired
    assert first.tolerance == pytest.approx(CALIBRATION_MARGIN * 0.1) == canary.calibrated
    assert not _report(canary, 2, 0.3, dtypes=(torch.float32, torch.bfloat16)).fired
    assert _report(canary, 3, 0.5, dtypes=(torch.float32, torch.bfloat16)).fired  # 0.5 > 0.4: what bf16's table would pass
    tiny = Canary(CanaryConfig(mode="log", calibrate=True))
    assert _report(tiny, 1, 1e-7).tolerance == CALIBRATION_FLOORS[torch.float32]
    # a first check that fires calibrates nothing: a broken first sync cannot hide itself
    broken = Canary(CanaryConfig(mode="log", calibrate=True))
    report = _report(broken, 1, 0.5)
    assert report.fired and not report.calibrated and broken.calibrated is None
    assert report.tolerance == TOLERANCES[torch.float32]


def test_an_explicit_tolerance_is_used_as_given():
    canary = Canary(CanaryConfig(mode="log", tolerance=0.3))
    assert not _report(canary, 1, 0.29, dtypes=(torch.float32,)).fired
    assert _report(canary, 2, 0.31, dtypes=(torch.float32,)).fired


def test_the_report_travels_as_json_and_gives_numeric_metrics():
    canary = Canary(CanaryConfig(mode="log"))
    report = _report(canary, 3, 0.25)
    report.seconds = 0.5
    again = CanaryReport.from_dict(json.loads(json.dumps(report.as_dict())))
    assert again == report and again.fired
    metrics = report.as_metrics()
    assert metrics == {
        "canary/fired": 1.0, "canary/tolerance": TOLERANCES[torch.float32], "canary/seconds": 0.5,
        "canary/max_abs": pytest.approx(0.25), "canary/mean_abs": report.mean_abs,
    }


class TinyLM(torch.nn.Module):
    """A causal LM whose next-token distribution depends on the previous token only."""

    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 8)
        self.head = torch.nn.Linear(8, vocab)
        self.dropout = torch.nn.Dropout(0.5)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.embed(input_ids)))


def test_module_logprobs_scores_each_next_token_in_eval_mode_and_restores_the_mode():
    torch.manual_seed(0)
    model = TinyLM()
    model.train()
    model.embed.eval()  # a frozen part stays as it was
    probe = Probe.of([[1, 2, 3, 4], [5, 6, 7, 8]])
    got = module_logprobs(model, probe)
    assert model.training and model.dropout.training and not model.embed.training
    with torch.no_grad():
        model.eval()
        logits = model.head(model.embed(torch.tensor(probe.sequences)))
    want = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.tensor(probe.sequences)[:, 1:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(got), want, atol=1e-6)
    uneven = module_logprobs(model, Probe.of([[1, 2, 3, 4], [5, 6]]))
    assert [len(r) for r in uneven] == [3, 1] and uneven[0] == pytest.approx(got[0])
    assert vocab_size_of(model) == 11


def _fsdp_rank(rank: int, world: int) -> dict:
    """An FSDP2 TinyLM on 2 gloo ranks: both compute the probe; the parameters stay sharded."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM()
    plain = [module_logprobs(model, Probe.of([[1, 2, 3, 4], [5, 6, 7, 8]]))]
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kinds_before = sorted({type(p).__name__ for p in model.parameters()})
    got = module_logprobs(model, Probe.of([[1, 2, 3, 4], [5, 6, 7, 8]]))
    kinds_after = sorted({type(p).__name__ for p in model.parameters()})
    full = {n: p.full_tensor().sum().item() for n, p in model.named_parameters()}  # a collective: fails on plain tensors
    dist.barrier()
    return {"plain": plain[0], "got": got, "before": kinds_before, "after": kinds_after, "full": full}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_an_fsdp2_module_computes_the_same_and_stays_sharded():
    from tests.multiproc import run_group

    ranks = run_group(_fsdp_rank, 2, timeout=150)
    for rank in ranks:
        assert rank["before"] == rank["after"] == ["DTensor"], rank
        assert torch.allclose(torch.tensor(rank["got"]), torch.tensor(rank["plain"]), atol=1e-6)
    assert ranks[0]["full"] == ranks[1]["full"]


def test_the_docs_settings_table_gives_the_configs_defaults():
    """docs/canary.md's `CanaryConfig` table: each row's defaults, in the order of its fields."""
    import dataclasses
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "canary.md").read_text()
    table = text.split("## Settings (`CanaryConfig`)", 1)[1].split("\n## ", 1)[0]
    defaults = {f.name: f.default for f in dataclasses.fields(CanaryConfig)}
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    documented = set()
    for row in rows:
        names_cell, values_cell = (cell.strip() for cell in row.strip("|").split("|")[:2])
        names = [n.strip("` ") for n in names_cell.split(",")]
        values = [v.strip().strip("`").strip('"') for v in values_cell.split(",")]
        assert len(names) == len(values), row
        for name, value in zip(names, values):
            assert name in defaults, f"docs/canary.md names {name!r}, which CanaryConfig has not"
            assert value == str(defaults[name]), f"docs/canary.md: {name} defaults to {value}, CanaryConfig to {defaults[name]!r}"
            documented.add(name)
    assert documented == set(defaults)
