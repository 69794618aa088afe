"""Reliability of FuseCallback: bad input fails early and clearly, injected faults never cost the run.

Every fit here uses the ``aot_eager`` backend (or a wrapper of it); the only real inductor compile is the tiny
one in ``tests.faults.valid_artifacts`` that produces a genuine compile-cache file.
"""

from __future__ import annotations

import math
import os
import signal
import stat
import time
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader

from lightning_fuse import FuseCallback, compat, gpu
from lightning_fuse.callback import arguments
from lightning_fuse.meters import GpuMeters
from lightning_fuse.options import COMPILED_FROM_THE_START
from tests.fake_nvml import FakeNvml
from tests.faults import (
    BLOCKS,
    FuseProbe,
    artifacts_path,
    messages,
    raised_by_lightning_fuse,
    scalar_steps,
    valid_artifacts,
)
from tests.toy import Net, RecordingTask, trainer


def fit(task, callbacks, **kwargs):
    t = trainer(callbacks, **kwargs)
    t.fit(task)
    return t


def assert_failed_before_any_step(task, excinfo) -> None:
    """The error is ours, no training step ran, and the model is left uncompiled."""
    assert raised_by_lightning_fuse(excinfo)
    assert task.losses == []
    assert all(m._compiled_call_impl is None for m in task.modules())


