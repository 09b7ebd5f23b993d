"""hal's verl integration: verl's platform "hal" and checkpoint engine "hal".

What each module holds (importing this package imports none of them, and no verl):

- `plugin`: the `verl.plugins` entry point; importing it registers `platform.HalPlatform`
  and `checkpoint.HalCheckpointEngine` with verl (imports verl).
- `checkpoint`: the checkpoint engine (verl's contract: one update, the flow of docs/verl.md),
  with `settings` (`engine_kwargs["hal"]` as a `SyncConfig`), `topology` (the sync groups
  of one update, one per sending trainer rank with `senders: all`), `weights` (verl's
  generator as a hal source; hal's receive as verl's generator) and `shards` (the training
  engine's shards as the source with `senders: all`).
- `canary`: the runtime-state canary (hal.canary) after a completed update, run from
  the checkpoint engine's `finalize()` (`CanaryDuty`; imports no verl).
- `platform`: verl's device code through hal's resolved backend.
- `internals`: every private verl name verl-hal uses, behind a version check.
"""
