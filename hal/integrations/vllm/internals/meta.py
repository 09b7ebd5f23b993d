"""vLLM's own model class built as a worker of an engine that does not exist would build
it (issue 41: `hal plan`, through hal.integrations.vllm.meta_engine).

Three things of vLLM's, none public:
- its config of an engine for a model directory (`EngineArgs(...).create_engine_config()`),
  which reads the directory's `config.json` and nothing else here (no tokenizer, no weights);
- its parallel state: the process groups of `vllm.distributed.parallel_state`
  (`PARALLEL_GROUPS`), which a model's layers ask for their size and rank as they are built
  and loaded. `pretend_worker` puts in their place groups that answer for one worker of a
  TP x DP engine (expert parallelism over both, as vLLM lays it out) and communicate with
  no one, and sets the parallel config's sizes to match; both are put back on exit;
- `initialize_model`, vLLM's own construction of the model class (it also records the
  metadata vLLM's layerwise reload restores from; the caller puts the parameters on the
  meta device as they are registered), with a fresh registry of attention layers.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Iterator

import torch

from hal.integrations.vllm.internals.versions import require_supported_vllm

PARALLEL_STATE_MODULE = "vllm.distributed.parallel_state"
MODEL_LOADER_UTILS_MODULE = "vllm.model_executor.model_loader.utils"
# The groups a model's layers may ask for while built and loaded: the world, tensor,
# pipeline, data, expert, decode- and prefill-context parallel groups.
PARALLEL_GROUPS = ("_WORLD", "_TP", "_PP", "_DP", "_EP", "_DCP", "_PCP")
# The parallel config's sizes a pretended worker sets (and puts back).
PARALLEL_SIZES = ("tensor_parallel_size", "data_parallel_size", "enable_expert_parallel")


class PretendGroup:
    """A vLLM process group of `world_size` ranks seen from `rank_in_group`: what vLLM's
    `GroupCoordinator` answers about size and rank (its device group's `size()` and
    `rank()` too, which a MoE block reads), and nothing else: a model that communicates
    while it is built cannot be built on paper, and is refused naming what it asked."""

    def __init__(self, world_size: int, rank_in_group: int) -> None:
        self.world_size = world_size
        self.rank_in_group = rank_in_group
        self.ranks = list(range(world_size))
        self.rank = self.local_rank = rank_in_group
        self.device_group = self.cpu_group = SimpleNamespace(size=lambda: world_size, rank=lambda: rank_in_group)
        self.unique_name = f"hal-pretend:{rank_in_group}/{world_size}"

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"hal plan's pretended vLLM process group has no {name!r}: the model uses it while it is built")


def meta_vllm_config(model_dir: str, dtype: str, hf_overrides: dict[str, Any] | None = None) -> Any:
    """vLLM's config of an engine for `model_dir` (a folder with a `config.json`) in
    `dtype` ("bfloat16", "float16", "float32"), with `hf_overrides` of the model's config:
    no tokenizer, eager, no weights read."""
    require_supported_vllm()
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, hf_overrides=hf_overrides or {})
    return args.create_engine_config()


@contextlib.contextmanager
def pretend_worker(vllm_config: Any, tp: int, dp: int, tp_rank: int, dp_rank: int, ep: bool) -> Iterator[None]:
    """For the length of the block this process answers as worker `dp_rank x tp + tp_rank`
    of an engine of `tp` x `dp` workers (`ep`: its experts over all of them): vLLM's
    parallel groups and `vllm_config`'s parallel sizes say so. Everything is put back on
    exit (an engine of this process, if any, keeps its own groups)."""
    import importlib

    state = importlib.import_module(PARALLEL_STATE_MODULE)
    parallel = vllm_config.parallel_config
    workers, worker = tp * dp, dp_rank * tp + tp_rank
    groups = dict(zip(PARALLEL_GROUPS, (
        PretendGroup(workers, worker), PretendGroup(tp, tp_rank), PretendGroup(1, 0), PretendGroup(dp, dp_rank),
        PretendGroup(workers, worker) if ep else PretendGroup(1, 0), PretendGroup(1, 0), PretendGroup(1, 0),
    )))
    saved_groups = {name: getattr(state, name) for name in PARALLEL_GROUPS}
    saved_sizes = {name: getattr(parallel, name) for name in PARALLEL_SIZES}
    try:
        for name, group in groups.items():
            setattr(state, name, group)
        for name, value in zip(PARALLEL_SIZES, (tp, dp, ep)):
            setattr(parallel, name, value)
        yield
    finally:
        for name, group in saved_groups.items():
            setattr(state, name, group)
        for name, value in saved_sizes.items():
            setattr(parallel, name, value)


def build_model(vllm_config: Any, hf_overrides: dict[str, Any] | None = None) -> torch.nn.Module:
    """vLLM's model class for `vllm_config`, built by vLLM's `initialize_model` at the
    worker `pretend_worker` says, with the model config's fields `hf_overrides` for the
    length of the build (put back after)."""
    import importlib

    text_config = vllm_config.model_config.hf_text_config
    saved = {key: getattr(text_config, key) for key in hf_overrides or {}}
    initialize = importlib.import_module(MODEL_LOADER_UTILS_MODULE).initialize_model
    # vLLM registers every attention layer by name in the compilation config as it is
    # built: a fresh registry per build, so that a second build's layers do not collide
    vllm_config.compilation_config.static_forward_context = {}
    try:
        for key, value in (hf_overrides or {}).items():
            setattr(text_config, key, value)
        return initialize(vllm_config=vllm_config)
    finally:
        for key, value in saved.items():
            setattr(text_config, key, value)