def seeded_task(cls: type[RecordingTask] = RecordingTask, seed: int = 0, **kwargs) -> RecordingTask:
    torch.manual_seed(seed)  # the same initial weights for the runs a test compares
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------- bad input
# (arguments, exception, what the message must say: the argument and the fix or the allowed values)
BAD_ARGUMENTS = [
    ({"targets": 3}, TypeError, r"`targets` must be a string, a class, or a list of those, got int"),
    ({"targets": ["model.blocks.*", 1.5]}, TypeError, r"`targets` items must be .*Example: targets="),
    ({"targets": int}, TypeError, r"`targets` class int is not a torch.nn.Module subclass"),
    ({"targets": ""}, ValueError, r"`targets` contains an empty pattern; remove it or name a module"),
    ({"exclude": 3}, TypeError, r"`exclude` must be a string, a class, or a list"),
    ({"exclude": [None]}, TypeError, r"`exclude` items must be dotted-name globs, class names or classes"),
    ({"mode": "fastest"}, ValueError, r"`mode` must be one of auto, default, reduce-overhead, .*got 'fastest'"),
    ({"mode": 1}, ValueError, r"`mode` must be one of .*got 1"),
    ({"backend": 3}, TypeError, r"`backend` must be a backend name or a callable, got int"),
    ({"backend": " "}, ValueError, r"`backend` is an empty string; use 'inductor' \(default\)"),
    ({"backend": "indcutor"}, ValueError, r"`backend` 'indcutor' is not a torch.compile backend. Did you mean "
                                          r"'inductor'\?"),
    ({"fullgraph": "yes"}, TypeError, r"`fullgraph` must be True or False, got str"),
    ({"dynamic": "yes"}, TypeError, r"`dynamic` must be None, True or False, got str"),
    ({"dynamic": 1}, TypeError, r"`dynamic` must be None, True or False, got int"),
    ({"options": ["max_autotune"]}, TypeError, r"`options` must be a dict of inductor options or None, got list"),
    ({"options": {"max_autotun": True}}, ValueError, r"`options` key 'max_autotun' is not an inductor option. Did "
                                                     r"you mean 'max_autotune'"),
    ({"options": {"triton.cudagraphs": "yes"}}, TypeError, r"`options\['triton.cudagraphs'\]` must be bool, got str"),
    ({"cuda_graph": "yes"}, ValueError, r"`cuda_graph` must be one of auto, True, False, got 'yes'"),
    ({"cuda_graph": 1}, ValueError, r"`cuda_graph` must be one of auto, True, False, got 1"),
    ({"dynamic_dims": [0]}, TypeError, r"`dynamic_dims` must be \"auto\", None or a mapping like"),
    ({"dynamic_dims": "always"}, TypeError, r"`dynamic_dims` must be \"auto\", None or a mapping"),
    ({"dynamic_dims": {"x": "0"}}, TypeError, r"`dynamic_dims\['x'\]` must be a list of ints"),
    ({"dynamic_dims": {1.5: [0]}}, TypeError, r"`dynamic_dims` keys must be str or int batch keys"),
    ({"verify": "no"}, TypeError, r"`verify` must be True or False, got str"),
    ({"cache_dir": 3}, TypeError, r"`cache_dir` must be a path, None \(default location\) or False, got 3"),
    ({"recompile_limit": 0}, ValueError, r"`recompile_limit` must be >= 1, got 0"),
    ({"recompile_limit": "8"}, TypeError, r"`recompile_limit` must be an int, got str"),
    ({"recompile_limit": 2.5}, TypeError, r"`recompile_limit` must be an int, got float"),
    ({"on_recompile_limit": "crash"}, ValueError, r"`on_recompile_limit` must be one of eager, dynamic, got 'crash'"),
    ({"warmup_steps": -1}, ValueError, r"`warmup_steps` must be >= 0, got -1"),
    ({"warmup_steps": 1.5}, TypeError, r"`warmup_steps` must be an int, got float"),
    ({"eager_steps": -1}, ValueError, r"`eager_steps` must be >= 0, got -1"),
    ({"eager_steps": "8"}, TypeError, r"`eager_steps` must be an int, got str"),
    ({"gpu_sample_hz": -1}, ValueError, r"`gpu_sample_hz` must be in \[0, 1000\] \(0 disables sampling\), got -1"),
    ({"gpu_sample_hz": "10"}, TypeError, r"`gpu_sample_hz` must be a number \(samples per second\)"),
    ({"gpu_sample_hz": True}, TypeError, r"`gpu_sample_hz` must be a number"),
    ({"profile_steps": -1}, ValueError, r"`profile_steps` must be >= 0, got -1"),
    ({"profile_steps": "1"}, TypeError, r"`profile_steps` must be an int, got str"),
    ({"length_fn": 3}, TypeError, r"`length_fn` must be a callable batch -> number of items"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_ARGUMENTS, ids=[repr(a) for a, _, _ in BAD_ARGUMENTS])
def test_each_bad_argument_fails_at_construction_naming_it(kwargs, error, match):
    with pytest.raises(error, match=match) as excinfo:
        FuseCallback(**kwargs)
    assert type(excinfo.value) is error  # not a subclass from deep inside torch (InvalidBackend is a RuntimeError)
    assert raised_by_lightning_fuse(excinfo), excinfo.traceback[-1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cuda_graph": True, "mode": "reduce-overhead"}, r"`cuda_graph=True` and `mode='reduce-overhead'` both "
                                                          r"capture CUDA graphs.*cuda_graph=False"),
        ({"cuda_graph": True, "mode": "max-autotune"}, r"`cuda_graph=True` and `mode='max-autotune'`"),
        ({"cuda_graph": True, "dynamic_dims": {"x": [0]}}, r"`cuda_graph=True` needs static shapes but "
                                                           r"`dynamic_dims` declares varying dims. Use one"),
        ({"mode": "max-autotune", "options": {"a": 1}, "backend": "aot_eager"}, r"`mode='max-autotune'` and "
                                                                              r"`options` combine only with backend"),
    ],
    ids=["cuda_graph+reduce-overhead", "cuda_graph+max-autotune", "cuda_graph+dynamic_dims", "mode+options"],
)
def test_conflicting_options_fail_at_construction_naming_both(kwargs, match):
    with pytest.raises(ValueError, match=match) as excinfo:
        FuseCallback(**kwargs)
    assert raised_by_lightning_fuse(excinfo)


