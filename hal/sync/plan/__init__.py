"""Where each tensor goes, from metadata alone.

- `buckets`: one sender's layout: buckets, segments, pieces (`build_plan`, `PlanCache`);
- `steady`: what each side recognises as unchanged since the last sync;
- M-to-N (every trainer rank sends its own rows): `declare` (what a rank holds, and how
  the ranks agree the plan from it), `shards` (`ShardPlan`: who sends which rows or
  blocks, under which wire name, each tensor tiled exactly once).
  The engine's side: `needs` (`WorkerNeeds`: the boxes of each tensor an engine worker
  loads and where they land, recorded from its loaders) and `mxn` (`MxNPlan`: the shares
  cut by the needs, one link per trainer rank and engine worker); `link_specs`: one link's
  pieces as the wire tensors of a sync of the core; `exchange`: the workers' needs told
  at init, whole or shard receive (`choose_receive`), a trainer rank's plans (`LinkPlans`).

Nothing per sync lives here: tensors and iterators are each sync's own.
"""

from hal.sync.plan.buckets import Bucket, BucketPlan, PlanCache, Segment, bucket_offsets, build_plan, is_solo, segment_word
from hal.sync.plan.declare import Block, ShardPlanExchange, declare
from hal.sync.plan.shards import BLOCK, SHARD0, ShardPlan, build_shard_plan, covering_blocks, parse_block_name
from hal.sync.plan.steady import KnownDeclaration, KnownDestinations, KnownSource

__all__ = [
    "BLOCK",
    "Block",
    "Bucket",
    "BucketPlan",
    "KnownDeclaration",
    "KnownDestinations",
    "KnownSource",
    "PlanCache",
    "SHARD0",
    "Segment",
    "ShardPlan",
    "ShardPlanExchange",
    "bucket_offsets",
    "build_plan",
    "build_shard_plan",
    "covering_blocks",
    "declare",
    "is_solo",
    "parse_block_name",
    "segment_word",
]
