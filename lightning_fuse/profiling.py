"""Evidence of fusion: kernel launches and GPU-busy time per step, from a short ``torch.profiler`` window.

A compiled step that is faster should launch fewer kernels (fusion) and keep the GPU busier (less launch
overhead). FuseCallback profiles a few compiled steps and a few eager ones, once per fit, outside the timed steps.

Example::

    >>> window = ProfileWindow(steps=2)
    >>> window.active
    False
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls that make the host wait for the device (``cudaMemcpy`` is the synchronous copy)."""


@dataclass
class KernelStats:
    """Kernels launched, GPU-busy fraction and the host's waits for the device (:data:`SYNC_CALLS`) per profiled
    step, and the GPU's own time a step (``gpu_ms_per_step``: how long the step would take if the host never
    kept the GPU waiting).

    Example::

        >>> KernelStats(kernels_per_step=120.0, gpu_busy_frac=0.6).gpu_busy_frac
        0.6
    """

    kernels_per_step: float
    gpu_busy_frac: float
    syncs_per_step: float = 0.0
    gpu_ms_per_step: float = 0.0


class ProfileWindow:
    """Profiles ``steps`` consecutive steps: call :meth:`step_start`/:meth:`step_end` around each.

    Args:
        steps: How many steps to profile.

    Example::

        >>> window = ProfileWindow(steps=1)
        >>> window.done
        False
    """

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.result: KernelStats | None = None
        self._profiler: profile | None = None
        self._seen = 0
        self._started = 0.0

    @property
    def active(self) -> bool:
        return self._profiler is not None

    @property
    def done(self) -> bool:
        return self.result is not None

    def step_start(self) -> None:
        if self._profiler is None:
            torch.cuda.synchronize()  # the window must start with an idle GPU to measure busy time
            self._profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._profiler.__enter__()
            self._started = time.perf_counter()

    def step_end(self) -> None:
        self._seen += 1
        if self._seen < self.steps:
            return
        torch.cuda.synchronize()  # every kernel of the window has run
        wall = time.perf_counter() - self._started
        self._profiler.__exit__(None, None, None)
        self.result = kernel_stats(self._profiler, self.steps, wall)
        self._profiler = None

    def abort(self) -> None:
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None


def kernel_stats(prof: profile, steps: int, wall_s: float) -> KernelStats:
    """Count the GPU's own work in a finished profile (:func:`device_work`), the share of ``wall_s`` it kept the GPU
    busy, and the host's synchronising calls."""
    events = prof.events()
    kernels = device_work(events)
    busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in kernels])
    syncs = sum(e.name in SYNC_CALLS for e in events)
    busy_frac = min(1.0, busy_us / 1e6 / wall_s) if wall_s > 0 else 0.0
    return KernelStats(len(kernels) / steps, busy_frac, syncs / steps, busy_us / 1e3 / steps)


def device_work(events: list) -> list:
    """The GPU's own work among a profile's ``events``: its kernels, copies and memsets. Not the GPU ranges the
    profiler draws for host annotations (``Optimizer.step#AdamW.step``, ``record_function``): such a range spans the
    first to the last kernel its host code launched, idle gaps included."""
    return [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of intervals (kernels on several streams may overlap)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total
