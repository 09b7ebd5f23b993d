"""Questions a device's runtime answers about itself, asked through the backend contract
(hal.backends.interface.Backend inherits them): allocator settings, compute capability, runtime
versions, device-memory IPC, vendor and model, profiler ranges. Each validates and asks its
hook (hal.backends.hooks); devices without the notion answer None, {} or a reason.
"""

from __future__ import annotations

import contextlib

from hal.backends.hooks import BackendHooks


class RuntimeQuestions(BackendHooks):
    """The runtime questions of `Backend` (see the module doc)."""

    # ---- runtime questions with device-specific answers -------------------------------
    # Each has a generic "not applicable" answer in the base hook; only the backends whose
    # device has the notion override it. hal.compat.verl translates these into verl's names.
    def set_allocator_settings(self, *, expandable_segments: bool) -> str | None:
        """Configure the device's caching allocator; returns None when applied, else why not.

        `expandable_segments`: let the allocator grow a segment in place instead of
        allocating new ones (less fragmentation for weights that are freed and reloaded).
        Applied on CUDA, and on NPU where torch_npu offers the setting; elsewhere nothing
        changes and the answer is the reason (the CPU has no caching allocator), like
        `unavailable_reason()`. Invalid input raises `ValueError`.
        """
        if not isinstance(expandable_segments, bool):
            raise ValueError(
                f"set_allocator_settings: expandable_segments must be a bool, got "
                f"{type(expandable_segments).__name__} {expandable_segments!r}"
            )
        return self._set_allocator_settings(expandable_segments)

    def device_capability(self, index: int | None = None, /) -> tuple[int, int] | None:
        """(major, minor) compute capability of device `index` (the current one when None).

        CUDA answers with its compute capability (a ROCm build with what torch reports for
        the GPU); devices without the notion (npu, cpu, sim) answer None. A bad index raises
        `ValueError` as `device()` does.
        """
        if index is None:
            index = self.current_device()
        self._check_index(index)
        answer = self._device_capability(index)
        if answer is None:
            return None
        major, minor = answer
        return int(major), int(minor)

    def runtime_versions(self) -> dict[str, str]:
        """Versions of the device runtime under torch, by component name; empty when none.

        cuda: `"cuda"` (the CUDA runtime torch was built with) or `"hip"` on ROCm; the
        driver is not included (torch has no public call for it and a subprocess is not
        cheap). npu: `"driver"` (npu-smi's Software Version) and `"cann"` (the CANN toolkit's
        install-info file), lower-cased; raises `RuntimeError` naming what is missing when
        npu-smi or the file cannot be read. cpu, sim: `{}`.
        """
        versions = self._runtime_versions()
        for key, value in versions.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"backend {self.name!r}: runtime_versions must map str to str, got {key!r}: {value!r}")
        return dict(versions)

    def supports_device_memory_ipc(self) -> bool:
        """Whether device memory can be opened by another process through an IPC handle.

        This is device memory only: cpu and sim answer False although their `supports_ipc`
        is True (they share host memory files). cuda: True except on ROCm builds (rebuilding
        HIP IPC handles fails in vLLM workers). npu: only with driver >= 25.3.rc1 and CANN
        >= 8.3.rc1, read through `runtime_versions()` (so it raises `RuntimeError` when they
        cannot be read).
        """
        if not self.supports_ipc:
            return False
        return bool(self._supports_device_memory_ipc())

    def vendor_name(self) -> str:
        """Who makes the device this process computes on: the declared `vendor`, unless the
        torch build says otherwise (cuda on a ROCm build of torch: "amd")."""
        return self._vendor_name()

    def device_model(self, index: int | None = None, /) -> str | None:
        """The product name the device's runtime reports for device `index` (the current
        one when None): "NVIDIA H100 80GB HBM3", "Ascend910B2"; None on cpu and sim. A bad
        index raises `ValueError` as `device()` does."""
        if index is None:
            index = self.current_device()
        self._check_index(index)
        model = self._device_model(index)
        return None if model is None else str(model)

    # ---- profiling ----------------------------------------------------------------------
    def profiler_range(self, message: str, /) -> contextlib.AbstractContextManager:
        """A context manager marking a named range for the device's profiler (NVTX on CUDA).

        Where the device's runtime has no such ranges (npu, cpu, sim) it does nothing.
        """
        if not isinstance(message, str):
            raise ValueError(f"profiler_range: message must be a str, got {type(message).__name__}")
        marker = self._profiler_range(message)
        return contextlib.nullcontext() if marker is None else marker

    def profiler_control(self, *, start: bool) -> str | None:
        """Start (`start=True`) or stop the device's own profiler capture (cudaProfilerStart
        / Stop on CUDA); returns None when done, else why nothing happened (like
        `set_allocator_settings`)."""
        if not isinstance(start, bool):
            raise ValueError(f"profiler_control: start must be a bool, got {type(start).__name__}")
        return self._profiler_control(start)