def test_cache_dir_that_is_a_file_fails_at_construction(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    for path in (blocker, blocker / "below"):
        with pytest.raises(ValueError, match=r"`cache_dir` must be a directory, but .*a_file is a file. Pass another "
                                             r"path or False") as excinfo:
            FuseCallback(cache_dir=path)
        assert raised_by_lightning_fuse(excinfo)


def test_cache_dir_that_is_not_writable_fails_at_construction(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: a read-only mode does not stop writes")
        for path in (locked, locked / "cache"):
            with pytest.raises(ValueError, match=r"`cache_dir` directory .*locked is not writable.*`cache_dir=False`"):
                FuseCallback(cache_dir=path)
    finally:
        locked.chmod(stat.S_IRWXU)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"targets": "model.blokcs.*"}, r"`targets` entry 'model.blokcs.\*' matches no submodule.*Close names: "
                                        r"model.blocks"),
        ({"targets": nn.Conv2d}, r"`targets` entry 'Conv2d' matches no submodule"),
        ({"exclude": "model.tail"}, r"`exclude` entry 'model.tail' matches no submodule"),
    ],
    ids=["glob", "class", "exclude"],
)
def test_a_pattern_matching_nothing_fails_at_fit_start_before_any_step(kwargs, match):
    task = RecordingTask()
    with pytest.raises(ValueError, match=match) as excinfo:
        fit(task, [FuseCallback(backend="aot_eager", mode="default", cache_dir=False, **kwargs)])
    assert_failed_before_any_step(task, excinfo)  # at fit start, before the sanity-check validation too


@pytest.mark.parametrize(
    ("dims", "match"),
    [
        ({"x": [0]}, r"`dynamic_dims` names key 'x', but the batch \(list\) has keys \[0, 1\]. Use one of those"),
        ({5: [0]}, r"`dynamic_dims` names key 5"),
        ({0: [2]}, r"`dynamic_dims\[0\]` names dim 2, but that batch entry has shape \(16, 8\) \(2 dims\). Use a dim "
                   r"in \[0, 1\]"),
    ],
    ids=["missing-key", "missing-index", "dim-out-of-range"],
)
def test_dynamic_dims_that_do_not_fit_the_batch_fail_at_the_first_batch(dims, match):
    task = RecordingTask()
    with pytest.raises(ValueError, match=match) as excinfo:
        fit(task, [FuseCallback(backend="aot_eager", cache_dir=False, dynamic_dims=dims)], num_sanity_val_steps=0)
    assert_failed_before_any_step(task, excinfo)


@pytest.mark.parametrize(
    ("length_fn", "match"),
    [
        (lambda batch: batch[0].sum(dim=1), r"`length_fn` must return the number of items in a batch .*got a tensor "
                                            r"of shape \(16,\)"),
        (lambda batch: None, r"`length_fn` must return the number of items in a batch .*got NoneType: None"),
    ],
    ids=["per-row-tensor", "none"],
)
def test_a_length_fn_that_returns_no_number_fails_at_the_first_batch(length_fn, match):
    task = RecordingTask()
    with pytest.raises(TypeError, match=match) as excinfo:
        fit(task, [FuseCallback(backend="aot_eager", cache_dir=False, length_fn=length_fn)], num_sanity_val_steps=0)
    assert_failed_before_any_step(task, excinfo)


