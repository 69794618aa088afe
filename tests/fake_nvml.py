"""A stand-in for the ``pynvml`` module, with exactly the calls ``lightning_fuse.gpu.GpuSampler`` makes.

Every query returns the next value of a fixed cycle and records it in ``history``, so a test can compare the
sampler's aggregates with what it was actually given, whatever the thread's timing.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable
from types import SimpleNamespace


class FakeNVMLError(Exception):
    """Raised where pynvml would raise ``pynvml.NVMLError``."""


class FakeGpmSample:
    """An opaque GPM sample buffer; ``taken_at`` is the query number of the last ``nvmlGpmSampleGet`` into it."""

    def __init__(self) -> None:
        self.taken_at: int | None = None


class FakeGpmMetricsGet:
    """Mirror of ``pynvml.c_nvmlGpmMetricsGet_t``: the caller fills ids and samples, NVML fills the values."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: FakeGpmSample | None = None
        self.sample2: FakeGpmSample | None = None
        self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=-1, value=0.0) for _ in range(8)]


class FakeNvml:
    """A module-like fake of ``pynvml`` for one or more GPUs.

    Args:
        available: ``False`` makes ``nvmlInit`` fail as on a machine without the NVIDIA driver.
        gpu_count: number of devices ``nvmlDeviceGetHandleByIndex`` accepts.
        gpm: whether ``nvmlGpmQueryDeviceSupport`` reports GPM support (Hopper).
        tensor_metric: ``False`` makes the ANY_TENSOR_UTIL metric come back NOT_SUPPORTED.
        fail_after: after this many queries, every query raises ``FakeNVMLError``.
        util, mem_gb, clock_mhz, sm_util, tensor_util: the cycles of values handed out.
    """

    NVMLError = FakeNVMLError
    NVML_SUCCESS = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_CLOCK_SM = 1
    NVML_GPM_METRICS_GET_VERSION = 1
    NVML_GPM_METRIC_SM_UTIL = 2
    NVML_GPM_METRIC_ANY_TENSOR_UTIL = 5
    c_nvmlGpmMetricsGet_t = FakeGpmMetricsGet

    def __init__(
        self,
        *,
        available: bool = True,
        gpu_count: int = 1,
        gpm: bool = False,
        tensor_metric: bool = True,
        fail_after: int | None = None,
        util: Iterable[float] = (20, 60, 100, 40),
        mem_gb: Iterable[float] = (1.0, 3.5, 2.0),
        clock_mhz: Iterable[float] = (1980, 1755, 1830),
        sm_util: Iterable[float] = (50.0, 70.0, 90.0),
        tensor_util: Iterable[float] = (10.0, 30.0),
    ) -> None:
        self.available, self.gpu_count, self.gpm = available, gpu_count, gpm
        self.tensor_metric, self.fail_after = tensor_metric, fail_after
        self._cycles = {
            "gpu_util": itertools.cycle(util),
            "gpu_mem_gb": itertools.cycle(mem_gb),
            "sm_clock_mhz": itertools.cycle(clock_mhz),
            "sm_active": itertools.cycle(sm_util),
            "tensor_active": itertools.cycle(tensor_util),
        }
        self.history: defaultdict[str, list[float]] = defaultdict(list)  # values handed out, by sampler key
        self.calls: Counter[str] = Counter()  # every call by function name, failed ones included
        self.queries = 0  # calls of the query functions that ``fail_after`` counts
        self.init_depth = 0  # nvmlInit minus nvmlShutdown: 0 once everything is shut down
        self.live_samples: set[int] = set()  # ids of GPM samples allocated and not freed

    # --- lifecycle ---------------------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if not self.available:
            raise FakeNVMLError("Driver Not Loaded")
        self.init_depth += 1

    def nvmlShutdown(self) -> None:
        self.calls["nvmlShutdown"] += 1
        self.init_depth -= 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.calls["nvmlDeviceGetHandleByIndex"] += 1
        if self.init_depth <= 0:
            raise FakeNVMLError("Uninitialized")
        if not 0 <= index < self.gpu_count:
            raise FakeNVMLError("Invalid Argument")
        return f"gpu{index}"

    # --- plain queries -------------------------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: str) -> SimpleNamespace:
        self._query("nvmlDeviceGetUtilizationRates", handle)
        return SimpleNamespace(gpu=int(self._next("gpu_util")), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        self._query("nvmlDeviceGetMemoryInfo", handle)
        used = int(self._next("gpu_mem_gb") * 1e9)
        return SimpleNamespace(total=80_000_000_000, used=used, free=80_000_000_000 - used)

    def nvmlDeviceGetClockInfo(self, handle: str, clock_type: int) -> int:
        self._query("nvmlDeviceGetClockInfo", handle)
        if clock_type != self.NVML_CLOCK_SM:
            raise FakeNVMLError(f"fake NVML only knows NVML_CLOCK_SM, got clock type {clock_type}")
        return int(self._next("sm_clock_mhz"))

    # --- GPM -----------------------------------------------------------------------------------------------------
    def nvmlGpmQueryDeviceSupport(self, handle: str) -> SimpleNamespace:
        self.calls["nvmlGpmQueryDeviceSupport"] += 1
        return SimpleNamespace(version=1, isSupportedDevice=int(self.gpm))

    def nvmlGpmSampleAlloc(self) -> FakeGpmSample:
        self.calls["nvmlGpmSampleAlloc"] += 1
        sample = FakeGpmSample()
        self.live_samples.add(id(sample))
        return sample

    def nvmlGpmSampleFree(self, sample: FakeGpmSample) -> None:
        self.calls["nvmlGpmSampleFree"] += 1
        self.live_samples.discard(id(sample))

    def nvmlGpmSampleGet(self, handle: str, sample: FakeGpmSample) -> FakeGpmSample:
        self._query("nvmlGpmSampleGet", handle)
        sample.taken_at = self.queries
        return sample

    def nvmlGpmMetricsGet(self, request: FakeGpmMetricsGet) -> FakeGpmMetricsGet:
        self.calls["nvmlGpmMetricsGet"] += 1
        self.queries += 1
        self._maybe_fail()
        first, second = request.sample1, request.sample2
        if request.version != self.NVML_GPM_METRICS_GET_VERSION or not 0 < request.numMetrics <= len(request.metrics):
            raise FakeNVMLError(f"bad request: version={request.version}, numMetrics={request.numMetrics}")
        if first is None or second is None or first.taken_at is None or second.taken_at is None:
            raise FakeNVMLError("GPM metrics need two samples taken with nvmlGpmSampleGet")
        if first.taken_at >= second.taken_at:
            raise FakeNVMLError("sample1 must be older than sample2")
        for slot in request.metrics[: request.numMetrics]:
            self._fill(slot)
        return request

    # --- helpers -------------------------------------------------------------------------------------------------
    def _fill(self, slot: SimpleNamespace) -> None:
        keys = {self.NVML_GPM_METRIC_SM_UTIL: "sm_active", self.NVML_GPM_METRIC_ANY_TENSOR_UTIL: "tensor_active"}
        key = keys.get(slot.metricId)
        if key is None or (key == "tensor_active" and not self.tensor_metric):
            slot.nvmlReturn, slot.value = self.NVML_ERROR_NOT_SUPPORTED, 0.0
            return
        slot.nvmlReturn, slot.value = self.NVML_SUCCESS, self._next(key)

    def _query(self, name: str, handle: str) -> None:
        self.calls[name] += 1
        self.queries += 1
        self._maybe_fail()
        if handle not in {f"gpu{i}" for i in range(self.gpu_count)}:
            raise FakeNVMLError(f"Invalid handle {handle!r}")

    def _maybe_fail(self) -> None:
        if self.fail_after is not None and self.queries > self.fail_after:
            raise FakeNVMLError("GPU is lost")

    def _next(self, key: str) -> float:
        value = float(next(self._cycles[key]))
        self.history[key].append(value)
        return value
