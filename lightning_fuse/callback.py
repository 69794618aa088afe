"""FuseCallback: the Lightning hooks that compile, warm up, time and report. The work lives in the other modules."""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from typing_extensions import override

from lightning_fuse import gpu
from lightning_fuse.cache import CompileCache, cache_counters, cache_key
from lightning_fuse.compiler import (
    CompiledRegion,
    CompileOptions,
    RegionPolicy,
    compile_regions,
    plain_eager,
    uncompile_regions,
)
from lightning_fuse.graphs import GraphedModule, graph_target
from lightning_fuse.metrics import count_items, epoch_metrics, per_rank, summary_table
from lightning_fuse.options import FuseOptions
from lightning_fuse.plan import Plan, choose_plan
from lightning_fuse.profiling import ProfileWindow
from lightning_fuse.regions import Region, Target, format_plan, resolve_regions
from lightning_fuse.shapes import CompileTracker, DimSpec, batch_size, can_yield_partial_batch
from lightning_fuse.timing import COMPILED, EAGER, SKIPPED, UNKNOWN_EPOCH_STEPS, EagerSchedule, StepTimer, summarize

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

SLOWER_THAN_EAGER = 0.9
"""With mode="auto", a plan whose measured speedup falls below this is dropped (margin for measurement noise)."""