# ---------------------------------------------------------------------------------------------- faults
def fails_without_layer_norm(gm: torch.fx.GraphModule, example_inputs):
    """aot_eager, except for graphs without a layer norm: of the toy's regions, only the head's."""
    if not any("layer_norm" in str(node.target) for node in gm.graph.nodes):
        raise RuntimeError("injected backend failure for the head")
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def test_a_backend_failing_for_one_region_costs_only_that_region(recwarn):
    eager = seeded_task()
    fit(eager, [])
    fused = seeded_task()
    fuse = FuseCallback(targets=["model.blocks.*", "model.head"], backend=fails_without_layer_norm, cache_dir=False,
                        eager_steps=0)
    probe = FuseProbe(fuse)
    fit(fused, [fuse, probe])
    fallbacks = messages(recwarn, "falls back to eager")
    assert len(fallbacks) == 1, fallbacks
    assert "region 'model.head'" in fallbacks[0] and "injected backend failure for the head" in fallbacks[0]
    assert probe.compiled_per_step[-1] == BLOCKS  # the blocks stayed compiled to the last step
    assert fuse.tracker.stats("model.blocks.0").compiles >= 1
    assert len(fused.losses) == len(eager.losses) == 10
    torch.testing.assert_close(fused.losses, eager.losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("failure", "raised"),
    [(RuntimeError("injected failure at step 7"), RuntimeError), (KeyboardInterrupt(), SystemExit)],
    ids=["exception", "keyboard-interrupt"],
)
def test_a_fit_interrupted_mid_epoch_leaves_the_model_eager_the_logs_readable_and_the_cache_intact(
    tmp_path, failure, raised
):
    cache_root = tmp_path / "cache"
    artifacts = artifacts_path(cache_root, mode="default")
    artifacts.write_bytes(valid_artifacts())
    inductor_dir, recompile_limit = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), torch._dynamo.config.recompile_limit
    task = seeded_task(fail_at=7, fail_with=failure)  # 5 steps an epoch: fails in the middle of the second
    fuse = FuseCallback(backend="aot_eager", mode="default", cache_dir=cache_root, eager_steps=0)  # compiled at once
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    sigint = signal.getsignal(signal.SIGINT)  # Lightning ignores SIGINT after a KeyboardInterrupt
    try:
        with pytest.raises(raised), warnings.catch_warnings(record=True) as failing:
            warnings.simplefilter("always")
            fit(task, [fuse], max_epochs=3, logger=logger)
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert len(task.losses) == 7
    assert not messages(failing, "where the network ran eagerly"), "the step that raised ran compiled"
    assert fuse.cache.loaded  # the run did read the cache before failing

    # the model is eager and usable, and torch's settings are back
    assert all(m._compiled_call_impl is None for m in task.modules())
    assert fuse.compiled_regions == []
    assert torch._dynamo.config.recompile_limit == recompile_limit
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == inductor_dir
    torch._dynamo.reset()
    x, y = next(iter(task.train_dataloader()))
    before = torch._dynamo.utils.counters["frames"]["total"]
    nn.functional.cross_entropy(task.model(x), y).backward()
    assert torch._dynamo.utils.counters["frames"]["total"] == before  # nothing was compiled
    assert all(p.grad is not None for p in task.parameters())

    # the first epoch's fuse/* scalars reached the event file
    assert scalar_steps(tmp_path / "tb", "fuse/compile_s") == [0]
    assert scalar_steps(tmp_path / "tb", "fuse/step_ms") == [0]

    # the cache is as it was, and the next run loads it without a warning
    assert artifacts.read_bytes() == valid_artifacts()
    assert not [p.name for p in cache_root.rglob("*") if ".tmp" in p.name]
    following = FuseCallback(backend="aot_eager", mode="default", cache_dir=cache_root)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(seeded_task(), [following], max_steps=2, limit_val_batches=0)
    assert following.cache.loaded
    assert not messages(record, "compile cache"), messages(record, "compile cache")


class CompiledOnlyNet(Net):
    """Raises where it runs eagerly after its first ``eager_calls`` eager calls, and runs compiled: as a kernel's
    size limit or eager's memory can (HF SegFormer at 64 images of 512 px on an H200: eager's bilinear upsampling
    takes at most INT_MAX elements, and ``reduce-overhead`` ran it)."""

    def __init__(self, eager_calls: int = 0, message: str = "injected: too large for the eager kernel") -> None:
        super().__init__()
        self.eager_calls, self.message = eager_calls, message

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            if self.eager_calls == 0:
                raise RuntimeError(self.message)
            self.eager_calls -= 1
        return super().forward(x)


@pytest.mark.parametrize(
    ("eager_calls", "fuse_kwargs", "trainer_kwargs", "where"),
    [(0, {}, {}, "in the sanity check"),
     (0, {}, {"num_sanity_val_steps": 0}, "at step 0, one of the first 3"),
     (3, {"mode": "default", "targets": "full", "verify": False}, {"num_sanity_val_steps": 0}, "an eager reference")],
    ids=["sanity-check", "first-steps", "reference-step"],
)  # fmt: skip
def test_a_model_that_runs_only_compiled_is_told_how_to_train_and_trains_so(recwarn, eager_calls, fuse_kwargs,
                                                                             trainer_kwargs, where):  # fmt: skip
    task = seeded_task(samples=640)  # 40 steps an epoch: room for eager reference steps
    task.model = CompiledOnlyNet(eager_calls)
    with pytest.raises(RuntimeError, match="too large for the eager kernel"):
        fit(task, [FuseCallback(backend="aot_eager", cache_dir=False, **fuse_kwargs)], **trainer_kwargs)
    hints = messages(recwarn, "where the network ran eagerly")
    assert len(hints) == 1 and where in hints[0] and f"FuseCallback({arguments(COMPILED_FROM_THE_START)})" in hints[0]

    advised = {**COMPILED_FROM_THE_START, "mode": "default"}  # reduce-overhead needs a GPU
    task = seeded_task(samples=640)
    task.model = CompiledOnlyNet()
    fit(task, [FuseCallback(backend="aot_eager", cache_dir=False, **advised)], num_sanity_val_steps=0)
    assert len(task.losses) == 80 and all(map(math.isfinite, task.losses))


