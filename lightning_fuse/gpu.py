r"""GPU utilisation sampling through NVML, and model FLOPs utilisation (MFU).

``GpuSampler`` polls NVML on a daemon thread and keeps running sums, so an epoch's averages cost a few floats.
``utilization.gpu`` only says that *some* kernel was running during NVML's sample period (1/6 s to 1 s), so on
Hopper the sampler also reads the GPM metrics ``SM_UTIL`` and ``ANY_TENSOR_UTIL``, which say how much of the chip
was busy. MFU (``mfu``) is the better headline: FLOPs of one step (``count_step_flops``) over its time, divided by
the dense peak of the device (``peak_flops``).

The sampler is built from small pieces: ``_NvmlDevice`` (NVML init, the device handle, shutdown) reads the plain
counters (``_read_counters``) and, through ``_GpmReader``, GPM's; ``_Window`` aggregates what the thread samples
until the trainer reads it; ``GpuSampler`` owns the thread and turns NVML failures into one warning.

Example::

    >>> sampler = GpuSampler(hz=10.0)  # start() would begin sampling; False without NVML or a GPU
    >>> sampler.read_and_reset()  # nothing sampled yet
    {}
    >>> mfu(flops_per_batch=4e12, step_s=0.01, peak=1e15)  # 4e14 FLOP/s of a 1e15 peak
    0.4
"""

from __future__ import annotations

import importlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from types import ModuleType
from typing import Any

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.flop_counter import FlopCounterMode

from lightning_fuse import compat

log = logging.getLogger(__name__)

# NVML (GPM above all) is not safe to call from two threads at once: one lock for every sampler in the process.
_NVML_CALLS = threading.Lock()

# Output key -> name of the pynvml constant of the GPM metric it reads.
_GPM_METRICS = {"sm_active": "NVML_GPM_METRIC_SM_UTIL", "tensor_active": "NVML_GPM_METRIC_ANY_TENSOR_UTIL"}

# Dense (no 2:4 sparsity) peaks from NVIDIA's datasheets, for names that Lightning's table misses or lists with
# sparse numbers ("h200 sxm1", "h100 nvl"). First matching needle in the lower-cased device name wins, so the NVL
# parts come before the plain names. "tfloat32" is fp32 matmuls on tensor cores, as in Lightning's table.
_HOPPER = {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, "tfloat32": 494.7e12, torch.float32: 66.9e12}
_HOPPER_NVL = {torch.bfloat16: 835.5e12, torch.float16: 835.5e12, "tfloat32": 417.5e12, torch.float32: 60e12}
_DENSE_PEAKS: tuple[tuple[str, dict[torch.dtype | str, float]], ...] = (
    ("h200 nvl", _HOPPER_NVL),
    ("h100 nvl", _HOPPER_NVL),
    ("h200", _HOPPER),  # also GH200, whose GPU has the H100 SXM's peaks
    ("h100 80gb hbm3", _HOPPER),
    ("h100 sxm", _HOPPER),
)


@dataclass
class _Running:
    """Count, sum and maximum of a stream of floats, so that no sample is stored."""

    count: int = 0
    total: float = 0.0
    peak: float = float("-inf")

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.peak = max(self.peak, value)


class _Window:
    """The running aggregates of every metric since the last read; the sampling thread adds, the trainer reads."""

    _KEYS = ("gpu_util", "gpu_mem_gb", "sm_clock_mhz", *_GPM_METRICS)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = {key: _Running() for key in self._KEYS}

    def add(self, values: Iterable[tuple[str, float]]) -> None:
        with self._lock:
            for key, value in values:
                self._stats[key].add(value)

    def read_and_reset(self) -> dict[str, float]:
        """Means of every metric (maxima of memory and utilisation), then an empty window."""
        with self._lock:
            stats, self._stats = self._stats, {key: _Running() for key in self._KEYS}
        means = {key: s.total / s.count for key, s in stats.items() if s.count and key != "gpu_mem_gb"}
        if stats["gpu_util"].count:
            means["gpu_util_max"] = stats["gpu_util"].peak
        if stats["gpu_mem_gb"].count:
            means["gpu_mem_gb"] = stats["gpu_mem_gb"].peak
        return means


def _read_counters(nvml: Any, handle: Any) -> list[tuple[str, float]]:
    """``utilization.gpu`` (%), used memory (GB) and the SM clock (MHz) of one GPU, in that order."""
    util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    mem_gb = nvml.nvmlDeviceGetMemoryInfo(handle).used / 1e9
    clock = float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
    return [("gpu_util", util), ("gpu_mem_gb", mem_gb), ("sm_clock_mhz", clock)]


