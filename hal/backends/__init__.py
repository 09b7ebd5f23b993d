"""One module per backend; every device-specific call in verl-hal lives in this package.

Backends are imported lazily by name (see `hal.device`), so importing `hal` imports
none of them and touches no device.
"""

# name -> "module:Class" of the built-in backends; other packages add theirs through
# the `hal.backends` entry-point group.
BUILTIN_BACKENDS = {
    "cpu": "hal.backends.cpu:CpuBackend",
    "cuda": "hal.backends.cuda:CudaBackend",
    "npu": "hal.backends.npu:NpuBackend",
    "sim": "hal.backends.sim:SimBackend",
}

# Accelerators `auto` considers, in this order; `sim` and `cpu` are never auto-picked over them.
AUTO_CANDIDATES = ("cuda", "npu")
