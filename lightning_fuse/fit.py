"""The state of one fit, made new at every fit start, and the steps that set it up, choose its plan and end it.

:class:`FitState` holds what a fit learns as it goes (the plan in force, the timer, the reference schedule, the
recorded inputs, the search's decision, the compile cache) so that a callback reused for a second ``fit`` starts
from nothing. :func:`activate_plan` is the moment the plan is chosen (by measurement) or forced, and installed.

Example::

    >>> state = FitState()
    >>> state.plan is None, state.steps, state.plan_name()
    (True, 0, 'eager')
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from lightning_fuse import compat, gpu
from lightning_fuse.buckets import PadToBuckets, suggest_buckets
from lightning_fuse.cache import CompileCache, cache_counters, cache_key
from lightning_fuse.call_shapes import CallShapes
from lightning_fuse.compiler import CompileOptions, RegionPolicy, _changes_in_training, plain_eager
from lightning_fuse.decision import Decision, DecisionFile, announce, decision_key
from lightning_fuse.graphs import graph_target
from lightning_fuse.guard import BackwardGuard
from lightning_fuse.kv_cache import NoCacheInTraining
from lightning_fuse.metrics import epoch_metrics, measure_only_line, per_rank, summary_table, verdict_line
from lightning_fuse.plan import Plan, Setting, UserCompiled, candidates, for_varying_shapes, forced_plan, user_compiled
from lightning_fuse.profiling import ProfileWindow
from lightning_fuse.regions import AUTO, resolve_regions
from lightning_fuse.running_guard import PLAN, RunningGuard, window_speedup
from lightning_fuse.search import Consensus, PlanSearch, TrialCall, sandbox
from lightning_fuse.shapes import (CompileTracker, DynamicDims, batch_size, can_yield_partial_batch, count_items,
                                   mark_dims, mark_region_inputs)
from lightning_fuse.timing import (COMPILED, EAGER, LEAD_IN, SKIPPED, UNKNOWN_EPOCH_STEPS, EagerSchedule,
                                   ReferencePool, StepTimer, summarize)

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_fuse.graphs import GraphedModule
    from lightning_fuse.options import FuseOptions

log = logging.getLogger("lightning_fuse")

SHAPE_STEPS = 3
"""Eager steps, at least, before the plan search: their network inputs tell whether the shapes vary."""


@dataclass
class FitState:
    """Everything one fit of FuseCallback learns; a new one at every fit start (:meth:`start`).

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
    (:func:`_cudagraph_trees`); both are process-wide, so the fit's own are what was added since."""
    saved_recompile_limit: int | None = None
    fallbacks: dict[str, str] = field(default_factory=dict)
    buckets: PadToBuckets | None = None
    decision_file: DecisionFile | None = None
    """Where the plan search's decision is cached (``None``: no cache, or no search)."""
    no_cache: NoCacheInTraining | None = None
    _recorder: Any = None

    @classmethod
    def start(cls, options: FuseOptions, trainer: pl.Trainer, pl_module: pl.LightningModule,
              setting: Setting) -> FitState:  # fmt: skip
        """A fit's state at its start: the candidates built, the timer and schedule ready, inputs being recorded."""
        searching = options.mode == AUTO and options.cuda_graph == AUTO and options.targets in (AUTO, (AUTO,))
        searching = searching and not _is_sharded(trainer)
        precompiled = user_compiled(pl_module)
        fit = cls(options=options, setting=setting, searching=searching and not precompiled, tracker=setting.tracker)
        if precompiled:
            fit.candidates = [UserCompiled(precompiled)]
        elif fit.searching:
            fit.candidates = candidates(setting)
        else:
            fit.candidates = [forced_plan(setting, options.mode, options.cuda_graph)]
        fit.buckets = PadToBuckets(options.pad_buckets) if options.pad_buckets else None
        fit.timer = StepTimer(pl_module.device)
        fit.profiles = _profiles(options.profile_steps, pl_module.device)
        fit.schedule = EagerSchedule(options.eager_steps, reference_budget=options.reference_budget,
                                     profiled=options.profile_steps if fit.profiles else 0)  # fmt: skip
        fit.activation_step = max(fit.schedule.start_length, SHAPE_STEPS if fit.searching else 0)
        graphs = any(plan.records_graphs for plan in fit.candidates)
        fit.warmup = options.warmup_steps if options.warmup_steps is not None else 3 if graphs else 1
        fit.cache_at_start = cache_counters()
        fit.trees_at_start = _cudagraph_trees(setting.device)
        fit.saved_recompile_limit = compat.dynamo_recompile_limit()
        # Regions of one class share dynamo's cache (one code object), so dynamo's own per-code limit (8) would be
        # reached before ours; our limit is per region and enforced in compiler.CompiledRegion.
        regions = max(1, len(setting.regions))
        compat.set_dynamo_recompile_limit(max(fit.saved_recompile_limit,
                                              min(256, (options.recompile_limit + 1) * regions)))  # fmt: skip
        fit.tracker.install()
        fit.no_cache = NoCacheInTraining(setting.target[1])
        fit.no_cache.install()
        # first of the hooks: the search replays the call as the training step makes it, so that a graph it captures
        # has the signature the training calls have (not the one other hooks, use_cache=False, turn it into)
        fit._recorder = setting.target[1].register_forward_pre_hook(fit._record, with_kwargs=True, prepend=True)
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # 16-mixed: a redone loss is scaled like the first
        fit.guard = BackwardGuard(fit.drop_plan, trainer.precision_plugin.forward_context,
                                  scaler.scale if scaler is not None else lambda loss: loss)  # fmt: skip
        fit.guard.install(pl_module)
        fit.start_gpu_metrics(trainer, pl_module)
        return fit

    def _record(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled() and self.plan is None:
            self.recorded = (args, kwargs)
            self.shapes.add(args, kwargs)

    def plan_name(self) -> str:
        return self.plan.name if self.plan is not None else "eager"

    def intent(self) -> str:
        """The plan line at fit start: what will be chosen from, or what is forced."""
        if isinstance(self.candidates[0], UserCompiled):
            return f"no compile of its own: {self.candidates[0].reason}"
        if self.searching:
            names = ", ".join(plan.name for plan in self.candidates)
            return f"the plan will be chosen by measurement after step {self.activation_step} among: {names}"
        return f"plan forced by explicit settings: {self.candidates[0].describe()}"

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

    def begin_step(self, batch: Any, batch_idx: int, length_fn: Callable[[Any], Any] | None) -> None:
        """Decide what this step is (eager or the plan; timed, reference lead-in, or skipped) and enter it: an eager
        step runs everything eagerly (and counts FLOPs where it is untimed and unprofiled, on a GPU), a plan step
        begins the plan's step and arms the backward guard."""
        size = batch_size(batch)
        self.nominal_batch = max(self.nominal_batch, size)
        eager = self.plan is None or self.schedule.is_eager(self.steps)
        self.no_cache.enabled = not eager and self.runs_compiled()  # eager steps run the user's call as written
        timed, profile = self.step_timing(eager, size)
        self.step_kind = (EAGER if eager else COMPILED) if timed else SKIPPED
        if self.schedule.is_lead_in(self.steps):
            self.step_kind = LEAD_IN  # untimed, but part of the reference's cost
        if length_fn is not None:
            items = count_items(length_fn, batch)  # every batch, so a bad length_fn fails on the first
            if self.step_kind != SKIPPED:
                self.items.append(items)
        self.step_compiles = self.tracker.total_compiles
        if self.plan is not None:
            self.pace.begin(PLAN if not eager else self.step_kind)  # the running guard times eager's timed steps
        if eager:
            self._enter_eager(count_flops=self.needs_flops() and not timed and profile is None)
        else:
            self.plan.step_begin()
        self.guard.arm(batch, batch_idx, armed=not eager and self.plan.owned)

    def _enter_eager(self, count_flops: bool) -> None:
        self.step_context.enter_context(torch.compiler.set_stance("force_eager"))  # anything compiled elsewhere
        self.step_context.enter_context(plain_eager(self.plan.modules() if self.plan else []))
        if count_flops:
            self.flops = self.step_context.enter_context(gpu.count_step_flops())

    def mark_dynamic(self, dims: DynamicDims, batch: Any, stage: str, loaders: Callable[[], Any]) -> None:
        """Mark the batch's varying dims dynamic for the regions (the loaders are read once per stage)."""
        partial = self.partial_possible.get(stage)
        if partial is None:
            partial = self.partial_possible[stage] = can_yield_partial_batch(loaders())
        self.setting.policy.dynamic_sizes = dims.apply(batch, partial) | mark_dims(batch, self.varying_dims)

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
        """Close the step :meth:`begin_step` opened: its time recorded (a step that compiled or captured a graph is
        kept out), its contexts left; at the end of a running guard's window, that window's plan step times."""
        graph = self.graph
        compiled_now = self.tracker.total_compiles != self.step_compiles
        captured_now = graph is not None and graph.captured_during_last_call
        self.timer.stop(SKIPPED if compiled_now or captured_now else self.step_kind)
        if self.profile is not None:
            self.profile.step_end()
        self.close_step_context()
        self.steps += 1
        return self.pace.end()

    def close_step_context(self) -> None:
        """Leave the running step's contexts, keeping the FLOPs it counted."""
        self.step_context.close()
        if self.flops is not None:
            self.flops_per_batch = float(self.flops.total) or None
            self.flops = None

    def eager_step_ms(self) -> float | None:
        """Eager's step for the running guard: its own timed reference steps, else the reference pool's median
        (earlier epochs), else the search's eager trial (one forward and backward)."""
        trial = self.decision.trials[0].ms if self.decision is not None and self.decision.trials else None
        return self.pace.eager_ms() or self.pool.median() or trial

    def speedup_over_window(self, plan_ms: list[float]) -> float | None:
        """The running guard's speedup over a window whose plan steps took ``plan_ms`` (``None``: not judged, the
        window was mostly the eager reference, or eager's step is unknown)."""
        return window_speedup(plan_ms, self.eager_step_ms(), least=self.pace.window // 2)

    def needs_flops(self) -> bool:
        return self.peak_flops is not None and self.flops_per_batch is None

    def start_gpu_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        if device.type != "cuda":
            rank_zero_info("FuseCallback: no CUDA device, so GPU utilisation, MFU and peak memory are not measured.")
            return
        self.peak_flops = gpu.peak_flops(device, gpu.compute_dtype(str(trainer.precision)))
        self.flops_per_batch = getattr(pl_module, "flops_per_batch", None)
        if self.options.gpu_sample_hz > 0:
            self.sampler = gpu.GpuSampler(gpu.nvml_index(device), hz=self.options.gpu_sample_hz)
            if not self.sampler.start():
                self.sampler = None

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
        fallbacks = {**self.fallbacks, **self._plan_fallbacks()}
        parts += [f"region {name}: fell back ({why})" for name, why in fallbacks.items()]
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
        graphs, skips = _cudagraph_trees(self.setting.device)
        return graphs - self.trees_at_start[0], skips - self.trees_at_start[1]

    def _trees_part(self, graphs: int, skips: int) -> str:
        """The summary's part on torch's cudagraph trees, e.g. ``graphs: 14 recorded by torch's cudagraph trees``."""
        part = f"graphs: {graphs or 'none'} recorded by torch's cudagraph trees"
        if self.decision is not None and not self.decision.cached:
            part += ", the plan search's trials included"
        if skips:
            part += f' (inductor skipped cudagraphs {skips} time(s): see its "skipping cudagraphs due to ..." warnings)'
        return part

    def verdict(self, history: list[dict[str, Any]]) -> str:
        if self.decision is not None and self.decision.winner == "eager" and self.dropped is None:
            return self._eager_verdict()
        last = history[-1] if history else {}
        if self._measures_only():
            return measure_only_line(last.get("fuse/step_ms"))
        return verdict_line(self.plan_name(), history, self.tracker.total_s,
                            break_even_step=last.get("fuse/break_even_step"), dropped=self.dropped,
                            device_type=self.setting.device.type if self.setting else "cpu",
                            eager_steps=self.options.eager_steps if self.options else None,
                            reference_steps=len(self.pool.samples),
                            reference_cost=self.reference_ms / self.train_ms if self.train_ms else None)  # fmt: skip

    def _measures_only(self) -> bool:
        """Eager by design: nothing selected to compile and no search (a dropped plan leaves an eager plan too)."""
        plan = self.plan
        return plan is not None and plan.owned and not plan.modules() and self.decision is None and not self.dropped

    def _eager_verdict(self) -> str:
        """The search kept eager: say how the best candidate measured against it, and what finding out cost."""
        eager = self.decision.trials[0].ms
        timed = [t for t in self.decision.trials[1:] if t.ms is not None]
        best = min(timed, key=lambda t: t.ms) if timed else None
        against = f"the best plan, {best.name}, ran at {eager / best.ms:.2f}x of eager" if best and eager else (
            "every other plan failed")
        return (f"FuseCallback: 1.00x, kept eager: no plan beat it on this {self.setting.device.type.upper()} "
                f"({against}); compile {self.tracker.total_s:.0f} s spent finding out")

    def _plan_fallbacks(self) -> dict[str, str]:
        """The plan's regions that fell back to eager, with why."""
        runners = self.plan.runners if self.plan is not None else []
        return {runner.name: runner.fallback_reason for runner in runners if runner.fallback_reason}

    def warn_if_resumed_under_another_plan(self, resumed: str | None) -> None:
        if resumed is not None and resumed != self.plan.describe():
            rank_zero_warn(
                f"FuseCallback: the checkpoint's epochs were measured under plan {resumed!r}, this run uses "
                f"{self.plan.describe()!r}; fuse/* from before and after the resume compare different setups."
            )

    def drop_plan(self, reason: str) -> None:
        """Take the plan off: the rest of the fit trains eagerly, with one warning (on a line of its own) saying why."""
        _new_line()  # the warning on a line of its own, not in the middle of the progress bar's
        rank_zero_warn(
            f"FuseCallback: plan {self.plan_name()!r} dropped, the rest of the fit trains eagerly: {reason}."
        )
        self.uninstall_plan()
        self.plan, self.dropped = Plan(), f"{reason} (step {self.steps})"
        if self.decision_file is not None:  # the next run measures again rather than start with a dropped plan
            self.decision_file.forget()

    def uninstall_plan(self) -> None:
        if self.plan is not None:
            self.fallbacks.update(self._plan_fallbacks())  # kept: the summary names them after the plan is gone
            self.plan.uninstall()

    def close(self) -> None:
        """Undo everything the fit changed: the step's contexts, the plan, hooks, torch settings, the cache's
        environment."""
        self.close_step_context()
        for window in self.profiles.values():
            window.abort()
        self.uninstall_plan()
        self.tracker.remove()
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None
        if self.no_cache is not None:
            self.no_cache.uninstall()
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


def fit_setting(options: FuseOptions, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Setting:
    """What the fit's plans are built from: its regions, its network, the compile arguments, the device."""
    regions = resolve_regions(pl_module, options.targets, options.exclude)
    policy = RegionPolicy(verify=options.verify, recompile_limit=options.recompile_limit,
                          on_recompile_limit=options.on_recompile_limit,
                          graph_shapes=len(options.pad_buckets or [1]))  # fmt: skip
    compile_options = CompileOptions(backend=options.backend, fullgraph=options.fullgraph, dynamic=options.dynamic,
                                     options=dict(options.options) if options.options else None)  # fmt: skip
    return Setting(regions, graph_target(pl_module), compile_options, pl_module.device, policy=policy,
                   world_size=trainer.world_size, max_graphs=len(options.pad_buckets or [1]))  # fmt: skip


def start_cache(options: FuseOptions, trainer: pl.Trainer, fit: FitState) -> CompileCache | None:
    """Point torch's compile caches into ``cache_dir`` and load last run's artifacts (``None``: no cache)."""
    if options.cache_dir is False:
        return None
    backend = getattr(options.backend, "__qualname__", options.backend)  # a callable: by name
    what = (options.mode, options.cuda_graph, options.dynamic, backend, options.fullgraph,
            sorted((options.options or {}).items()))  # fmt: skip
    modules = [region.module for region in fit.setting.regions] + [fit.setting.target[1]]
    cache = CompileCache(options.cache_dir, [cache_key(modules, fit.setting.device, [repr(what)])])
    cache.activate()
    trainer.strategy.barrier()  # rank zero saved last; everyone reads the same file
    cache.load()
    return cache


def activate_plan(fit: FitState, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Choose the plan (by measurement on the recorded inputs, from the cache, or forced) and install it."""
    if fit._recorder is not None:
        fit._recorder.remove()
        fit._recorder = None
    _hold_over_varying_shapes(fit)
    fit.no_cache.enabled = True  # the candidates, eager's trial too, run as the plan will
    if pl_module.automatic_optimization and trainer.accumulate_grad_batches == 1:
        # Dynamo traces each parameter with its .grad: FSDP's bf16 grads left by the eager steps made every region
        # fall back ("grad_dtype 'BFloat16'"). Lightning would set them to None after this step's forward anyway.
        pl_module.zero_grad(set_to_none=True)
    if not fit.searching:
        plan = fit.candidates[0]
    elif fit.recorded is None:
        plan = fit.candidates[0]
        plan.reason = f"the network {fit.setting.target[0]!r} was not called in a training step, so nothing to measure"
    else:
        fit.decision_file = _decision_file(fit)
        cached = fit.decision_file.load([p.name for p in fit.candidates]) if fit.decision_file else None
        fit.decision = cached or _search(fit, trainer)
        plan = next(p for p in fit.candidates if p.name == fit.decision.winner)
        plan.reason = "from the cached decision" if fit.decision.cached else "chosen by measurement"
        announce(fit.decision, trainer.loggers if trainer.is_global_zero else [])
        if fit.decision_file is not None and trainer.is_global_zero:
            fit.decision_file.store(fit.decision)
    fit.recorded = None
    for loser in fit.candidates:
        if loser is not plan:
            loser.release()
    plan.install()
    fit.plan = plan
    if plan.name == "eager" and fit.decision is not None:
        fit.schedule.eager_steps = 0  # nothing runs but eager: an eager reference would measure eager against itself
        fit.schedule.plan_epoch(fit.steps, 1, 0)  # and the chunks already placed in this epoch go


def _decision_file(fit: FitState) -> DecisionFile | None:
    """Where the decision for the recorded inputs is cached, beside the compile cache (``None``: no cache)."""
    if fit.cache is None:
        return None
    return DecisionFile(fit.cache.directory, decision_key(fit.recorded, fit.varying_dims, fit.setting.world_size))


def _search(fit: FitState, trainer: pl.Trainer) -> Decision:
    name, module = fit.setting.target
    args, kwargs = fit.recorded
    cuda = fit.setting.device.type == "cuda"
    call = TrialCall(module, args, kwargs, context=trainer.precision_plugin.forward_context,
                     synchronize=torch.cuda.synchronize if cuda else lambda: None)  # fmt: skip
    # the trial's inputs are detached copies: give them the batch's dynamic dims, or the candidates compile for
    # other shapes than training then calls them with (one recompile of every candidate, at its first step)
    mark_region_inputs(compat.tree_leaves((call.args, call.kwargs)), fit.setting.policy.dynamic_sizes)
    # compiled candidates compile the varying dims as dynamic from their first call: no recompile per length
    fit.setting.policy.dynamic_sizes |= mark_dims((call.args, call.kwargs), fit.varying_dims)
    consensus = Consensus(lambda ok: bool(trainer.strategy.reduce_boolean_decision(ok, all=True)),
                          trainer.strategy.broadcast)  # fmt: skip
    deterministic = not _changes_in_training(module)
    search = PlanSearch(fit.candidates, consensus, reference=call.last if deterministic else None)
    with sandbox(module):
        return search.run(call)


def _hold_over_varying_shapes(fit: FitState) -> None:
    """Where the shapes recorded before the plan search vary, those dims are marked dynamic from now on and only
    the candidates that hold over them compete (no CUDA graphs without ``pad_buckets``); one line says so."""
    if not fit.shapes.varies:
        return
    fit.varying_dims = fit.shapes.varying_dims
    buckets = len(fit.options.pad_buckets or ())
    kept = for_varying_shapes(fit.candidates, buckets) if fit.searching else fit.candidates
    left_out = [plan for plan in fit.candidates if plan not in kept]
    for plan in left_out:
        plan.release()
    fit.candidates = kept
    rank_zero_info(_varying_shapes_note(fit.shapes, [plan.name for plan in left_out], buckets))


def _varying_shapes_note(shapes: CallShapes, left_out: list[str], buckets: int) -> str:
    """What varying shapes change, and the ``pad_buckets`` that would hold the lengths seen (without buckets)."""
    lengths = shapes.sizes(1)
    seen = f" (lengths {lengths[0]}..{lengths[-1]})" if lengths else ""
    dims = sorted(shapes.varying_dims)
    marked = f"dim {dims[0]} is" if len(dims) == 1 else f"dims {', '.join(map(str, dims))} are"
    change = f"{marked} compiled as dynamic" if dims else "the calls' structure changes"
    note = f"FuseCallback: the network's input shapes vary between its first {shapes.calls} training calls{seen}: "
    note += change
    if left_out:
        note += f", and {', '.join(left_out)} (CUDA graphs, one recorded per shape) are left out of the search"
    if lengths and not buckets:
        note += (f". To run CUDA graphs over varying lengths, pad them to a few sizes: "
                 f"FuseCallback(pad_buckets={suggest_buckets(lengths)}) (from the lengths seen; extend it to your "
                 "longest sequence)")  # fmt: skip
    return note + "."


def end_epoch(fit: FitState, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """The epoch's scalars (and its plan's name), from all of its steps' times and the reference pool."""
    times = fit.timer.collect(include_skipped=True)  # all of the epoch's steps: the reference's cost is a share
    fit.pool.add(times.get(EAGER, []), trainer.current_epoch)  # an epoch without reference steps reuses the pool
    # eager against eager is no speedup
    timing = summarize(times, reference=fit.pool.samples if fit.runs_compiled() else [],
                       reference_age=fit.pool.age(trainer.current_epoch) or 0)  # fmt: skip
    fit.compiled_ms = timing.step_ms or fit.compiled_ms
    fit.reference_ms, fit.train_ms = fit.reference_ms + timing.reference_ms, fit.train_ms + timing.train_ms
    return epoch_metrics(
        timing, fit.nominal_batch, fit.tracker.total_s, fit.tracker.total_recompiles,
        items_per_batch=float(sum(fit.items)) / len(fit.items) if fit.items else None,  # one sync
        flops_per_batch=fit.flops_per_batch, peak_flops=fit.peak_flops,
        extra=epoch_extras(fit, trainer, pl_module), plan=fit.plan_name(),
    )  # fmt: skip


def report(fit: FitState, trainer: pl.Trainer, history: list[dict[str, Any]]) -> str:
    """The fit's end: the summary with the verdict (Python logging, TensorBoard), and the verdict on the terminal,
    once (printed, unless a logging handler already wrote the summary there); returns the verdict."""
    verdict = fit.verdict(history)
    ran = fit.what_ran()
    log.info(summary_table(history, fit.tracker, ran, verdict=verdict))
    for logger in trainer.loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            text = summary_table(history, fit.tracker, ran, markdown=True, verdict=verdict)
            experiment.add_text("fuse/summary", text, global_step=trainer.current_epoch)
            experiment.flush()
    if not _logging_reaches_terminal(log):  # else (a Hydra run) the summary just logged showed it there
        print(f"\n{verdict}", flush=True)  # noqa: T201 - the fit's verdict, on a line of its own on the terminal
    return verdict


def _logging_reaches_terminal(logger: logging.Logger) -> bool:
    """Whether ``logger``'s INFO records are written to stdout or stderr by a handler (Hydra's console handler)."""
    terminal = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    current: logging.Logger | None = logger if logger.isEnabledFor(logging.INFO) else None
    while current is not None:
        if any(isinstance(handler, logging.StreamHandler) and handler.stream in terminal
               and handler.level <= logging.INFO for handler in current.handlers):  # fmt: skip
            return True
        current = current.parent if current.propagate else None
    return False


def epoch_extras(fit: FitState, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
    """The epoch's scalars beyond timing: GPU, memory, kernels, cache, graph breaks, what ran."""
    extra = fit.sampler.read_and_reset() if fit.sampler else {}
    if pl_module.device.type == "cuda":
        extra["peak_mem_gb"] = torch.cuda.max_memory_allocated(pl_module.device) / 1e9
    extra.update(_kernel_metrics(fit))
    if trainer.world_size > 1 and pl_module.device.type == "cuda":  # a collective: every rank calls it
        mine = torch.tensor(float(extra.get("gpu_util", float("nan"))), device=pl_module.device)
        extra.update(per_rank("gpu_util", trainer.strategy.all_gather(mine).flatten().tolist()))
    hits, misses = (now - start for now, start in zip(cache_counters(), fit.cache_at_start))
    graph = fit.graph
    if fit.buckets is not None:
        extra["pad_waste"] = fit.buckets.waste
    trees = fit.trees_recorded()
    if trees is not None:
        extra["graphs_recorded"] = float(trees[0])
    extra.update(cache_hits=hits, cache_misses=misses, graph_breaks=fit.tracker.total_graph_breaks,
                 compiled=float(fit.runs_compiled()),
                 plan_dropped=float(fit.dropped is not None),
                 graph_replays=float(graph.replays if graph is not None else 0))  # fmt: skip
    return extra


def _cudagraph_trees(device: torch.device) -> tuple[int, int]:
    """The CUDA graphs torch's cudagraph trees hold on ``device`` and inductor's cudagraph skips, so far in this
    process (:func:`compat.cudagraph_tree_stats`); ``(0, 0)`` off CUDA."""
    if device.type != "cuda":
        return 0, 0
    return compat.cudagraph_tree_stats(device.index if device.index is not None else torch.cuda.current_device())


def _kernel_metrics(fit: FitState) -> dict[str, float]:
    """The profiled kernel counts, once, in the epoch both windows finished."""
    if fit.profile_logged or not fit.profiles or not all(w.done for w in fit.profiles.values()):
        return {}
    fit.profile_logged = True
    compiled, eager = fit.profiles[COMPILED].result, fit.profiles[EAGER].result
    return {
        "kernels_per_step": compiled.kernels_per_step,
        "eager_kernels_per_step": eager.kernels_per_step,
        "gpu_busy_frac": compiled.gpu_busy_frac,
        "eager_gpu_busy_frac": eager.gpu_busy_frac,
    }


def _profiles(steps: int, device: torch.device) -> dict[str, ProfileWindow]:
    if not steps:
        return {}
    if device.type != "cuda":
        rank_zero_info("FuseCallback: `profile_steps` counts GPU kernels and needs a CUDA device; skipped.")
        return {}
    return {COMPILED: ProfileWindow(steps), EAGER: ProfileWindow(steps)}


@rank_zero_only
def _new_line() -> None:
    sys.stderr.write("\n")


def _is_sharded(trainer: pl.Trainer) -> bool:
    """FSDP shards parameters: the network cannot be run outside its wrapper, so no plan is measured there."""
    return "fsdp" in type(trainer.strategy).__name__.lower()