def _gpm_supported(nvml: Any, handle: Any) -> bool:
    try:
        return bool(nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
    except Exception as err:  # pre-Hopper GPU, old driver or old pynvml: sample without GPM
        log.debug(f"NVML GPM is unavailable ({err!r}); sm_active and tensor_active will not be sampled.")
        return False


class _GpmReader:
    """Two GPM sample buffers and one metrics request: each :meth:`read` gives the activity since the last one.

    The first read only takes a baseline and returns nothing. Callers hold ``_NVML_CALLS``.
    """

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml, self._handle = nvml, handle
        request = nvml.c_nvmlGpmMetricsGet_t()  # one request, reused by every read
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(_GPM_METRICS)
        for slot, constant in zip(request.metrics, _GPM_METRICS.values()):
            slot.metricId = getattr(nvml, constant)
        self._request = request
        self._samples: list[Any] = []  # [previous, current] once allocated
        self._primed = False  # the previous sample holds data

    def allocate(self) -> None:
        """Allocate the two sample buffers, one at a time, so that :meth:`free` frees what was allocated."""
        for _ in range(2):
            self._samples.append(self._nvml.nvmlGpmSampleAlloc())

    def read(self) -> list[tuple[str, float]]:
        """Take a GPM sample and return the metrics between it and the previous one (none for the first)."""
        nvml, (previous, current) = self._nvml, self._samples
        nvml.nvmlGpmSampleGet(self._handle, current)
        values = []
        if self._primed:
            request = self._request
            request.sample1, request.sample2 = previous, current
            nvml.nvmlGpmMetricsGet(request)
            for key, slot in zip(_GPM_METRICS, request.metrics):
                if slot.nvmlReturn == nvml.NVML_SUCCESS:
                    values.append((key, float(slot.value)))
        self._samples.reverse()  # the sample just taken is the next one's baseline
        self._primed = True
        return values

    def free(self) -> None:
        for sample in self._samples:
            _quietly(self._nvml.nvmlGpmSampleFree, sample)
        self._samples = []


class _NvmlDevice:
    """NVML initialised for one GPU: its handle and, where supported, a GPM reader. Callers hold ``_NVML_CALLS``."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._handle: Any = None
        self._gpm: _GpmReader | None = None
        self._initialised = False  # nvmlInit succeeded and nvmlShutdown is owed

    def open(self, index: int) -> None:
        """``nvmlInit``, the device's handle and GPM where supported; on an error, :meth:`close` undoes the rest."""
        self.nvml.nvmlInit()
        self._initialised = True
        self._handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
        if _gpm_supported(self.nvml, self._handle):
            self._gpm = _GpmReader(self.nvml, self._handle)
            self._gpm.allocate()

    def sample(self) -> list[tuple[str, float]]:
        """One sample of every metric: the plain counters, then GPM's (none on GPM's first read)."""
        values = _read_counters(self.nvml, self._handle)
        return values + (self._gpm.read() if self._gpm is not None else [])

    def close(self) -> None:
        """Free the GPM buffers and shut NVML down; safe to call more than once."""
        if self._gpm is not None:
            self._gpm.free()
            self._gpm = None
        if self._initialised:
            _quietly(self.nvml.nvmlShutdown)
            self._initialised = False


class GpuSampler:
    r"""Samples one GPU's NVML counters on a background thread and aggregates them between reads.

    Each sample reads ``utilization.gpu``, used memory and the SM clock; on devices with NVML GPM (Hopper and
    newer) it also reads the SM and tensor-core activity between this sample and the previous one. Nothing here
    raises into training: if NVML is missing, ``start`` returns ``False``; if NVML fails later, the sampler stops
    and the next ``read_and_reset`` or ``stop`` warns once.

    Args:
        device_index: NVML index of the GPU to sample. NVML numbers every GPU of the host and ignores
            ``CUDA_VISIBLE_DEVICES``, so map a CUDA index first where that variable is set (as
            ``torch.cuda.utilization`` does with ``torch.cuda._get_nvml_device_index``).
        hz: samples per second. NVML refreshes ``utilization.gpu`` every 1/6 s to 1 s, so more than ~10 adds
            cost but no information.
        nvml: a ``pynvml``-like module. ``None`` imports ``pynvml`` (package ``nvidia-ml-py``) on ``start``.

    Raises:
        ValueError: If ``device_index`` is negative or ``hz`` is not positive.

    Example::

        >>> sampler = GpuSampler(device_index=0, hz=10.0)
        >>> if sampler.start():  # False on a machine without NVML or GPU
        ...     stats = sampler.read_and_reset()  # {"gpu_util": 87.5, "gpu_util_max": 100.0, ...}
        >>> sampler.stop()
    """

    def __init__(self, device_index: int = 0, hz: float = 10.0, nvml: ModuleType | Any | None = None) -> None:
        if device_index < 0:
            raise ValueError(f"`device_index` must be >= 0 (an NVML GPU index), got {device_index}.")
        if not hz > 0:
            raise ValueError(f"`hz` must be > 0 samples per second, got {hz}. Try the default, 10.0.")
        self.device_index = device_index
        self.period_s = 1.0 / hz
        self._nvml = nvml
        self._device: _NvmlDevice | None = None
        self._window = _Window()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None  # NVML failure seen by the thread, not yet warned about

    def start(self) -> bool:
        """Initialise NVML, take a first sample and start the sampling thread.

        Returns:
            ``True`` if sampling runs, ``False`` (after one info log line) if NVML or the GPU is unavailable.

        Example::

            >>> GpuSampler().start()  # doctest: +SKIP
            True
        """
        if self._thread is not None:
            if self._thread.is_alive():
                return True
            self.stop()  # the thread ended on an NVML error: clean up (and warn) before trying again
        try:
            with _NVML_CALLS:
                if self._nvml is None:
                    self._nvml = importlib.import_module("pynvml")
                self._device = _NvmlDevice(self._nvml)
                self._device.open(self.device_index)
            self._sample()
        except Exception as err:  # NVMLError, ImportError, OSError (no libnvidia-ml.so): all mean "no GPU metrics"
            log.info(f"GPU sampling is off: NVML device {self.device_index} is unavailable ({err!r}).")
            self._close()
            return False
        self._stop_event.clear()
        self._thread = threading.Thread(target=self._run, name="lightning-fuse-gpu-sampler", daemon=True)
        self._thread.start()
        return True

    def read_and_reset(self) -> dict[str, float]:
        """Aggregate the samples taken since the last call, then start a new window.

        Returns:
            ``gpu_util`` (mean %), ``gpu_util_max`` (%), ``gpu_mem_gb`` (max used, GB), ``sm_clock_mhz`` (mean) and,
            with GPM, ``sm_active`` and ``tensor_active`` (mean %). A key with no sample is absent.

        Example::

            >>> GpuSampler().read_and_reset()  # never started: no samples
            {}
        """
        means = self._window.read_and_reset()
        self._warn_if_failed()
        return means

    def stop(self) -> None:
        """Stop the thread, free the GPM samples and shut NVML down. Safe to call more than once.

        Example::

            >>> sampler = GpuSampler()
            >>> sampler.stop()
            >>> sampler.stop()
        """
        self._stop_event.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5.0)
            if thread.is_alive():  # a hung NVML call: leave its buffers alone, the daemon thread dies with us
                log.debug("GPU sampler thread did not stop within 5 s; NVML is left initialised.")
                return
        self._close()
        self._warn_if_failed()

    def _run(self) -> None:
        while not self._stop_event.wait(self.period_s):
            try:
                self._sample()
            except Exception as err:  # training must not see NVML errors: stop sampling, warn on the next read
                self._error = err
                return

    def _sample(self) -> None:
        with _NVML_CALLS:
            values = self._device.sample()
        self._window.add(values)

    def _close(self) -> None:
        device, self._device = self._device, None
        if device is not None:
            with _NVML_CALLS:
                device.close()

    def _warn_if_failed(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            rank_zero_warn(
                f"GPU sampling stopped: NVML device {self.device_index} failed with {err!r}. Training goes on"
                " without GPU metrics from here; check `nvidia-smi` for a lost GPU or a reloaded driver."
            )


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    """Call an NVML clean-up function; a failure there changes nothing for the caller."""
    try:
        fn(*args)
    except Exception as err:
        log.debug(f"{getattr(fn, '__name__', fn)} failed during clean-up: {err!r}")


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    r"""Dense peak FLOP/s of ``device`` for matmuls in ``dtype``, or ``None`` where it is unknown.

    Our table of dense Hopper peaks is read first (Lightning misses the names "NVIDIA H200" and
    "NVIDIA H200 NVL" and lists sparse peaks for "h100 nvl"), then Lightning's ``get_available_flops``. As there,
    ``torch.float32`` means TF32 tensor cores unless ``torch.get_float32_matmul_precision()`` is ``"highest"``.
    A CUDA device with no known peak warns once per name and dtype.

    Args:
        device: the device the model trains on. Anything but CUDA gives ``None``.
        dtype: the matmul dtype, e.g. ``torch.bfloat16`` under bf16 autocast.

    Example::

        >>> peak_flops(torch.device("cpu"), torch.bfloat16) is None
        True
    """
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return _peak_flops_for(name, device, dtype, torch.get_float32_matmul_precision())


@cache
def _peak_flops_for(name: str, device: torch.device, dtype: torch.dtype, fp32_precision: str) -> float | None:
    """Look the peak up once per (name, dtype, precision), so that the miss warning fires once."""
    key: torch.dtype | str = "tfloat32" if dtype is torch.float32 and fp32_precision != "highest" else dtype
    for needle, peaks in _DENSE_PEAKS:
        if needle in name.lower() and key in peaks:
            return peaks[key]
    with warnings.catch_warnings():  # Lightning warns on every miss; we warn once below
        warnings.simplefilter("ignore")
        flops = get_available_flops(device, dtype)
    if flops is None:
        rank_zero_warn(
            f"No peak FLOP/s known for {name!r} with {dtype}, so fuse/mfu is not logged. Open an issue with the"
            " device name and its datasheet's dense peak to add it."
        )
        return None
    return float(flops)


def mfu(flops_per_batch: float, step_s: float, peak: float | None) -> float | None:
    r"""Model FLOPs utilisation: achieved FLOP/s over the peak, as a fraction (0.4 means 40%).

    Args:
        flops_per_batch: FLOPs of one training step (forward and backward), e.g. ``count_step_flops().total``.
        step_s: seconds one step takes.
        peak: the device's peak FLOP/s, e.g. from ``peak_flops``.

    Returns:
        The fraction, or ``None`` if any input is missing or not positive (an uncounted step, an unknown peak).

    Example::

        >>> mfu(flops_per_batch=4e12, step_s=0.01, peak=1e15)
        0.4
    """
    if peak is None or peak <= 0 or step_s <= 0 or flops_per_batch <= 0:
        return None
    return flops_per_batch / step_s / peak


@dataclass
class StepFlops:
    """FLOPs counted by ``count_step_flops``; read them after the ``with`` block.

    Attributes:
        total: FLOPs of everything that ran inside the block, forward and backward.
        uncounted: names of ops whose FLOP formula failed and that counted as zero.

    Example::

        >>> StepFlops(total=6).total
        6
    """

    total: int = 0
    uncounted: set[str] = field(default_factory=set)


@contextmanager
def count_step_flops() -> Iterator[StepFlops]:
    r"""Count the FLOPs of the eager code run inside the block, including its backward pass.

    Built on ``torch.utils.flop_counter.FlopCounterMode``: matmuls, convolutions and attention are counted from
    their shapes, other ops count as zero. An op whose formula fails (an odd shape, a new overload) counts as
    zero and is listed in ``uncounted`` instead of breaking the step. Wrap an eager (uncompiled) step: compiled
    code may be counted in part or not at all.

    Yields:
        A ``StepFlops`` whose ``total`` is filled when the block exits.

    Example::

        >>> layer, x = torch.nn.Linear(8, 4), torch.randn(2, 8, requires_grad=True)
        >>> with count_step_flops() as flops:
        ...     layer(x).sum().backward()
        >>> flops.total  # 2*B*in*out forward, twice that backward (gradients of x and of the weight)
        384
    """
    result = StepFlops()
    counter = FlopCounterMode(display=False)
    compat.count_flops_as_a_total(counter, _TotalOnly(), lambda op, formula: _tolerant(op, formula, result.uncounted))
    with counter:
        yield result
    result.total = counter.get_total_flops()
    if result.uncounted:
        log.info(f"FLOPs of {sorted(result.uncounted)} could not be counted and were taken as 0.")


class _TotalOnly:
    """Stands in for ``FlopCounterMode``'s module tracker, which a total does not need: every FLOP counts towards
    ``Global`` alone. Torch's tracker hooks each module's inputs for the backward, and those hooks make
    ``torch.autograd.grad`` over a module's leaf input raise ("A leaf node was passed to
    _will_engine_execute_node", pytorch#131753): a gradient penalty in the user's training step would fail in a
    counted step.

    Example::

        >>> _TotalOnly().parents
        ('Global',)
    """

    parents = ("Global",)

    def __enter__(self) -> None:  # what FlopCounterMode enters and leaves around the count
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _tolerant(op: Any, formula: Callable[..., int], uncounted: set[str]) -> Callable[..., int]:
    """Wrap a FLOP formula so that an error in it counts the op as zero and records its name."""

    def count(*args: Any, **kwargs: Any) -> int:
        try:
            return formula(*args, **kwargs)
        except Exception:
            uncounted.add(str(op))
            return 0

    return count


def nvml_index(device: torch.device) -> int:
    """NVML numbers GPUs physically; CUDA_VISIBLE_DEVICES renumbers them for torch."""
    try:
        return compat.nvml_device_index(device.index or 0)
    except Exception:  # noqa: BLE001 - NVML itself failed to answer: torch's numbering
        return device.index or 0


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matmuls run in under a Lightning ``precision`` setting (for the peak FLOPs of MFU)."""
    if "bf16" in precision:
        return torch.bfloat16
    if "16" in precision:
        return torch.float16
    return torch.float32