class RescueProbe(Callback):
    """The rescue's ``torch.compile`` arguments, the compile time counted and whether a plan ran, when the rescue
    was first seen to have run."""

    def __init__(self, fuse: FuseCallback) -> None:
        self.fuse, self.compile_kwargs, self.rescue_s, self.under_plan = fuse, None, None, None

    def on_train_batch_start(self, *_) -> None:
        fit = self.fuse.fit
        if self.compile_kwargs is None and fit.hooks.rescue is not None and fit.hooks.rescue.reason is not None:
            self.compile_kwargs, self.rescue_s = fit.hooks.rescue.compile_kwargs, fit.tracker.total_s
            self.under_plan = fit.plan is not None


@pytest.mark.parametrize(
    ("eager_calls", "fuse_kwargs", "sanity_steps"),
    [(0, {}, 1), (0, {}, 0), (3, {"mode": "default", "targets": "full", "verify": False}, 0)],
    ids=["in-the-sanity-check", "at-the-first-step", "in-a-reference-step"],
)  # fmt: skip
def test_a_call_eager_refuses_for_its_size_runs_compiled_and_the_fit_trains_on_compiled(recwarn, eager_calls,
                                                                                        fuse_kwargs, sanity_steps):
    task = seeded_task(samples=640)  # 40 steps an epoch: room for eager reference steps
    task.model = CompiledOnlyNet(eager_calls, message="upsample_bilinear2d_nhwc only supports output tensors with "
                                                      "less than INT_MAX elements")  # fmt: skip
    fuse = FuseCallback(backend="aot_eager", cache_dir=False, **fuse_kwargs)
    probe = RescueProbe(fuse)
    fit(task, [probe, fuse], num_sanity_val_steps=sanity_steps)  # the probe's hook first: it sees the rescue
    assert len(task.losses) == 80 and all(map(math.isfinite, task.losses))
    assert probe.compile_kwargs["mode"] == COMPILED_FROM_THE_START["mode"], "as the plan it hands over to compiles"
    assert probe.compile_kwargs["backend"] == "aot_eager"
    assert 0 < probe.rescue_s <= fuse.tracker.total_s, "the fit's compile time counts the rescue's"
    assert probe.under_plan == (eager_calls > 0), "the reference step's refusal came after the plan's activation"
    rescued = messages(recwarn, "eager refused a call of the network for its size")
    assert len(rescued) == 1 and "INT_MAX" in rescued[0] and arguments(COMPILED_FROM_THE_START) in rescued[0]
    assert not messages(recwarn, "where the network ran eagerly")
    assert fuse.options.eager_steps == 0 and fuse.plan is not None and fuse.plan.modules()  # compiled to the end
    assert compat.compiled_call_impl(task.model) is None  # and plain again after the fit
    assert "not measured (eager refused a call of the network for its size; the fit ran compiled" in fuse.verdict


