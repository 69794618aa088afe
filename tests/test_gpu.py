"""Tests for lightning_fuse.gpu: the NVML sampler (against tests/fake_nvml.py), peak FLOPs, MFU and FLOP counting."""

from __future__ import annotations

import logging
import time
import warnings
from statistics import mean

import pytest
import torch
from torch.utils import flop_counter

from lightning_fuse import gpu
from lightning_fuse.gpu import GpuSampler, count_step_flops, mfu, peak_flops
from tests.fake_nvml import FakeNvml


def _run_until(sampler: GpuSampler, fake: FakeNvml, samples: int, timeout_s: float = 5.0) -> None:
    """Let the sampler's thread take at least ``samples`` samples (or stop on its own), then stop it."""
    deadline = time.monotonic() + timeout_s
    while fake.calls["nvmlDeviceGetUtilizationRates"] < samples and time.monotonic() < deadline:
        time.sleep(0.005)
    sampler.stop()


def test_sampler_aggregates_means_and_maxima() -> None:
    fake = FakeNvml()
    sampler = GpuSampler(hz=500, nvml=fake)
    assert sampler.start()
    _run_until(sampler, fake, samples=6)

    stats = sampler.read_and_reset()
    assert set(stats) == {"gpu_util", "gpu_util_max", "gpu_mem_gb", "sm_clock_mhz"}
    assert len(fake.history["gpu_util"]) >= 6
    assert stats["gpu_util"] == pytest.approx(mean(fake.history["gpu_util"]))
    assert stats["gpu_util_max"] == max(fake.history["gpu_util"])
    assert stats["gpu_mem_gb"] == pytest.approx(max(fake.history["gpu_mem_gb"]))
    assert stats["sm_clock_mhz"] == pytest.approx(mean(fake.history["sm_clock_mhz"]))
    assert sampler.read_and_reset() == {}, "a window with no samples has no keys"
    assert fake.init_depth == 0, "stop() shuts NVML down"


def test_gpm_metrics_only_where_supported() -> None:
    fake = FakeNvml(gpm=True)
    sampler = GpuSampler(hz=500, nvml=fake)
    assert sampler.start()
    _run_until(sampler, fake, samples=5)

    stats = sampler.read_and_reset()
    assert stats["sm_active"] == pytest.approx(mean(fake.history["sm_active"]))
    assert stats["tensor_active"] == pytest.approx(mean(fake.history["tensor_active"]))
    # The first GPM sample is only a baseline: one metrics read fewer than samples.
    assert fake.calls["nvmlGpmMetricsGet"] == fake.calls["nvmlGpmSampleGet"] - 1
    assert not fake.live_samples, "stop() frees both GPM samples"


def test_gpm_metric_not_supported_is_absent() -> None:
    fake = FakeNvml(gpm=True, tensor_metric=False)
    sampler = GpuSampler(hz=500, nvml=fake)
    assert sampler.start()
    _run_until(sampler, fake, samples=3)
    stats = sampler.read_and_reset()
    assert "sm_active" in stats
    assert "tensor_active" not in stats


def test_no_gpm_keys_without_gpm() -> None:
    fake = FakeNvml(gpm=False)
    sampler = GpuSampler(hz=500, nvml=fake)
    assert sampler.start()
    _run_until(sampler, fake, samples=3)
    assert not {"sm_active", "tensor_active"} & set(sampler.read_and_reset())
    assert fake.calls["nvmlGpmSampleAlloc"] == 0


@pytest.mark.parametrize(
    ("fake", "device_index"),
    [(FakeNvml(available=False), 0), (FakeNvml(gpu_count=1), 3)],
    ids=["no-driver", "no-such-gpu"],
)
def test_start_false_when_nvml_or_gpu_unavailable(
    fake: FakeNvml, device_index: int, caplog: pytest.LogCaptureFixture
) -> None:
    sampler = GpuSampler(device_index=device_index, nvml=fake)
    with caplog.at_level(logging.INFO, logger="lightning_fuse.gpu"), warnings.catch_warnings():
        warnings.simplefilter("error")  # an unavailable GPU is normal: info, not a warning
        assert sampler.start() is False
    assert len([r for r in caplog.records if r.levelno == logging.INFO]) == 1
    assert "GPU sampling is off" in caplog.text
    assert sampler.read_and_reset() == {}
    sampler.stop()
    assert fake.init_depth == 0


def test_start_false_without_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pynvml(name: str) -> None:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(gpu.importlib, "import_module", no_pynvml)
    assert GpuSampler().start() is False


