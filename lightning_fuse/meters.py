"""What a fit measures of the GPU besides its step times: the FLOPs of a batch and the device's peak for MFU, NVML's
utilisation sampled in a thread, the profiled kernel windows of ``profile_steps``, and the CUDA graphs torch's
cudagraph trees recorded.

:class:`GpuMeters` holds them for one fit; :func:`~lightning_fuse.measurement.start_measuring` starts them and the
epoch's scalars read them. Off CUDA it measures nothing and says so once.

Example::

    >>> meters = GpuMeters()
    >>> meters.start(torch.device("cpu"), "32-true", flops_per_batch=None, sample_hz=10.0, profile_steps=0)
    >>> meters.needs_flops(), meters.read()
    (False, {})
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_fuse import compat, gpu
from lightning_fuse.profiling import ProfileWindow
from lightning_fuse.timing import COMPILED, EAGER


@dataclass
class GpuMeters:
    """MFU's FLOPs, NVML sampling and profile windows of one fit.

    Example::

        >>> GpuMeters().profiles
        {}
    """

    peak_flops: float | None = None
    flops_per_batch: float | None = None
    sampler: gpu.GpuSampler | None = None
    profiles: dict[str, ProfileWindow] = field(default_factory=dict)
    """The plan's steps' window and the eager reference's, by step kind (empty: no profiling)."""
    profile: ProfileWindow | None = None
    """The window the running step is profiled in."""
    profile_logged: bool = False
    _flops: Any = None

    def start(self, device: torch.device, precision: str, flops_per_batch: float | None, sample_hz: float,
              profile_steps: int) -> None:  # fmt: skip
        """Peak FLOPs in ``precision`` (the Trainer's), NVML sampling at ``sample_hz`` (``0``: none) and the profile
        windows of ``profile_steps`` steps, on a CUDA ``device``; ``flops_per_batch``: the module's own, if it has
        it (else counted on an eager step)."""
        if device.type != "cuda":
            rank_zero_info("FuseCallback: no CUDA device, so GPU utilisation, MFU and peak memory are not measured.")
            if profile_steps:
                rank_zero_info("FuseCallback: `profile_steps` counts GPU kernels and needs a CUDA device; skipped.")
            return
        self.peak_flops = gpu.peak_flops(device, gpu.compute_dtype(precision))
        self.flops_per_batch = flops_per_batch
        if profile_steps:
            self.profiles = {COMPILED: ProfileWindow(profile_steps), EAGER: ProfileWindow(profile_steps)}
        if sample_hz > 0:
            self.sampler = gpu.GpuSampler(gpu.nvml_index(device), hz=sample_hz)
            if not self.sampler.start():
                self.sampler = None

    def needs_flops(self) -> bool:
        """Whether a batch's FLOPs are still to be counted (on an untimed eager step), for MFU."""
        return self.peak_flops is not None and self.flops_per_batch is None

    def count_flops(self, step: ExitStack) -> None:
        """Count the FLOPs of the step whose contexts ``step`` holds (:meth:`keep_flops` once it is left)."""
        self._flops = step.enter_context(gpu.count_step_flops())

    def keep_flops(self) -> None:
        """Keep the FLOPs the step just left counted, if it counted any."""
        if self._flops is not None:
            self.flops_per_batch = float(self._flops.total) or None
            self._flops = None

    def read(self) -> dict[str, float]:
        """NVML's utilisation since the last read (``{}`` without sampling)."""
        return self.sampler.read_and_reset() if self.sampler else {}

    def kernel_metrics(self) -> dict[str, float]:
        """The profiled kernel counts, once, after both windows finished (``{}`` before and after)."""
        if self.profile_logged or not self.profiles or not all(w.done for w in self.profiles.values()):
            return {}
        self.profile_logged = True
        compiled, eager = self.profiles[COMPILED].result, self.profiles[EAGER].result
        return {
            "kernels_per_step": compiled.kernels_per_step,
            "eager_kernels_per_step": eager.kernels_per_step,
            "gpu_busy_frac": compiled.gpu_busy_frac,
            "eager_gpu_busy_frac": eager.gpu_busy_frac,
            "gpu_ms_per_step": compiled.gpu_ms_per_step,
            "eager_gpu_ms_per_step": eager.gpu_ms_per_step,
        }

    def stop(self) -> None:
        """Stop sampling and leave an unfinished profile window."""
        for window in self.profiles.values():
            window.abort()
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None


def cudagraph_trees(device: torch.device) -> tuple[int, int]:
    """The CUDA graphs torch's cudagraph trees hold on ``device`` and inductor's cudagraph skips, so far in this
    process (:func:`compat.cudagraph_tree_stats`); ``(0, 0)`` off CUDA."""
    if device.type != "cuda":
        return 0, 0
    return compat.cudagraph_tree_stats(device.index if device.index is not None else torch.cuda.current_device())