@pytest.mark.parametrize("damage", ["truncated", "foreign"])
def test_a_damaged_cache_artifact_means_one_warning_and_a_cold_compile(tmp_path, damage):
    cache_root = tmp_path / "cache"
    artifacts = artifacts_path(cache_root, mode="default")
    good = valid_artifacts()
    artifacts.write_bytes(good[: len(good) // 2] if damage == "truncated" else os.urandom(len(good)))
    torch._dynamo.reset()
    task = seeded_task()
    fuse = FuseCallback(backend="aot_eager", mode="default", cache_dir=cache_root, eager_steps=0)
    probe = FuseProbe(fuse)
    with pytest.warns(UserWarning) as record:
        fit(task, [fuse, probe])
    ignored = messages(record, "ignoring the compile cache artifacts")
    assert len(ignored) == 1, ignored
    assert str(artifacts) in ignored[0] and "compiling cold" in ignored[0]
    assert not fuse.cache.loaded
    assert fuse.tracker.stats("model.blocks.0").compiles >= 1  # compiled from scratch ...
    assert probe.compiled_per_step[-1] == BLOCKS  # ... and ran compiled
    assert len(task.losses) == 10 and all(math.isfinite(loss) for loss in task.losses)


class VaryingBatches(RecordingTask):
    """Batches of 2, 3, ..., 9 rows: every training step brings a new batch size."""

    def train_dataloader(self) -> DataLoader:
        dataset = super().train_dataloader().dataset
        starts = [sum(range(2, size)) for size in range(2, 10)]
        return DataLoader(dataset, batch_sampler=[list(range(s, s + n)) for s, n in zip(starts, range(2, 10))])


@pytest.mark.parametrize("action", ["eager", "dynamic"])
def test_a_recompile_storm_is_bounded_within_a_fit(action):
    def run(callbacks) -> VaryingBatches:
        task = seeded_task(VaryingBatches)
        fit(task, callbacks, max_epochs=2, limit_val_batches=0, num_sanity_val_steps=0)
        return task

    reference = run([])
    # eager_steps=0: every step runs compiled, so the first epoch meets every size and the second one none new
    fuse = FuseCallback(backend="aot_eager", mode="default", cache_dir=False, dynamic_dims=None, eager_steps=0,
                        recompile_limit=2, on_recompile_limit=action)  # fmt: skip
    probe = FuseProbe(fuse)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False), pytest.warns(UserWarning) as record:
        task = run([fuse, probe])  # without automatic dynamic shapes, each new batch size recompiles
    stats = {name: fuse.tracker.stats(name) for name in BLOCKS}
    for name, region in stats.items():
        # eager: the limit, plus the recompile that crossed it; dynamic: the same, plus the one dynamic compile
        assert region.recompiles <= 2 + 1 + (action == "dynamic"), stats
    assert sum(region.recompiles for region in stats.values()) >= 3, "the storm did happen"
    first_epoch, second_epoch = probe.compiles_per_epoch
    assert second_epoch == first_epoch, f"the same sizes again must not compile: {stats}"
    if action == "eager":
        assert messages(record, "recompile_limit=2")
        assert any(runner.closed_reason for runner in fuse.plan.runners)  # new sizes ran eagerly there
    else:
        assert messages(record, "compiling it with dynamic=True")
        assert probe.compiled_per_step[-1] == BLOCKS
    assert len(task.losses) == 16
    torch.testing.assert_close(task.losses, reference.losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nvml", ["missing", "failing"])
def test_nvml_missing_or_failing_mid_run_stops_gpu_metrics_with_at_most_one_warning(monkeypatch, nvml):
    fake = FakeNvml(available=nvml != "missing")

    def start_with_fake_nvml(self, device, precision, flops_per_batch, sample_hz, profile_steps):
        # the CUDA-only part of GpuMeters.start, with the fake NVML in place of pynvml
        self.sampler = gpu.GpuSampler(0, hz=200, nvml=fake)
        if not self.sampler.start():
            self.sampler = None

    class LoseTheGpu(Callback):
        """At the start of the second epoch every NVML query starts failing; waits until the sampler noticed."""

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1 and nvml == "failing":
                fake.fail_after = fake.queries
                deadline = time.monotonic() + 5.0
                while fake.queries <= fake.fail_after and time.monotonic() < deadline:
                    time.sleep(0.005)
                time.sleep(0.05)  # the sampler thread records the error and ends

    monkeypatch.setattr(GpuMeters, "start", start_with_fake_nvml)
    task = RecordingTask()
    fuse = FuseCallback(backend="aot_eager", mode="default", cache_dir=False, eager_steps=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(task, [fuse, LoseTheGpu()], max_epochs=3)
    stopped = messages(record, "GPU sampling stopped")
    assert len(task.losses) == 15 and len(fuse.history) == 3
    assert "fuse/gpu_util" not in fuse.history[2]
    if nvml == "missing":
        assert stopped == []
        assert not any("fuse/gpu_util" in row for row in fuse.history)
    else:
        assert len(stopped) == 1 and "GPU is lost" in stopped[0], stopped
        assert "fuse/gpu_util" in fuse.history[0]  # sampled normally before the failure
    assert fake.init_depth == 0  # NVML shut down at teardown either way
