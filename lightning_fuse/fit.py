"""The state of one fit, made new at every fit start, and the bookkeeping of its epochs and steps.

:class:`FitState` holds what a fit learns as it goes (the plan in force, the timer, the reference schedule, the search's
decision) and what it put on the model and torch (:mod:`~lightning_fuse.hooks`: the recorded inputs, the compile cache
among them), so that a callback reused for a second ``fit`` starts from nothing. Each training step is opened by
:meth:`FitState.begin_step` (what the step is, the contexts it runs in) and closed by :meth:`FitState.end_step` (its
time recorded, its contexts left); :meth:`FitState.close` undoes everything the fit changed. The fit is set up by
:mod:`~lightning_fuse.start`, its plan chosen by :mod:`~lightning_fuse.choice`, and what it measured summed up by
:mod:`~lightning_fuse.measurement`.

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

from lightning_fuse.hooks import FitHooks
from lightning_fuse.meters import GpuMeters, cudagraph_trees
from lightning_fuse.plan import WITHOUT_GRAPHS, Plan, Setting, plan_graphs
from lightning_fuse.running_guard import BEFORE, EXCUSED_RECORDINGS, PLAN, RunningGuard, Window, window_speedup
from lightning_fuse.shapes import (CompileTracker, DynamicDims, batch_size, can_yield_partial_batch, count_items,
                                   mark_dims)
from lightning_fuse.timing import (COMPILED, EAGER, LEAD_IN, SKIPPED, UNKNOWN_EPOCH_STEPS, EagerSchedule,
                                   ReferencePool, StepTimer)

if TYPE_CHECKING:
    from lightning_fuse.decision import Decision, DecisionFile
    from lightning_fuse.optimizer_graph import OptimizerGraph


@dataclass(frozen=True)
class Handover:
    """Why a plan under torch's cudagraph trees leaves them: it hands over to the same compile without them
    (:meth:`FitState.hand_over`) or, past their cap of sizes, stops them (:meth:`FitState.stop_trees`). What the trees
    met, the plan's reason in the verdict, what the user can do."""

    what: str
    reason: str
    advice: str
    failed: bool = False
    """A step failed under the trees: said as a warning, where the other handovers are information."""


SIZES_FULL = Handover(
    "met more input sizes than one fit records graphs for, and steps under them then ran slower than without them",
    "its graphs reached their cap of sizes",
    "Pad the lengths to a few sizes with `pad_buckets` to keep every step in a graph.")
OUTPUTS_HELD = Handover(
    "free a step's outputs when the next step begins, and this fit keeps its steps' outputs (for an epoch-end "
    "metric, say), which reading would then fail", "its steps' outputs were kept past the step",
    "Keep copies (`.detach().clone()`) to keep the graphs.")


