#!/usr/bin/env bash
# Ascend NPU lane: tests marked `npu` and the conformance suite with VERL_DEVICE=npu.
# Prints why and exits 0 where no NPU is usable (torch_npu missing or no device). See docs/ci.md.
exec bash "$(dirname "$0")/_hardware_lane.sh" npu
