"""The state of one fit, made new at every fit start, and the bookkeeping of its epochs and steps.

:class:`FitState` holds what a fit learns as it goes (the plan in force, the timer, the reference schedule, the
recorded inputs, the search's decision, the compile cache) so that a callback reused for a second ``fit`` starts
from nothing. Each training step is opened by :meth:`FitState.begin_step` (what the step is, the contexts it runs
in) and closed by :meth:`FitState.end_step` (its time recorded, its contexts left); :meth:`FitState.close` undoes
everything the fit changed. The fit is set up by :mod:`~lightning_fuse.start`, its plan chosen by
:mod:`~lightning_fuse.choice`, and what it measured summed up by :mod:`~lightning_fuse.measurement`.

Example::

    >>> state = FitState()
    >>> state.plan is None, state.steps, state.plan_name()
    (True, 0, 'eager')
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from lightning_fuse import compat, gpu
from lightning_fuse.call_shapes import CallShapes, NoCudnnAttention
from lightning_fuse.compiler import plain_eager
from lightning_fuse.plan import Plan, Setting
from lightning_fuse.running_guard import BEFORE, PLAN, RunningGuard, window_speedup
from lightning_fuse.shapes import (CompileTracker, DynamicDims, batch_size, can_yield_partial_batch, count_items,
                                   mark_dims)
from lightning_fuse.timing import (COMPILED, EAGER, LEAD_IN, SKIPPED, UNKNOWN_EPOCH_STEPS, EagerSchedule,
                                   ReferencePool, StepTimer)

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_fuse.buckets import PadToBuckets
    from lightning_fuse.cache import CompileCache
    from lightning_fuse.decision import Decision, DecisionFile
    from lightning_fuse.graphs import GraphedModule
    from lightning_fuse.guard import BackwardGuard
    from lightning_fuse.kv_cache import NoCacheInTraining
    from lightning_fuse.optimizer_graph import OptimizerGraph
    from lightning_fuse.options import FuseOptions
    from lightning_fuse.profiling import ProfileWindow


@dataclass
class FitState:
    """Everything one fit of FuseCallback learns; a new one at every fit start
    (:func:`~lightning_fuse.start.start_fit`).

    Example::

        >>> FitState().what_ran()
        'eager (no plan was installed)'
    """

    options: FuseOptions | None = None
    setting: Setting | None = None
    candidates: list[Plan] = field(default_factory=list)
    searching: bool = False
    plan: Plan | None = None
    decision: Decision | None = None
    dropped: str | None = None
    dropped_in_epoch: int | None = None
    tracker: CompileTracker = field(default_factory=CompileTracker)
    cache: CompileCache | None = None
    guard: BackwardGuard | None = None
    timer: StepTimer | None = None
    schedule: EagerSchedule = field(default_factory=lambda: EagerSchedule(0))
    activation_step: int = 0
    warmup: int = 1
    """Steps of the plan kept out of the timing after it is installed (3 where a candidate captures graphs)."""
    steps: int = 0
    nominal_batch: int = 0
    step_kind: str = SKIPPED
    step_compiles: int = 0
    step_recordings: int = 0
    step_context: ExitStack = field(default_factory=ExitStack)
    """The running step's contexts: the eager stance, the plan's modules run plainly, the FLOP counter."""
    pool: ReferencePool = field(default_factory=ReferencePool)
    """The last few reference chunks' eager step times: what each epoch's speedup divides."""
    compiled_ms: float | None = None
    """The last epoch's median compiled step, for the reference's budget."""
    reference_ms: float = 0.0
    """The eager reference's time so far in the fit (timed steps and lead-ins), for its share in the verdict."""
    train_ms: float = 0.0
    """The fit's training time so far, as far as the timer saw it."""
    items: list[Any] = field(default_factory=list)
    partial_possible: dict[str, bool] = field(default_factory=dict)
    recorded: tuple[tuple, dict] | None = None
    shapes: CallShapes = field(default_factory=CallShapes)
    """The shapes of the network's training calls before the plan was chosen."""
    varying_dims: set[int] = field(default_factory=set)
    """The dims those shapes varied in: marked dynamic on every batch once the plan is chosen."""
    attention: NoCudnnAttention = field(default_factory=NoCudnnAttention)
    """cuDNN attention off in the plan's steps, where the lengths vary."""
    pace: RunningGuard = field(default_factory=RunningGuard)
    profiles: dict[str, ProfileWindow] = field(default_factory=dict)
    profile: ProfileWindow | None = None
    profile_logged: bool = False
    flops: Any = None
    flops_per_batch: float | None = None
    peak_flops: float | None = None
    sampler: gpu.GpuSampler | None = None
    cache_at_start: tuple[int, int] = (0, 0)
    trees_at_start: tuple[int, int] = (0, 0)
    """torch's cudagraph trees at fit start: the graphs they held and inductor's cudagraph skips, on the fit's device
    (:func:`cudagraph_trees`); both are process-wide, so the fit's own are what was added since."""
    saved_recompile_limit: int | None = None
    fallbacks: dict[str, str] = field(default_factory=dict)
    buckets: PadToBuckets | None = None
    decision_file: DecisionFile | None = None
    """Where the plan search's decision is cached (``None``: no cache, or no search)."""
    no_cache: NoCacheInTraining | None = None
    optimizer_graphs: list[OptimizerGraph | None] = field(default_factory=list)
    """Each optimizer's captured update, in the Trainer's order (``None``: it steps as always)."""
    optimizer_verdict_pending: bool = False
    """Several processes: rank zero's optimizer-graph trial has yet to decide every rank's graphs."""
    capture_optimizer: Any = None
    """How an optimizer's update is captured (``None``: in a CUDA graph; a test on CPU fakes it)."""
    _recorder: Any = None

    # ------------------------------------------------------------------ the fit's start
    def start_recording(self) -> None:
        """Record the network's training inputs (and their shapes) until the plan is chosen."""
        # first of the hooks: the search replays the call as the training step makes it, so that a graph it captures
        # has the signature the training calls have (not the one other hooks, use_cache=False, turn it into)
        self._recorder = self.setting.target[1].register_forward_pre_hook(self._record, with_kwargs=True, prepend=True)

    def _record(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled() and self.plan is None:
            self.recorded = (args, kwargs)
            self.shapes.add(args, kwargs)

    def stop_recording(self) -> None:
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None

    def raise_recompile_limit(self) -> None:
        """Raise dynamo's recompile limit for the fit (:meth:`close` puts it back)."""
        self.saved_recompile_limit = compat.dynamo_recompile_limit()
        # Regions of one class share dynamo's cache (one code object), so dynamo's own per-code limit (8) would be
        # reached before ours; our limit is per region and enforced in compiler.CompiledRegion.
        regions = max(1, len(self.setting.regions))
        compat.set_dynamo_recompile_limit(max(self.saved_recompile_limit,
                                              min(256, (self.options.recompile_limit + 1) * regions)))  # fmt: skip

    def start_gpu_metrics(self, precision: str, pl_module: pl.LightningModule) -> None:
        """Peak FLOPs for MFU and NVML sampling, on a CUDA device (``precision``: the Trainer's)."""
        device = pl_module.device
        if device.type != "cuda":
            rank_zero_info("FuseCallback: no CUDA device, so GPU utilisation, MFU and peak memory are not measured.")
            return
        self.peak_flops = gpu.peak_flops(device, gpu.compute_dtype(precision))
        self.flops_per_batch = getattr(pl_module, "flops_per_batch", None)
        if self.options.gpu_sample_hz > 0:
            self.sampler = gpu.GpuSampler(gpu.nvml_index(device), hz=self.options.gpu_sample_hz)
            if not self.sampler.start():
                self.sampler = None

    def plan_name(self) -> str:
        return self.plan.name if self.plan is not None else "eager"

    # ------------------------------------------------------------------ epochs and steps
    def begin_epoch(self, batches: float, device: torch.device) -> None:
        """An epoch of ``batches`` training batches (``inf``: unknown) starts: its eager reference steps placed."""
        self.timer.reserve(int(min(batches, 4096)))
        settle = self.activation_step - self.schedule.start_length + self.warmup
        self.schedule.plan_epoch(self.steps, int(min(batches, UNKNOWN_EPOCH_STEPS)), settle,
                                 eager_ms=self.pool.median(), compiled_ms=self.compiled_ms)  # fmt: skip
        self.items = []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def runs_compiled(self) -> bool:
        """Whether the plan in force runs anything but the plain eager network."""
        return self.plan is not None and bool(self.plan.modules())

    @property
    def graph(self) -> GraphedModule | None:
        """The plan's CUDA graph over the network, if it has one."""
        return self.plan.graph if self.plan is not None else None

    def begin_step(self, batch: Any, batch_idx: int, length_fn: Callable[[Any], Any] | None,
                   iteration_start: bool = True, zeroed_after_forward: bool = False) -> None:  # fmt: skip
        """Decide what this step is (eager or the plan; timed, reference lead-in, or skipped) and enter it: an eager
        step runs everything eagerly (and counts FLOPs where it is untimed and unprofiled, on a GPU), a plan step
        begins the plan's iteration (``iteration_start``: not a later micro-batch of an accumulation) and arms the
        backward guard. ``zeroed_after_forward``: the gradients are zeroed between this step's forward and backward
        (Lightning's automatic optimization at an iteration's start), which the plan's graph is told."""
        size = batch_size(batch)
        self.nominal_batch = max(self.nominal_batch, size)
        eager = self.plan is None or self.schedule.is_eager(self.steps)
        self.no_cache.enabled = not eager and self.runs_compiled()  # eager steps run the user's call as written
        self.attention.enabled = self.no_cache.enabled
        timed, profile = self.step_timing(eager, size)
        self.step_kind = (EAGER if eager else COMPILED) if timed else SKIPPED
        if self.schedule.is_lead_in(self.steps):
            self.step_kind = LEAD_IN  # untimed, but part of the reference's cost
        if length_fn is not None:
            items = count_items(length_fn, batch)  # every batch, so a bad length_fn fails on the first
            if self.step_kind != SKIPPED:
                self.items.append(items)
        self.step_compiles, self.step_recordings = self.tracker.total_compiles, self.tracker.recordings
        # the running guard times the plan's steps, eager's timed reference steps and the eager steps before the plan
        self.pace.begin(BEFORE if self.plan is None else PLAN if not eager else self.step_kind)
        if self.graph is not None:
            self.graph.grads_zeroed_after_forward = zeroed_after_forward
        for graph in filter(None, self.optimizer_graphs):
            graph.enabled = not eager  # an eager reference step's update is the optimizer's own
        if eager:
            self._enter_eager(count_flops=self.needs_flops() and not timed and profile is None)
        elif iteration_start:
            self.plan.step_begin()
        self.guard.arm(batch, batch_idx, armed=not eager and self.plan.owned)

    def _enter_eager(self, count_flops: bool) -> None:
        self.step_context.enter_context(torch.compiler.set_stance("force_eager"))  # anything compiled elsewhere
        self.step_context.enter_context(plain_eager(self.plan.modules() if self.plan else []))
        if count_flops:
            self.flops = self.step_context.enter_context(gpu.count_step_flops())

    def step_timing(self, eager: bool, size: int) -> tuple[bool, ProfileWindow | None]:
        """Whether this step is timed, and the profile window it runs in (profiled steps are never timed)."""
        if eager:
            timed = self.schedule.is_timed(self.steps)
            profile = self.profiles[EAGER] if self.profiles and self.schedule.is_profiled(self.steps) else None
        else:
            timed = self.steps >= self.activation_step + self.warmup
            window = self.profiles.get(COMPILED)
            profile = window if timed and window is not None and not window.done else None
        if profile is not None:
            profile.step_start()
        self.profile = profile
        return timed and size == self.nominal_batch and profile is None, profile

    def end_step(self) -> list[float] | None:
        """Close the step :meth:`begin_step` opened: its time recorded (a step that compiled, captured a graph of
        ours or recorded one of torch's cudagraph trees is kept out), its contexts left; at the end of a running
        guard's window, that window's plan step times (recording steps left out, compiling ones in)."""
        graph = self.graph
        compiled_now = self.tracker.total_compiles != self.step_compiles
        recorded_now = self.tracker.recordings != self.step_recordings
        captured_now = graph is not None and graph.captured_during_last_call
        self.timer.stop(SKIPPED if compiled_now or recorded_now or captured_now else self.step_kind)
        if compiled_now or recorded_now:  # a one-time cost, which the optimizer graph's trial leaves out too
            for optimizer_graph in filter(None, self.optimizer_graphs):
                optimizer_graph.leave_step_untimed()
        if self.profile is not None:
            self.profile.step_end()
        self.close_step_context()
        self.steps += 1
        return self.pace.end(judged=not recorded_now)

    def close_step_context(self) -> None:
        """Leave the running step's contexts, keeping the FLOPs it counted."""
        self.step_context.close()
        if self.flops is not None:
            self.flops_per_batch = float(self.flops.total) or None
            self.flops = None

    def mark_dynamic(self, dims: DynamicDims, batch: Any, stage: str, loaders: Callable[[], Any]) -> None:
        """Mark the batch's varying dims dynamic for the regions (the loaders are read once per stage)."""
        partial = self.partial_possible.get(stage)
        if partial is None:
            partial = self.partial_possible[stage] = can_yield_partial_batch(loaders())
        self.setting.policy.dynamic_sizes = dims.apply(batch, partial) | mark_dims(batch, self.varying_dims)

    def eager_step_ms(self) -> float | None:
        """Eager's whole step for the running guard: its own timed reference steps, else the reference pool's
        median (earlier epochs), else the eager steps before the plan. Never the search's eager trial: it times
        the forward and backward alone, and beside a step whose optimizer takes long every plan would look slow."""
        return self.pace.eager_ms() or self.pool.median() or self.pace.before_ms()

    def speedup_over_window(self, plan_ms: list[float]) -> float | None:
        """The running guard's speedup over a window whose plan steps took ``plan_ms`` (``None``: not judged, the
        window was mostly the eager reference, or eager's step is unknown)."""
        return window_speedup(plan_ms, self.eager_step_ms(), least=self.pace.window // 2)

    def needs_flops(self) -> bool:
        return self.peak_flops is not None and self.flops_per_batch is None

    # ------------------------------------------------------------------ what ran
    def what_ran(self) -> str:
        """The plan in force at the end, and what became of its graph and regions."""
        parts = [self.plan.describe() if self.plan is not None else "eager (no plan was installed)"]
        if self.dropped:
            parts.append(f"plan dropped: {self.dropped}")
        graph = self.graph
        if graph is not None:
            parts.append(f"graph: captured, {graph.replays} replays" if graph.captured
                         else f"graph: not captured ({graph.disabled_reason or 'no eligible call'})")  # fmt: skip
        trees = self.trees_recorded()
        if trees is not None:
            parts.append(self._trees_part(*trees))
        parts += [graph.describe() for graph in self.optimizer_graphs if graph is not None]
        fallbacks = {**self.fallbacks, **self.plan_fallbacks()}
        parts += [f"region {name}: fell back ({why})" for name, why in fallbacks.items()]
        runners = self.plan.runners if self.plan is not None else []
        parts += [f"region {runner.name}: new kinds of input ran eagerly ({runner.closed_reason})"
                  for runner in runners if runner.closed_reason and not runner.fallback_reason]  # fmt: skip
        return "; ".join(parts)

    def trees_recorded(self) -> tuple[int, int] | None:
        """The CUDA graphs torch's cudagraph trees recorded in this fit, and the times inductor skipped cudagraphs
        in it, for a plan that runs them (``None`` for any other plan).

        Both are process-wide counts less their values at fit start. The plan search's candidates record into the
        same trees, and a losing candidate's graphs stay there (:meth:`Plan.release` frees only our own graph), so a
        fit whose search ran counts its trials' graphs and skips too; :meth:`what_ran` says so. The trees keep no
        count of replays.
        """
        if self.plan is None or not self.plan.cudagraph_trees:
            return None
        graphs, skips = cudagraph_trees(self.setting.device)
        return graphs - self.trees_at_start[0], skips - self.trees_at_start[1]

    def _trees_part(self, graphs: int, skips: int) -> str:
        """The summary's part on torch's cudagraph trees, e.g. ``graphs: 14 recorded by torch's cudagraph trees``."""
        part = f"graphs: {graphs or 'none'} recorded by torch's cudagraph trees"
        if self.decision is not None and not self.decision.cached:
            part += ", the plan search's trials included"
        if skips:
            part += f' (inductor skipped cudagraphs {skips} time(s): see its "skipping cudagraphs due to ..." warnings)'
        return part

    def plan_fallbacks(self) -> dict[str, str]:
        """The plan's regions that fell back to eager, with why."""
        runners = self.plan.runners if self.plan is not None else []
        return {runner.name: runner.fallback_reason for runner in runners if runner.fallback_reason}

    def warn_if_resumed_under_another_plan(self, resumed: str | None) -> None:
        if resumed is not None and resumed != self.plan.describe():
            rank_zero_warn(
                f"FuseCallback: the checkpoint's epochs were measured under plan {resumed!r}, this run uses "
                f"{self.plan.describe()!r}; fuse/* from before and after the resume compare different setups."
            )

    # ------------------------------------------------------------------ dropping the plan, undoing the fit
    def drop_plan(self, reason: str, epoch: int | None = None) -> None:
        """Take the plan off: the rest of the fit trains eagerly, with one warning (on a line of its own) saying why;
        ``epoch``: the (Lightning) epoch it was dropped in, for the verdict."""
        _new_line()  # the warning on a line of its own, not in the middle of the progress bar's
        rank_zero_warn(
            f"FuseCallback: plan {self.plan_name()!r} dropped, the rest of the fit trains eagerly: {reason}."
        )
        self.uninstall_plan()
        self.plan, self.dropped, self.dropped_in_epoch = Plan(), f"{reason} (step {self.steps})", epoch
        if self.decision_file is not None:  # the next run measures again rather than start with a dropped plan
            self.decision_file.forget()

    def uninstall_plan(self) -> None:
        for graph in filter(None, self.optimizer_graphs):
            graph.uninstall()
        if self.plan is not None:
            self.fallbacks.update(self.plan_fallbacks())  # kept: the summary names them after the plan is gone
            self.plan.uninstall()

    def close(self) -> None:
        """Undo everything the fit changed: the step's contexts, the plan, hooks, torch settings, the cache's
        environment."""
        self.close_step_context()
        for window in self.profiles.values():
            window.abort()
        self.uninstall_plan()
        self.tracker.remove()
        self.stop_recording()
        if self.no_cache is not None:
            self.no_cache.uninstall()
        self.attention.restore()
        if self.guard is not None:
            self.guard.uninstall()
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None
        if self.cache is not None:
            self.cache.deactivate()
        if self.saved_recompile_limit is not None:
            compat.set_dynamo_recompile_limit(self.saved_recompile_limit)
            self.saved_recompile_limit = None


def cudagraph_trees(device: torch.device) -> tuple[int, int]:
    """The CUDA graphs torch's cudagraph trees hold on ``device`` and inductor's cudagraph skips, so far in this
    process (:func:`compat.cudagraph_tree_stats`); ``(0, 0)`` off CUDA."""
    if device.type != "cuda":
        return 0, 0
    return compat.cudagraph_tree_stats(device.index if device.index is not None else torch.cuda.current_device())


@rank_zero_only
def _new_line() -> None:
    sys.stderr.write("\n")
