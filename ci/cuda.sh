#!/usr/bin/env bash
# CUDA lane: tests marked `cuda` and the conformance suite with VERL_DEVICE=cuda.
# Prints why and exits 0 where no NVIDIA GPU is usable. See docs/ci.md.
exec bash "$(dirname "$0")/_hardware_lane.sh" cuda