class FuseCallback(Callback):
    r"""Compile chosen submodules of the LightningModule in place, and log how much faster training got.

    At fit start the callback resolves ``targets`` into regions, compiles each in place (``state_dict`` keys,
    hooks and classes never change), points torch's compile caches at ``cache_dir`` and loads last run's
    artifacts. The first 3 steps of the fit run eagerly, uncompiled; then the regions compile. In every epoch a few
    steps, spread over the epoch, run eagerly again as the reference (``eager_steps``). During training it marks
    varying batch dims dynamic, keeps warmup and compiling steps out of the timing, and at each epoch end logs
    ``fuse/speedup``,
    ``fuse/step_ms`` and friends to every logger of the Trainer, with the epoch as the step. At fit end it prints
    a summary, writes it to TensorBoard and saves the compile cache; at teardown the model is eager again.

    On CUDA, ``fuse/peak_mem_gb`` is per epoch: the callback resets torch's (process-wide) peak-memory statistics
    at each training epoch start.

    Args:
        targets: What to compile: ``"auto"`` (the repeated blocks: children of an ``nn.ModuleList``/``Sequential``
            sharing one class; the whole model where there are none), ``"full"`` (every top-level child of the
            LightningModule), dotted-name globs relative to the LightningModule (``"model.blocks.*"``), class names,
            classes, or a list of those. Overlaps compile the outermost module once.
        exclude: Modules to keep eager, in the same forms; an excluded module inside a target splits the target.
        mode: ``"auto"`` chooses the plan for the device (see :mod:`lightning_fuse.plan`), and drops it for eager
            training if an epoch measures it slower than eager (below 0.9x); otherwise a
            ``torch.compile`` mode: ``"default"``, ``"reduce-overhead"``, ``"max-autotune"``,
            ``"max-autotune-no-cudagraphs"``.
        backend: ``torch.compile`` backend, a name or a callable.
        fullgraph: Passed to ``torch.compile``.
        dynamic: Passed to ``torch.compile``.
        options: Inductor options passed to ``torch.compile`` (not together with an explicit ``mode``).
        cuda_graph: One CUDA graph over the model's forward and backward: ``"auto"`` (on for CUDA with the default
            mode), ``True`` or ``False``. Batches of another shape run without it.
        dynamic_dims: ``"auto"`` marks the batch dim of every batch tensor when the train loader can yield a
            partial last batch; ``None`` marks nothing; or a mapping such as ``{"x": [0]}``, ``{0: [0]}``,
            ``{"input_ids": [0, 1]}``.
        verify: On the first call of each region (per train/eval mode), compare the compiled output with eager; a
            region that disagrees runs eagerly, with a warning showing the mismatch.
        cache_dir: Compile cache root; ``None`` uses ``~/.cache/lightning_fuse``, ``False`` disables persistence.
        recompile_limit: Recompiles a region may make before ``on_recompile_limit`` applies.
        on_recompile_limit: ``"eager"`` (the region runs eagerly) or ``"dynamic"`` (compile it with
            ``dynamic=True`` once, then eager).
        warmup_steps: Compiled steps after the fit's first eager steps kept out of the timing (``None``: 1, or 3
            with a CUDA graph). Steps that compile, and partial batches, are always kept out.
        eager_steps: Timed eager reference steps per epoch, run with the compiled code and the graph bypassed, in
            chunks of up to 5 (each after one untimed eager step) spread evenly over the epoch, at most a third of
            its steps; ``fuse/speedup`` divides their median by the epoch's compiled median. An epoch too short for
            any reuses the last measured reference. Each of these steps, and each chunk's lead-in, takes as long as
            ``speedup`` compiled steps. ``0`` turns the speedup measurement off and compiles at the first step.
        gpu_sample_hz: NVML sampling rate for GPU utilisation; ``0`` disables it.
        profile_steps: Once per fit, after warmup, profile this many compiled and as many eager steps with
            ``torch.profiler`` (CUDA only; never timed) and log ``fuse/kernels_per_step``,
            ``fuse/eager_kernels_per_step`` and ``fuse/gpu_busy_frac``: why the step got faster. ``0``: off.
        length_fn: ``batch -> number of items`` (e.g. tokens) to log ``fuse/items_per_s``.

    Raises:
        ValueError: If ``mode``, ``cuda_graph``, ``on_recompile_limit`` or a number is out of range, or options
            conflict; at fit start, if a target or exclude pattern matches no module; at the first batch, if
            ``dynamic_dims`` names a key or dim the batch lacks.
        TypeError: If an argument has the wrong type.

    Example::

        >>> import lightning.pytorch as pl
        >>> from lightning_fuse import FuseCallback
        >>> trainer = pl.Trainer(callbacks=[FuseCallback(targets="model.blocks.*", exclude="model.head")],
        ...                      logger=False, enable_checkpointing=False, enable_progress_bar=False)
    """

    def __init__(
        self,
        targets: Target | Sequence[Target] = "auto",
        exclude: Target | Sequence[Target] = (),
        mode: str = "auto",
        backend: str | Callable[..., Any] = "inductor",
        fullgraph: bool = False,
        dynamic: bool | None = None,
        options: Mapping[str, Any] | None = None,
        cuda_graph: bool | str = "auto",
        dynamic_dims: str | DimSpec | None = "auto",
        verify: bool = True,
        cache_dir: str | os.PathLike | bool | None = None,
        recompile_limit: int = 8,
        on_recompile_limit: str = "eager",
        warmup_steps: int | None = None,
        eager_steps: int = 20,
        gpu_sample_hz: float = 10.0,
        profile_steps: int = 0,
        length_fn: Callable[[Any], int] | None = None,
    ) -> None:
        self.options = FuseOptions(
            targets=targets, exclude=exclude, mode=mode, backend=backend, fullgraph=fullgraph, dynamic=dynamic,
            options=options, cuda_graph=cuda_graph, dynamic_dims=dynamic_dims, verify=verify, cache_dir=cache_dir,
            recompile_limit=recompile_limit, on_recompile_limit=on_recompile_limit, warmup_steps=warmup_steps,
            eager_steps=eager_steps, gpu_sample_hz=gpu_sample_hz, profile_steps=profile_steps, length_fn=length_fn,
        )  # fmt: skip
        self.tracker = CompileTracker()
        self.history: list[dict[str, float]] = []
        self.plan: Plan | None = None
        self.resumed_plan: str | None = None  # the plan of the checkpoint this fit resumed from, if any
        self.regions: list[Region] = []
        self.runners: list[CompiledRegion] = []
        self.fallbacks: dict[str, str] = {}
        """Regions that ran eagerly after a failure, with the reason (filled as the fit ends)."""
        self.graph: GraphedModule | None = None
        self.cache: CompileCache | None = None
        self._policy = RegionPolicy(verify=verify, recompile_limit=recompile_limit,
                                    on_recompile_limit=on_recompile_limit)  # fmt: skip
        self._schedule = EagerSchedule(eager_steps)
        self._eager_ms: list[float] = []  # the last measured reference, for an epoch too short to have one
        self._short_epoch_said = False
        self._timer: StepTimer | None = None
        self._sampler: gpu.GpuSampler | None = None
        self._fit_steps = 0
        self._nominal_batch = 0
        self._step_kind = SKIPPED
        self._step_compiles = 0
        self._step_context = ExitStack()  # per-step contexts: the eager stance, the FLOP counter
        self._flops: gpu.StepFlops | None = None
        self._profiles: dict[str, ProfileWindow] = {}
        self._profile: ProfileWindow | None = None
        self._profile_logged = False
        self._flops_per_batch: float | None = None
        self._peak_flops: float | None = None
        self._items: list[float | torch.Tensor] = []
        self._cache_at_start = (0, 0)
        self._saved_recompile_limit: int | None = None
        self._partial_possible: dict[str, bool] = {}

    @property
    def state_key(self) -> str:
        return self._generate_state_key(targets=repr(self.options.targets), mode=self.options.mode)

    @property
    def compiled_regions(self) -> list[str]:
        """Names of the regions running compiled right now."""
        return [r.name for r in self.runners if r.is_compiled]

    # ------------------------------------------------------------------ fit start: compile
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        self._fit_steps, self._nominal_batch, self._partial_possible = 0, 0, {}
        self._short_epoch_said = False
        self.regions = resolve_regions(pl_module, self.options.targets, self.options.exclude)
        self.plan = choose_plan(
            self.options.mode, self.options.cuda_graph, device, trainer.world_size, self.options.dynamic
        )
        if self.resumed_plan is not None and self.resumed_plan != self.plan.describe():
            rank_zero_warn(
                f"FuseCallback: the checkpoint's epochs were measured under plan {self.resumed_plan!r}, this run uses "
                f"{self.plan.describe()!r}; fuse/* from before and after the resume compare different setups."
            )
        self._start_cache(trainer, device)
        self._raise_dynamo_recompile_limit(len(self.regions))
        self.tracker.install()
        compile_options = CompileOptions(
            mode=self.plan.compile_mode, backend=self.options.backend, fullgraph=self.options.fullgraph,
            dynamic=self.plan.dynamic, options=dict(self.options.options) if self.options.options else None,
        )  # fmt: skip
        self.runners = compile_regions(self.regions, compile_options, self.tracker, self._policy)
        if self.plan.cuda_graph:
            self.graph = GraphedModule(*graph_target(pl_module))
            self.graph.install()
        self._timer = StepTimer(device)
        self._profiles = self._make_profiles(device)
        profiled = self.options.profile_steps if self._profiles else 0
        self._schedule = EagerSchedule(self.options.eager_steps, profiled=profiled)
        self._eager_ms = []
        self._start_gpu_metrics(trainer, pl_module, device)
        rank_zero_info(f"FuseCallback plan: {self.plan.describe()}\n{format_plan(self.regions, pl_module)}")

    def _start_cache(self, trainer: pl.Trainer, device: torch.device) -> None:
        self._cache_at_start = cache_counters()
        if self.options.cache_dir is False:
            return
        backend = getattr(self.options.backend, "__qualname__", self.options.backend)  # a callable: by name
        what = (self.plan.compile_mode, self.plan.cuda_graph, self.plan.dynamic, backend, self.options.fullgraph,
                sorted((self.options.options or {}).items()))  # fmt: skip
        key = cache_key([r.module for r in self.regions], device, [repr(what)])
        self.cache = CompileCache(self.options.cache_dir, [key])
        self.cache.activate()
        trainer.strategy.barrier()  # rank zero saved last; everyone reads the same file
        self.cache.load()

    def _raise_dynamo_recompile_limit(self, regions: int) -> None:
        # Regions of one class share dynamo's cache (one code object), so dynamo's own per-code limit (8) would be
        # reached before ours; our limit is per region and enforced in compiler.CompiledRegion.
        config = torch._dynamo.config
        self._saved_recompile_limit = config.recompile_limit
        config.recompile_limit = max(config.recompile_limit, min(256, (self.options.recompile_limit + 1) * regions))

    def _make_profiles(self, device: torch.device) -> dict[str, ProfileWindow]:
        if not self.options.profile_steps:
            return {}
        if device.type != "cuda":
            rank_zero_info("FuseCallback: `profile_steps` counts GPU kernels and needs a CUDA device; skipped.")
            return {}
        return {COMPILED: ProfileWindow(self.options.profile_steps), EAGER: ProfileWindow(self.options.profile_steps)}

    def _start_gpu_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule, device: torch.device) -> None:
        if device.type != "cuda":
            rank_zero_info("FuseCallback: no CUDA device, so GPU utilisation, MFU and peak memory are not measured.")
            return
        self._peak_flops = gpu.peak_flops(device, gpu.compute_dtype(str(trainer.precision)))
        self._flops_per_batch = getattr(pl_module, "flops_per_batch", None)
        if self.options.gpu_sample_hz > 0:
            self._sampler = gpu.GpuSampler(gpu.nvml_index(device), hz=self.options.gpu_sample_hz)
            if not self._sampler.start():
                self._sampler = None

    # ------------------------------------------------------------------ each step: shapes, eager schedule, timing
    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._timer.reserve(int(min(trainer.num_training_batches, 4096)))
        steps = int(min(trainer.num_training_batches, UNKNOWN_EPOCH_STEPS))
        placed = self._schedule.plan_epoch(self._fit_steps, steps, self._warmup_steps())
        if placed < self.options.eager_steps and not self._short_epoch_said:
            self._short_epoch_said = True
            then = "reuses the last measured reference, if any" if placed == 0 else f"times {placed}"
            rank_zero_info(
                f"FuseCallback: at most a third of an epoch runs eagerly, so an epoch of {steps} steps {then} instead"
                f" of eager_steps={self.options.eager_steps}; longer epochs or a lower eager_steps avoid this."
            )
        self._items = []
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        self._timer.start()  # this step's start is the last step's end
        self._mark_dynamic(batch, "train", lambda: trainer.train_dataloader)
        size = batch_size(batch)
        self._nominal_batch = max(self._nominal_batch, size)
        step = self._fit_steps
        if step == self._schedule.start_length > 0:
            self._drop_stale_grads(trainer, pl_module)
        eager = self._schedule.is_eager(step)
        if eager:
            timed = self._schedule.is_timed(step)
            self._profile = self._profiles[EAGER] if self._schedule.is_profiled(step) else None
        else:
            timed = step >= self._schedule.start_length + self._warmup_steps()
            window = self._profiles.get(COMPILED)
            self._profile = window if timed and window is not None and not window.done else None
        timed = timed and size == self._nominal_batch and self._profile is None  # profiled steps are never timed
        if self._profile is not None:
            self._profile.step_start()
        if eager:
            self._step_context.enter_context(torch.compiler.set_stance("force_eager"))  # anything compiled elsewhere
            self._step_context.enter_context(plain_eager(self._installed_modules()))
            if self._needs_flops() and not timed and self._profile is None:  # counting slows the step: untimed ones
                self._flops = self._step_context.enter_context(gpu.count_step_flops())
        self._step_kind = (EAGER if eager else COMPILED) if timed else SKIPPED
        if self.graph is not None:
            self.graph.capture_allowed = step > self._schedule.start_length  # regions compile first, capture after
        if self.options.length_fn is not None:
            items = count_items(self.options.length_fn, batch)  # every batch, so a bad length_fn fails on the first
            if self._step_kind != SKIPPED:
                self._items.append(items)
        self._step_compiles = self.tracker.total_compiles

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        compiled_now = self.tracker.total_compiles != self._step_compiles
        captured_now = self.graph is not None and self.graph.captured_during_last_call
        kind = SKIPPED if compiled_now or captured_now else self._step_kind
        self._timer.stop(kind)
        if self._profile is not None:
            self._profile.step_end()
        self._end_step_context()
        self._fit_steps += 1

    def _drop_stale_grads(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before the regions' first compiled step, set the gradients the eager steps left to ``None``.

        Dynamo traces each parameter with its ``.grad``; under FSDP with bf16 mixed precision that fails ("attempting
        to assign a gradient with dtype 'float' to a tensor with grad_dtype 'BFloat16'") and every region fell back
        to eager. Lightning would set these gradients to ``None`` after this step's forward anyway, so nothing
        changes, except with gradient accumulation or manual optimization, where they are kept.
        """
        if pl_module.automatic_optimization and trainer.accumulate_grad_batches == 1:
            pl_module.zero_grad(set_to_none=True)

    def _installed_modules(self) -> list[torch.nn.Module]:
        """The modules that carry a runner or the graph (bypassed during eager reference steps)."""
        modules = [runner.region.module for runner in self.runners]
        return modules + [self.graph.module] if self.graph is not None else modules

    def _needs_flops(self) -> bool:
        return self._peak_flops is not None and self._flops_per_batch is None

    def _end_step_context(self) -> None:
        self._step_context.close()
        if self._flops is not None:
            self._flops_per_batch = float(self._flops.total) or None
            self._flops = None

    def _warmup_steps(self) -> int:
        if self.options.warmup_steps is not None:
            return self.options.warmup_steps
        return 3 if self.plan is not None and self.plan.cuda_graph else 1

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timer is not None:
            self._timer.interrupt()  # the training step before validation would otherwise include it

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        self._mark_dynamic(batch, "validate", lambda: trainer.val_dataloaders)

    @override
    def on_test_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:  # fmt: skip
        self._mark_dynamic(batch, "test", lambda: trainer.test_dataloaders)

    def _mark_dynamic(self, batch: Any, stage: str, loaders: Callable[[], Any]) -> None:
        partial = self._partial_possible.get(stage)
        if partial is None:  # once per stage: the loaders are looked up only then
            # A CUDA graph needs static shapes: odd batches then run without it instead of going dynamic.
            static = self.plan is not None and self.plan.cuda_graph
            partial = self._partial_possible[stage] = not static and can_yield_partial_batch(loaders())
        self._policy.dynamic_sizes = self.options.dims.apply(batch, partial)

    # ------------------------------------------------------------------ epoch end: report
    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timer is None:
            return
        times = self._timer.collect()
        self._eager_ms = times.get(EAGER) or self._eager_ms  # an epoch without reference steps reuses the last one
        timing = summarize({COMPILED: times.get(COMPILED, []), EAGER: self._eager_ms})
        extra = self._sampler.read_and_reset() if self._sampler else {}
        if pl_module.device.type == "cuda":
            extra["peak_mem_gb"] = torch.cuda.max_memory_allocated(pl_module.device) / 1e9
        extra.update(self._kernel_metrics())
        extra.update(self._per_rank_utilisation(trainer, pl_module, extra))
        hits, misses = (now - start for now, start in zip(cache_counters(), self._cache_at_start))
        extra.update(cache_hits=hits, cache_misses=misses, graph_breaks=self.tracker.total_graph_breaks)
        metrics = epoch_metrics(
            timing, self._nominal_batch, self.tracker.total_s, self.tracker.total_recompiles,
            items_per_batch=float(sum(self._items)) / len(self._items) if self._items else None,  # one sync
            flops_per_batch=self._flops_per_batch, peak_flops=self._peak_flops, extra=extra,
        )  # fmt: skip
        self.history.append({"epoch": float(trainer.current_epoch), **metrics})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.current_epoch)
        self._drop_plan_if_slower(trainer, timing.speedup)

    def _drop_plan_if_slower(self, trainer: pl.Trainer, speedup: float | None) -> None:
        """With ``mode="auto"``, a plan measured slower than eager is dropped: the rest of the run trains eagerly.

        Rank zero's measurement decides for every rank, so all ranks run the same code.
        """
        if self.options.mode != "auto" or not (self.runners or self.graph is not None):
            return
        speedup = trainer.strategy.broadcast(speedup)
        if speedup is None or speedup >= SLOWER_THAN_EAGER:
            return
        rank_zero_warn(
            f"FuseCallback: the plan ({self.plan.describe()}) measured {speedup:.2f}x of eager this epoch, so the "
            "rest of the run trains eagerly (mode='auto'). Pass an explicit mode, e.g. mode='default', to keep it."
        )
        measured = {r.name: f"the plan measured {speedup:.2f}x of eager" for r in self.runners}
        self._uncompile()
        self.fallbacks.update(measured)
        self.graph = None
        self.plan = Plan(None, False, f"measured {speedup:.2f}x of eager: eager from epoch {trainer.current_epoch + 1}")

    def _per_rank_utilisation(self, trainer: pl.Trainer, pl_module: pl.LightningModule, extra: dict[str, float]):
        """Every rank's GPU utilisation, gathered to rank zero, which alone logs (a collective: all ranks call it)."""
        if trainer.world_size <= 1 or pl_module.device.type != "cuda":
            return {}
        mine = torch.tensor(float(extra.get("gpu_util", float("nan"))), device=pl_module.device)
        return per_rank("gpu_util", trainer.strategy.all_gather(mine).flatten().tolist())

    def _kernel_metrics(self) -> dict[str, float]:
        """The profiled kernel counts, once, in the epoch both windows finished."""
        if self._profile_logged or not self._profiles or not all(w.done for w in self._profiles.values()):
            return {}
        self._profile_logged = True
        compiled, eager = self._profiles[COMPILED].result, self._profiles[EAGER].result
        return {
            "kernels_per_step": compiled.kernels_per_step,
            "eager_kernels_per_step": eager.kernels_per_step,
            "gpu_busy_frac": compiled.gpu_busy_frac,
            "eager_gpu_busy_frac": eager.gpu_busy_frac,
        }

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)
        if self.cache is not None and trainer.is_global_zero:
            self.cache.save()

    @rank_zero_only
    def _report(self, trainer: pl.Trainer) -> None:
        text = summary_table(self.history, self.tracker, self.plan.describe() if self.plan else "-")
        rank_zero_info(text)
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):
                experiment.add_text("fuse/summary", text, global_step=trainer.current_epoch)
                experiment.flush()

    # ------------------------------------------------------------------ undo
    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _uncompile(self) -> None:
        """Take the graph and every compiled region off the model, keeping why any region had fallen back."""
        if self.graph is not None:
            self.graph.uninstall()
        self.fallbacks.update({r.name: r.fallback_reason for r in self.runners if r.fallback_reason})
        uncompile_regions(self.runners)
        self.runners = []

    def _restore(self) -> None:
        """Leave the model exactly as it was before fit: eager, unpatched, with torch's settings restored."""
        self._end_step_context()
        for window in self._profiles.values():
            window.abort()
        self._uncompile()
        self.tracker.remove()
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        if self.cache is not None:
            self.cache.deactivate()
        if self._saved_recompile_limit is not None:
            torch._dynamo.config.recompile_limit = self._saved_recompile_limit
            self._saved_recompile_limit = None

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        plan = self.plan.describe() if self.plan else self.resumed_plan
        return {"history": [dict(row) for row in self.history], "plan": plan}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [dict(row) for row in state_dict.get("history", [])]
        self.resumed_plan = state_dict.get("plan")