@dataclass
class FitState:
    """Everything one fit of FuseCallback learns; a new one at every fit start
    (:func:`~lightning_fuse.start.start_fit`).

    Example::

        >>> FitState().what_ran()
        'eager (no plan was installed)'
    """

    setting: Setting | None = None
    candidates: list[Plan] = field(default_factory=list)
    searching: bool = False
    plan: Plan | None = None
    decision: Decision | None = None
    dropped: str | None = None
    dropped_in_epoch: int | None = None
    unmeasured: str | None = None  # why no eager step runs, where the fit learned it (verdict_line's ``unmeasured``)
    tracker: CompileTracker = field(default_factory=CompileTracker)
    hooks: FitHooks = field(default_factory=FitHooks)
    """What the fit puts on the model and on torch (:mod:`~lightning_fuse.hooks`), taken off by :meth:`close`."""
    gpu: GpuMeters = field(default_factory=GpuMeters)
    """What the fit measures of the GPU besides step times (:mod:`~lightning_fuse.meters`)."""
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
    recording_steps: int = 0
    """Steps so far in which torch's cudagraph trees recorded a graph (the first
    :data:`~lightning_fuse.running_guard.EXCUSED_RECORDINGS` are left out of the timing as a one-time cost)."""
    step_context: ExitStack = field(default_factory=ExitStack)
    """The running step's contexts: the eager stance, the plan's modules bypassed, the FLOP counter."""
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
    varying_dims: set[int] = field(default_factory=set)
    """The dims the shapes of the first training calls varied in: marked dynamic on every batch once the plan is
    chosen, but for :attr:`static_sizes`."""
    static_sizes: dict[int, set[int]] = field(default_factory=dict)
    """Per varying dim, the sizes it held only in inputs where it never varied: not marked."""
    pace: RunningGuard = field(default_factory=RunningGuard)
    cache_at_start: tuple[int, ...] = (0, 0, 0)  # torch's compile-cache lookups at fit start: a cache.CacheCounts
    trees_at_start: tuple[int, int] = (0, 0)
    """torch's cudagraph trees at fit start: the graphs they held and inductor's cudagraph skips, on the fit's device
    (:func:`~lightning_fuse.meters.cudagraph_trees`); both are process-wide, so the fit's own are what was added
    since."""
    fallbacks: dict[str, str] = field(default_factory=dict)
    decision_file: DecisionFile | None = None
    """Where the plan search's decision is cached (``None``: no cache, or no search)."""
    optimizer_graph: bool = True
    """Whether the optimizers' updates may be captured (FuseCallback's ``optimizer_graph``)."""
    optimizer_graphs: list[OptimizerGraph | None] = field(default_factory=list)
    """Each optimizer's captured update, in the Trainer's order (``None``: it steps as always)."""
    optimizer_verdict_pending: bool = False
    """Several processes: rank zero's optimizer-graph trial has yet to decide every rank's graphs."""
    capture_optimizer: Any = None
    """How an optimizer's update is captured (``None``: in a CUDA graph; a test on CPU fakes it)."""
    renewed_graphs: int = 0
    """Times the CUDA graphs were captured again over a model whose state changed between epochs."""

    @property
    def reference_cost(self) -> float | None:
        """The eager reference's share of the fit's training time so far (``None`` before any step was timed)."""
        return self.reference_ms / self.train_ms if self.train_ms else None

    def plan_name(self) -> str:
        return self.plan.name if self.plan is not None else "eager"

    def plan_shortfall(self) -> str | None:
        """What of the plan in force did not happen, for the verdict (:meth:`what_ran` says why): its graph not
        captured, its regions fallen back to eager; ``None`` where it runs as named."""
        return (", ".join(self.plan.shortfall) or None) if self.plan is not None else None

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
        compiled = self.runs_compiled()
        self.hooks.set_plan_step(not eager and compiled, reference=eager and compiled)
        timed, profiled = self.step_timing(eager, size)
        self.step_kind = (EAGER if eager else COMPILED) if timed else SKIPPED
        if self.schedule.is_lead_in(self.steps):
            self.step_kind = LEAD_IN  # untimed, but part of the reference's cost
            self.timer.wait_for_device()  # the chunk's timed steps then run at eager's pace, not the plan's queue's
        if length_fn is not None:
            items = count_items(length_fn, batch)  # every batch, so a bad length_fn fails on the first
            if self.step_kind != SKIPPED:
                self.items.append(items)
        self.step_compiles, self.step_recordings = self.tracker.total_compiles, self.tracker.recordings
        # the running guard times the plan's steps, eager's reference chunks and the eager steps before the plan
        if not eager and self.pace.in_eager_run:  # a chunk's steps end where the device has run them; this step's
            self.timer.wait_for_device()  # mark is queued already, so the wait lengthens no timed eager step
            self.pace.close_run()
        self.pace.begin(BEFORE if self.plan is None else PLAN if not eager else self.step_kind)
        for graph in plan_graphs(self.plan):
            graph.begin_step(zeroed_after_forward)
        for graph in filter(None, self.optimizer_graphs):
            graph.enabled = not eager  # an eager reference step's update is the optimizer's own
        if eager:
            self._enter_eager(count_flops=self.gpu.needs_flops() and not timed and not profiled)
        elif iteration_start:
            self.plan.step_begin()
        self.hooks.guard.arm(batch, batch_idx, armed=not eager and self.plan.owned)

    def _enter_eager(self, count_flops: bool) -> None:
        self.step_context.enter_context(torch.compiler.set_stance("force_eager"))  # anything compiled elsewhere
        if self.plan is not None:  # a reference step
            self.step_context.enter_context(self.hooks.eager_reference(self.plan.bypassed()))
        if count_flops:
            self.gpu.count_flops(self.step_context)

    def step_timing(self, eager: bool, size: int) -> tuple[bool, bool]:
        """Whether this step is timed, and whether it is profiled (profiled steps are never timed)."""
        profiles = self.gpu.profiles
        if eager:
            timed = self.schedule.is_timed(self.steps)
            profile = profiles[EAGER] if profiles and self.schedule.is_profiled(self.steps) else None
        else:
            timed = self.steps >= self.activation_step + self.warmup
            window = profiles.get(COMPILED)
            profile = window if timed and window is not None and not window.done else None
        if profile is not None:
            profile.step_start()
        self.gpu.profile = profile
        return timed and size == self.nominal_batch and profile is None, profile is not None

    def end_step(self) -> Window | None:
        """Close the step :meth:`begin_step` opened: its time recorded (a step that compiled, captured a graph of
        ours or recorded one of torch's cudagraph trees is kept out, recording ones up to
        :data:`~lightning_fuse.running_guard.EXCUSED_RECORDINGS` a fit), its contexts left; at the end of a running
        guard's window, that window's plan step times (:meth:`~lightning_fuse.running_guard.RunningGuard.end`)."""
        compiled_now = self.tracker.total_compiles != self.step_compiles
        recorded_now = self.tracker.recordings != self.step_recordings
        self.recording_steps += recorded_now
        excused = recorded_now and self.recording_steps <= EXCUSED_RECORDINGS
        captured_now = any(graph.captured_during_last_call for graph in plan_graphs(self.plan))
        self.timer.stop(SKIPPED if compiled_now or excused or captured_now else self.step_kind)
        if compiled_now or recorded_now:  # a one-time cost, which the optimizer graph's trial leaves out too
            for optimizer_graph in filter(None, self.optimizer_graphs):
                optimizer_graph.leave_step_untimed()
        if self.gpu.profile is not None:
            self.gpu.profile.step_end()
        self.close_step_context()
        self.steps += 1
        if self.plan is None:  # the running guard's eager step before the plan ends where its device work does
            self.timer.wait_for_device()
        return self.pace.end(judged=not excused, one_time=compiled_now or captured_now)

    def renew_graphs_if_model_changed(self) -> None:
        """At an epoch's first step: where the model's parameters or buffers were renamed or given new storage
        since the last epoch's (:mod:`~lightning_fuse.module_state`), the CUDA graphs captured over them, the
        plan's and the optimizers', are dropped, to be captured again over the model as it is; said once."""
        if self.hooks.state is None or not self.hooks.state.changed():
            return
        graphs = [graph for graph in (*plan_graphs(self.plan), *self.optimizer_graphs) if graph and graph.captured]
        for graph in graphs:
            graph.release()
        if graphs and not self.renewed_graphs:
            rank_zero_info("FuseCallback: the model's parameters or buffers were renamed or given new storage since "
                           "the last epoch (as Lightning's ModelPruning, and StochasticWeightAveraging's BatchNorm "
                           "update, do): its CUDA graphs, which replay the old ones, are captured again.")  # fmt: skip
        self.renewed_graphs += bool(graphs)

    def close_step_context(self) -> None:
        """Leave the running step's contexts, keeping the FLOPs it counted."""
        self.step_context.close()
        self.gpu.keep_flops()

    def mark_dynamic(self, dims: DynamicDims, batch: Any, stage: str, loaders: Callable[[], Any]) -> None:
        """Mark the batch's varying dims dynamic for the regions (the loaders are read once per stage)."""
        partial = self.partial_possible.get(stage)
        if partial is None:
            partial = self.partial_possible[stage] = can_yield_partial_batch(loaders())
        marked = mark_dims(batch, self.varying_dims, self.static_sizes)
        self.setting.policy.dynamic_sizes = dims.apply(batch, partial) | marked

    def eager_step_ms(self) -> float | None:
        """Eager's whole step for the running guard: the reference chunks it timed, else the reference pool's
        median (earlier epochs), else the eager steps before the plan (each timed to its device's end,
        :mod:`~lightning_fuse.running_guard`). Never the search's eager trial: it times
        the forward and backward alone, and beside a step whose optimizer takes long every plan would look slow."""
        return self.pace.eager_ms() or self.pool.median() or self.pace.before_ms()

    def speedup_over_window(self, window: Window) -> float | None:
        """The running guard's speedup over a closed ``window`` of plan steps (``None``: not judged, the
        window was mostly the eager reference, or eager's step is unknown)."""
        return window_speedup(window, self.eager_step_ms(), least=self.pace.window // 2)

    # ------------------------------------------------------------------ what ran
    def what_ran(self) -> str:
        """The plan in force at the end, and what became of its graph and regions."""
        parts = [self.plan.describe() if self.plan is not None else "eager (no plan was installed)"]
        if self.dropped:
            parts.append(f"plan dropped: {self.dropped}")
        graphs = self.plan.graphs_line() if self.plan is not None else None
        if graphs is not None:
            parts.append(graphs)
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
            rank_zero_warn(f"FuseCallback: the checkpoint's epochs were measured under plan {resumed!r}, this run "
                           f"uses {self.plan.describe()!r}; fuse/* from before and after the resume compare different "
                           "setups.")  # fmt: skip

    # ------------------------------------------------------------------ dropping the plan, undoing the fit
    def drop_plan(self, reason: str, epoch: int | None = None) -> None:
        """Take the plan off: the rest of the fit trains eagerly (or as the user compiled it, where they did), with
        one warning (on a line of its own) saying why; ``epoch``: the (Lightning) epoch it was dropped in, for the
        verdict."""
        rest = next((plan for plan in self.candidates if not plan.owned), Plan())  # the user's compile, if any
        how = "the rest of the fit " + ("trains eagerly" if rest.owned else "runs the model as the user compiled it")
        _warn_on_a_line_of_its_own(f"FuseCallback: plan {self.plan_name()!r} dropped, {how}: {reason}.")
        self.uninstall_plan()
        self.plan, self.dropped, self.dropped_in_epoch = rest, f"{reason} (step {self.steps})", epoch
        if self.decision_file is not None:  # the next run measures again rather than start with a dropped plan
            self.decision_file.forget()

    def fail_plan(self, reason: str) -> bool:
        """A step under the plan raised (``reason``; in backward: :class:`~lightning_fuse.guard.BackwardGuard`). A
        plan under torch's cudagraph trees hands over to the same compile without them (:meth:`leave_trees`; once,
        as that one runs no trees): the trees' own failures, such as a recording that "observed an input tensor
        deallocate" in Bloom's backward on an H200, then cost the graphs and not the compile. Any other plan is
        dropped. Returns whether a plan still runs."""
        failed = Handover(f"failed ({reason})", f"under torch's CUDA graphs, {reason}", "", failed=True)
        return self.leave_trees(failed, reason, store=rank_zero_only.rank == 0)

    def leave_trees(self, why: Handover, dropped: str, epoch: int | None = None, store: bool = True) -> bool:
        """The plan leaves torch's cudagraph trees for ``why``: it hands over to the same compile without them where
        the fit made that candidate (:meth:`hand_over`, ``store`` as there), else it is dropped saying ``dropped``
        (:meth:`drop_plan`, ``epoch`` as there). Returns whether a plan still runs."""
        if (successor := self.graphless_candidate()) is None:
            self.drop_plan(dropped, epoch)
            return False
        self.hand_over(successor, why, store=store)
        return True

    def candidate(self, name: str) -> Plan | None:
        """The fit's candidate plan of this name (``None``: none was made)."""
        return next((plan for plan in self.candidates if plan.name == name), None)

    def graphless_candidate(self) -> str | None:
        """The fit's candidate that compiles what the plan does without torch's cudagraph trees
        (:data:`~lightning_fuse.plan.WITHOUT_GRAPHS`); ``None`` where the plan runs no trees or none was made."""
        names = WITHOUT_GRAPHS.get(self.plan_name(), ())
        return next((name for name in names if self.candidate(name) is not None), None)

    def stop_trees(self, why: Handover = SIZES_FULL, store: bool = True) -> None:
        """From the next step the plan's calls run its compiled code without torch's cudagraph trees: no graph is
        recorded or replayed, and nothing is compiled again (:meth:`~lightning_fuse.plan.Plan.stop_trees`); one line
        says ``why``. With ``store`` (rank zero's), the cached decision says so
        (:meth:`~lightning_fuse.decision.Decision.stopped_graphs`): the next run on the same inputs runs the plan
        without graphs from its first step, rather than record graphs again until their cap."""
        say = f"from step {self.steps} the plan runs its compiled code without graphs (nothing compiled again)"
        rank_zero_info(f"FuseCallback: torch's CUDA graphs under {self.plan_name()!r} {why.what}: {say}. {why.advice}")
        self.plan.stop_trees()
        self.plan.reason = f"{self.plan.reason}; no CUDA graphs from step {self.steps}: {why.reason}"
        if store and self.decision is not None and self.decision_file is not None:
            self.decision_file.store(self.decision.stopped_graphs(self.steps, why.reason))

    def hand_over(self, successor: str, why: Handover, store: bool = True) -> None:
        """From the next step the fit runs the candidate named ``successor`` (:meth:`graphless_candidate`), its
        optimizers' graphs kept; one line says ``why``. With ``store`` (rank zero's), the cached decision names
        ``successor`` from now on (:meth:`~lightning_fuse.decision.Decision.handed_over`): the next run on the same
        inputs starts there, rather than record graphs again and recompile when it hands over."""
        previous, plan = self.plan_name(), self.candidate(successor)
        say = _warn_on_a_line_of_its_own if why.failed else rank_zero_info
        say(f"FuseCallback: torch's CUDA graphs under {previous!r} {why.what}: from step {self.steps} the fit runs "
            f"{successor!r}, the same compile without graphs (compiled now, once). {why.advice}".rstrip())
        self.fallbacks.update(self.plan_fallbacks())
        self.plan.uninstall()
        self.plan.release()
        plan.reason = f"handed over from {previous!r} at step {self.steps}: {why.reason}"
        plan.install()
        self.plan = plan
        if store and self.decision is not None and self.decision_file is not None:
            self.decision_file.store(self.decision.handed_over(successor, self.steps, why.reason))

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
        self.gpu.stop()
        self.uninstall_plan()
        self.tracker.remove()
        self.hooks.remove()


@rank_zero_only
def _warn_on_a_line_of_its_own(message: str) -> None:
    """A warning not in the middle of the progress bar's line."""
    sys.stderr.write("\n")
    rank_zero_warn(message)