def test_failure_mid_run_stops_and_warns_once() -> None:
    fake = FakeNvml(gpm=True, fail_after=12)
    sampler = GpuSampler(hz=500, nvml=fake)
    assert sampler.start()
    deadline = time.monotonic() + 5.0
    while fake.queries <= fake.fail_after and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)  # several periods: a live thread would query again
    calls_after_failure = sum(fake.calls.values())
    time.sleep(0.05)
    assert sum(fake.calls.values()) == calls_after_failure, "the thread stopped querying"

    with pytest.warns(UserWarning, match="GPU sampling stopped.*GPU is lost") as record:
        stats = sampler.read_and_reset()
    assert len(record) == 1
    assert stats["gpu_util"] > 0, "samples taken before the failure are kept"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert sampler.read_and_reset() == {}
        sampler.stop()
        sampler.stop()
    assert not fake.live_samples
    assert fake.init_depth == 0


def test_start_again_after_failure() -> None:
    fake = FakeNvml(fail_after=4)  # start()'s first sample takes 3 queries; the thread's first sample fails
    sampler = GpuSampler(hz=500, nvml=fake)
    assert sampler.start()
    deadline = time.monotonic() + 5.0
    while fake.queries <= fake.fail_after and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)  # let the failed thread return
    fake.fail_after = None
    with pytest.warns(UserWarning, match="GPU sampling stopped"):
        assert sampler.start(), "a sampler whose thread died starts afresh"
    _run_until(sampler, fake, samples=fake.calls["nvmlDeviceGetUtilizationRates"] + 2)
    assert fake.init_depth == 0


@pytest.mark.parametrize(("kwargs", "match"), [({"hz": 0}, "`hz` must be > 0"), ({"device_index": -1}, "device")])
def test_sampler_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GpuSampler(**kwargs)


@pytest.mark.parametrize(
    ("name", "dtype", "expected"),
    [
        ("NVIDIA H200", torch.bfloat16, 989.4e12),
        ("NVIDIA H200", torch.float16, 989.4e12),
        ("NVIDIA H200 NVL", torch.bfloat16, 835.5e12),
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4e12),
    ],
)
def test_peak_flops_table(monkeypatch: pytest.MonkeyPatch, name: str, dtype: torch.dtype, expected: float) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), dtype) == expected


def test_peak_flops_fp32_follows_matmul_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert peak_flops(torch.device("cuda"), torch.float32) == 494.7e12
        torch.set_float32_matmul_precision("highest")
        assert peak_flops(torch.device("cuda"), torch.float32) == 66.9e12
    finally:
        torch.set_float32_matmul_precision(previous)


def test_peak_flops_none_on_cpu() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert peak_flops(torch.device("cpu"), torch.bfloat16) is None


def test_peak_flops_unknown_gpu_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU 9000 (test)")
    with pytest.warns(UserWarning, match="No peak FLOP/s known for 'Fake GPU 9000") as record:
        assert peak_flops(torch.device("cuda"), torch.bfloat16) is None
        assert peak_flops(torch.device("cuda"), torch.bfloat16) is None
    assert len(record) == 1, [str(r.message) for r in record]


def test_mfu_arithmetic() -> None:
    assert mfu(4e12, 0.01, 1e15) == pytest.approx(0.4)
    assert mfu(989.4e12, 1.0, 989.4e12) == pytest.approx(1.0)
    assert mfu(4e12, 0.01, None) is None
    assert mfu(0, 0.01, 1e15) is None, "an uncounted step has no MFU"
    assert mfu(4e12, 0.0, 1e15) is None


def test_count_step_flops_linear_forward_and_backward() -> None:
    batch, fan_in, fan_out = 16, 32, 8
    layer = torch.nn.Linear(fan_in, fan_out)
    x = torch.randn(batch, fan_in, requires_grad=True)
    with count_step_flops() as flops:
        layer(x).sum().backward()
    # forward 2*B*in*out; backward twice that (gradient of the input and of the weight)
    assert flops.total == 6 * batch * fan_in * fan_out
    assert not flops.uncounted

    with count_step_flops() as flops:
        layer(x.detach()).sum().backward()  # no input gradient: forward + weight gradient only
    assert flops.total == 4 * batch * fan_in * fan_out


def test_a_counted_step_may_take_gradients_of_a_modules_leaf_input() -> None:
    """A gradient penalty (WGAN-GP, R1) in the user's training step: ``torch.autograd.grad`` over the critic's
    input, a leaf. Under torch's own ``FlopCounterMode`` that raises (pytorch#131753); a counted eager step must not."""
    batch, fan_in = 4, 8
    critic = torch.nn.Linear(fan_in, 1)
    real = torch.randn(batch, fan_in, requires_grad=True)
    with count_step_flops() as flops:
        (grad,) = torch.autograd.grad(critic(real).sum(), real, create_graph=True)
        penalty = (grad.norm(dim=1) - 1).pow(2).mean()
        (critic(real).mean() + penalty).backward()
    assert critic.weight.grad is not None and flops.total > 0


def test_count_step_flops_tolerates_a_failing_formula(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> int:
        raise RuntimeError("formula cannot handle this shape")

    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.mm, broken)
    a, b = torch.randn(4, 8), torch.randn(8, 2)
    with count_step_flops() as flops:
        out = a @ b
    assert out.shape == (4, 2)
    assert flops.total == 0
    assert flops.uncounted == {"aten.mm"}
