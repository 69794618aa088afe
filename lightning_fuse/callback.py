"""FuseCallback: the Lightning hooks of a fit that compiles, measures and reports. The work lives in other modules.

The life of a fit: at fit start the regions are resolved and the candidate plans built (:mod:`~lightning_fuse.start`,
:mod:`~lightning_fuse.plan`); the first steps run eagerly, untimed, while the network's inputs are recorded; then the
plan is chosen by measurement on those inputs (:mod:`~lightning_fuse.choice`, :mod:`~lightning_fuse.search`) or
forced by explicit settings, and installed. Each step is timed (:mod:`~lightning_fuse.fit`,
:mod:`~lightning_fuse.timing`), a few run eagerly as the reference, a backward that raises under the plan drops it
and redoes the step (:mod:`~lightning_fuse.guard`), and a plan slower than eager over a window of steps is dropped
mid-epoch (:mod:`~lightning_fuse.running_guard`). Each epoch logs its scalars (:mod:`~lightning_fuse.measurement`);
the fit ends with one verdict line and a summary; at teardown the model is plain eager again. The hooks hand the
other modules what they need of the Trainer.

Example::

    >>> import lightning.pytorch as pl
    >>> trainer = pl.Trainer(callbacks=[FuseCallback()], logger=False, enable_progress_bar=False)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_fuse.choice import (
    Training,
    activate_plan,
    forget_a_cached_plan_without_its_graph,
    share_optimizer_verdict,
)
from lightning_fuse.fit import OUTPUTS_HELD, FitState
from lightning_fuse.measurement import end_epoch, log_epoch, report
from lightning_fuse.options import (
    AUTO,
    COMPILED_FROM_THE_START,
    RECOMPILE_LIMIT,
    REFERENCE_BUDGET,
    DimSpec,
    FuseOptions,
    Target,
)
from lightning_fuse.shapes import CompileTracker, DynamicDims
from lightning_fuse.start import plan_line, start_cache, start_fit

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_fuse.plan import Plan
    from lightning_fuse.running_guard import Window

SLOWER_THAN_EAGER = 0.9
"""With mode="auto", a plan whose epoch, or a running guard's window of steps, measures below this speedup is
dropped (margin for measurement noise)."""
CLEARLY_SLOWER = 1.0
"""With mode="auto", a plan whose epoch's interval lies wholly below this speedup is dropped too, once the pooled
reference is not thin (:attr:`~lightning_fuse.timing.ReferencePool.thin`): slower than eager beyond the noise the
interval measures, though above the margin."""


class FuseCallback(Callback):
    r"""Run the LightningModule's network with the fastest plan that works, and log how much faster it got.

    With ``mode="auto"`` the plan is chosen by measurement: after the fit's first eager steps each candidate (compiled
    regions with one CUDA graph over forward and backward, the whole network under ``torch.compile(mode=
    "reduce-overhead")``, compiled regions, the whole network compiled, eager) runs a few forward and backward passes
    on the run's own inputs, and the fastest that works and is clearly faster than eager is kept; the decision is
    stored with the compile cache.
    An explicit ``mode`` or ``targets``, or ``cuda_graph=True``, force a plan; ``cuda_graph=False`` leaves the plans
    that capture CUDA graphs out of the search. Compiling happens in place (``state_dict`` keys,
    hooks and classes never change). Where the first steps' input shapes vary, CUDA graph plans are left out
    (unless ``pad_buckets``), the varying dims compile as dynamic, and on CUDA the plan's steps and the eager
    reference's leave cuDNN attention out (it builds a plan per new length). With ``mode="auto"`` a plan measured slower
    than eager over a window of steps (:mod:`~lightning_fuse.running_guard`) or over an epoch is dropped and the
    fit trains eagerly. Every epoch logs ``fuse/speedup`` against eager steps measured in the same run,
    with its interval, and ``fuse/step_ms`` and friends; the fit ends with one verdict line.

    Args:
        targets: What to compile as regions: ``"auto"`` (the repeated blocks; the whole model where there are none),
            ``"full"``, dotted-name globs (``"model.blocks.*"``), class names, classes, or a list of those.
        exclude: Modules to keep eager, in the same forms.
        mode: ``"auto"`` (the plan chosen by measurement) or a ``torch.compile`` mode for the regions: ``"default"``,
            ``"reduce-overhead"``, ``"max-autotune"``, ``"max-autotune-no-cudagraphs"``.
        backend: ``torch.compile`` backend, a name or a callable.
        fullgraph: Passed to ``torch.compile``.
        dynamic: Passed to ``torch.compile``.
        options: Inductor options passed to ``torch.compile`` in every plan, those with a mode such as
            reduce-overhead too (the mode's own options, the user's over them). ``{"fallback_random": True}`` draws
            eager's dropout masks, so that a fit retraces eager's (inductor's own random kernels draw others).
        cuda_graph: One CUDA graph over the network's forward and backward: ``"auto"`` (measured), ``True``
            (forced, with the regions) or ``False`` (no plan captures graphs; the rest are measured).
        optimizer_graph: Under a compiled plan on CUDA, capture the optimizer's update (Adam, AdamW, fused SGD),
            Lightning's gradient clipping with it, in a CUDA graph and keep it where whole steps measure faster with it
            (:mod:`~lightning_fuse.optimizer_graph`); ``False``: the optimizer steps as it always does.
        dynamic_dims: ``"auto"`` marks the batch dim dynamic when the loader can yield a partial last batch; ``None``
            marks nothing; or a mapping such as ``{"input_ids": [0, 1]}``.
        verify: Compare each region's first compiled output with eager; a region that disagrees runs eagerly. A
            training call that draws random numbers (dropout) is checked on its first eval call instead.
        cache_dir: Compile cache root; ``None`` uses ``~/.cache/lightning_fuse``, ``False`` disables persistence.
        recompile_limit: Recompiles a region may make (counted per code object, as torch counts: a region whose
            code breaks into several frames may recompile each) before ``on_recompile_limit`` applies.
        on_recompile_limit: ``"eager"`` (new kinds of input run eagerly, those compiled for still run compiled) or
            ``"dynamic"`` (compile it with ``dynamic=True`` once, then as ``"eager"``).
        warmup_steps: Steps of the plan kept out of the timing after it is installed (``None``: 1, or 3 with a graph).
        eager_steps: At most this many timed eager reference steps per epoch; ``0`` turns the measurement off.
        reference_budget: The share of the fit's training time the eager reference may cost (default 2%).
        gpu_sample_hz: NVML sampling rate for GPU utilisation; ``0`` disables it.
        profile_steps: Once per fit, profile this many compiled and eager steps (CUDA only; ``0``: off).
        length_fn: ``batch -> number of items`` (e.g. tokens) to log ``fuse/items_per_s``.
        pad_buckets: Opt-in: pad each dict batch's sequence dim up to the smallest of these lengths, where padding
            is exact (attention mask 0, labels -100; see :mod:`~lightning_fuse.buckets`), so a fit with varying
            lengths compiles and captures once per bucket; ``fuse/pad_waste`` reports the padding's cost.

    Raises:
        ValueError: If an argument is out of range or options conflict; at fit start, if a target or exclude
            pattern matches no module; at the first batch, if ``dynamic_dims`` names a key the batch lacks.
        TypeError: If an argument has the wrong type.

    Example::

        >>> import lightning.pytorch as pl
        >>> from lightning_fuse import FuseCallback
        >>> trainer = pl.Trainer(callbacks=[FuseCallback(targets="model.blocks.*", exclude="model.head")],
        ...                      logger=False, enable_checkpointing=False, enable_progress_bar=False)
    """

    def __init__(
        self,
        targets: Target | Sequence[Target] = AUTO,
        exclude: Target | Sequence[Target] = (),
        mode: str = AUTO,
        backend: str | Callable[..., Any] = "inductor",
        fullgraph: bool = False,
        dynamic: bool | None = None,
        options: Mapping[str, Any] | None = None,
        cuda_graph: bool | str = AUTO,
        optimizer_graph: bool = True,
        dynamic_dims: str | DimSpec | None = AUTO,
        verify: bool = True,
        cache_dir: str | os.PathLike | bool | None = None,
        recompile_limit: int = RECOMPILE_LIMIT,
        on_recompile_limit: str = "eager",
        warmup_steps: int | None = None,
        eager_steps: int = 20,
        reference_budget: float = REFERENCE_BUDGET,
        gpu_sample_hz: float = 10.0,
        profile_steps: int = 0,
        length_fn: Callable[[Any], int] | None = None,
        pad_buckets: Sequence[int] | None = None,
    ) -> None:
        self.options = FuseOptions(
            targets=targets, exclude=exclude, mode=mode, backend=backend, fullgraph=fullgraph, dynamic=dynamic,
            options=options, cuda_graph=cuda_graph, optimizer_graph=optimizer_graph, dynamic_dims=dynamic_dims,
            verify=verify, cache_dir=cache_dir, recompile_limit=recompile_limit, on_recompile_limit=on_recompile_limit,
            warmup_steps=warmup_steps, eager_steps=eager_steps, reference_budget=reference_budget,
            gpu_sample_hz=gpu_sample_hz, profile_steps=profile_steps, length_fn=length_fn, pad_buckets=pad_buckets,
        )  # fmt: skip
        self.dims = DynamicDims(self.options.dynamic_dims)
        self.history: list[dict[str, Any]] = []
        self.resumed_plan: str | None = None  # the plan of the checkpoint this fit resumed from, if any
        self.fit = FitState()
        self._eager_step = False  # the running training step runs eagerly because FuseCallback runs it so
        self.verdict: str | None = None  # the last fit's result in one line (on rank zero)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(targets=repr(self.options.targets), mode=self.options.mode)

    @property
    def plan(self) -> Plan | None:
        """The plan in force (``None`` before it is chosen)."""
        return self.fit.plan

    @property
    def tracker(self) -> CompileTracker:
        return self.fit.tracker

    @property
    def decision(self):
        """The plan search's decision: the winner and every candidate's trial (``None`` before, or when forced)."""
        return self.fit.decision

    @property
    def cache(self):
        """The fit's compile cache (``None`` with ``cache_dir=False``)."""
        return self.fit.hooks.cache

    @property
    def fallbacks(self) -> dict[str, str]:
        """Regions that ran eagerly after a failure, with the reason (complete once the plan is uninstalled)."""
        return self.fit.fallbacks

    @property
    def compiled_regions(self) -> list[str]:
        """Names of the regions running compiled right now."""
        return self.fit.plan.compiled_regions if self.fit.plan is not None else []

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ddp = isinstance(trainer.strategy.model, DistributedDataParallel)  # DDP's wrapper, not DeepSpeed's or FSDP's
        self.fit = start_fit(self.options, pl_module, world_size=trainer.world_size,
                             precision=trainer.precision_plugin, ddp=ddp)  # fmt: skip
        precision = str(trainer.precision_plugin.precision)
        self.fit.hooks.cache = start_cache(self.options, self.fit, trainer.strategy.barrier, precision)
        rank_zero_info(plan_line(self.fit, pl_module))

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fit.begin_epoch(_batches_to_run(trainer), pl_module.device)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        rescue = self.fit.hooks.rescue
        if rescue is not None and rescue.reason is not None:  # before the plan, or in a reference step
            self._compile_from_here(trainer, pl_module, rescue.reason)
        fit = self.fit
        fit.timer.start()  # this step's start is the last step's end
        if batch_idx == 0:  # after every callback's epoch-end and epoch-start hooks
            fit.renew_graphs_if_model_changed()
        if fit.hooks.buckets is not None:
            fit.hooks.buckets(batch)  # in place: training_step receives this very batch
        fit.mark_dynamic(self.dims, batch, "train", lambda: trainer.train_dataloader)
        if fit.steps == fit.activation_step:
            activate_plan(fit, _training(trainer), pl_module)
            # the dims it found varying, on this step's batch too: else the plan's first call compiles it static
            fit.mark_dynamic(self.dims, batch, "train", lambda: trainer.train_dataloader)
            fit.warn_if_resumed_under_another_plan(self.resumed_plan)
            fit.timer.interrupt()  # the search is not training time: the reference's budget is a share of that
            fit.timer.start()
        # Lightning steps the optimizer after every accumulate_grad_batches-th batch (and an epoch's last): an
        # iteration starts at the batch after
        iteration_start = batch_idx % trainer.accumulate_grad_batches == 0
        if iteration_start:
            self._end_trees_holding_outputs(trainer)
            self._end_trees_that_failed()
        # and zeroes the gradients then, between the training step's forward and its backward
        zeroed_after_forward = iteration_start and pl_module.automatic_optimization
        fit.begin_step(batch, batch_idx, self.options.length_fn, iteration_start, zeroed_after_forward)
        self._eager_step = fit.plan is None or (fit.runs_compiled() and fit.schedule.is_eager(fit.steps))

    def _compile_from_here(self, trainer: pl.Trainer, pl_module: pl.LightningModule, reason: str) -> None:
        """Eager refused a call of the network for its size (:class:`~lightning_fuse.guard.EagerRescue`): the fit
        goes on as one started with :data:`COMPILED_FROM_THE_START` would, from this step (and so do later fits)."""
        compiled_s = self.fit.tracker.total_s  # the rescue's compile among them: the fit's compile time counts it
        self.fit.close()
        self.options = replace(self.options, **COMPILED_FROM_THE_START)
        self.on_fit_start(trainer, pl_module)
        self.fit.tracker.total_s += compiled_s
        self.fit.unmeasured = "eager refused a call of the network for its size; the fit ran compiled from then on"
        self.fit.begin_epoch(_batches_to_run(trainer), pl_module.device)
        rank_zero_warn(f"FuseCallback: eager refused a call of the network for its size ({reason}); it ran compiled "
                       f"instead, and the fit goes on as FuseCallback({arguments(COMPILED_FROM_THE_START)}) runs "
                       "it: the whole network compiled, no eager step, so no speedup over eager is measured.")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        self._eager_step = False
        self._judge_window(trainer, self.fit.end_step())
        share_optimizer_verdict(self.fit, trainer.strategy.broadcast)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.fit.timer is not None:
            self.fit.timer.interrupt()  # the training step before validation would otherwise include it
            self.fit.pace.interrupt()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.fit.plan is not None:
            self.fit.plan.set_evaluating(False)

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        self.fit.mark_dynamic(self.dims, batch, "validate", lambda: trainer.val_dataloaders)
        if self.fit.plan is not None:
            self.fit.plan.set_evaluating(True)  # before each batch: a step of evaluation's for torch's graphs' sizes

    @override
    def on_test_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:  # fmt: skip
        self.fit.mark_dynamic(self.dims, batch, "test", lambda: trainer.test_dataloaders)

    # ------------------------------------------------------------------ epoch end
    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fit = self.fit
        if fit.timer is None:
            return
        gather = trainer.strategy.all_gather if trainer.world_size > 1 else None
        metrics = end_epoch(fit, trainer.current_epoch, pl_module.device, gather)
        speedup, high = self._rank_zeros(trainer, metrics)
        self._drop_plan_if_slower(trainer.current_epoch, speedup, high)
        metrics["fuse/plan_dropped"] = float(fit.dropped is not None)  # dropped at this epoch's end: this epoch's
        self.history.append({"epoch": float(trainer.current_epoch), **metrics})
        log_epoch(metrics, trainer.loggers, trainer.current_epoch)
        self._show_speedup(trainer, pl_module, speedup)

    def _rank_zeros(self, trainer: pl.Trainer, metrics: dict[str, Any]) -> tuple[float | None, float | None]:
        """Rank zero's speedup and the top of its interval (``None`` on a thin reference), on every rank: one
        collective an epoch, which every rank calls; they decide the plan and the progress bar shows them."""
        high = metrics.get("fuse/speedup_high") if not self.fit.pool.thin else None
        return trainer.strategy.broadcast((metrics.get("fuse/speedup"), high))

    @staticmethod
    def _show_speedup(trainer: pl.Trainer, pl_module: pl.LightningModule, speedup: float | None) -> None:
        """The progress bar's ``fuse/speedup`` (rank zero's, :meth:`_rank_zeros`): with several processes Lightning
        reduces an epoch-level value across ranks, a collective, and warns when it is not asked to (wherever a process
        group exists, one process's included)."""
        if speedup is not None:
            group = torch.distributed.is_available() and torch.distributed.is_initialized()
            sync = trainer.world_size > 1 or group
            pl_module.log("fuse/speedup", speedup, prog_bar=True, logger=False, sync_dist=sync)

    def _drop_plan_if_slower(self, epoch: int, speedup: float | None, high: float | None) -> None:
        """With ``mode="auto"``, a plan the epoch measured slower than eager is dropped: below the margin, or with
        its whole interval below :data:`CLEARLY_SLOWER` (``high``: ``None`` on a thin reference); rank zero's
        measurement decides (:meth:`_rank_zeros`)."""
        if not self._plan_is_judged():
            return
        when = f"in epoch {epoch}"
        self._drop_plan_below_margin(speedup, when, epoch)
        if high is not None and high < CLEARLY_SLOWER and self.fit.plan.name != "eager":
            self.fit.drop_plan(f"it measured {speedup:.2f}x of eager {when}, its interval wholly below "
                               f"{CLEARLY_SLOWER}x (up to {high:.2f}x)", epoch)  # fmt: skip

    def _judge_window(self, trainer: pl.Trainer, window: Window | None) -> None:
        """The running guard: at each window's end (``window``, its plan steps), with ``mode="auto"``, a plan under
        torch's CUDA graphs that met more sizes than they record runs its compiled code without them from then on
        (:meth:`~lightning_fuse.fit.FitState.stop_trees`), and a plan whose mean step was slower than eager's is
        dropped mid-epoch; rank zero's word decides (one collective per window, on the same step on every rank)."""
        if window is None or not self._plan_is_judged():
            return
        speedup, sizes_full = trainer.strategy.broadcast((self.fit.speedup_over_window(window),
                                                          self.fit.plan.sizes_full))  # fmt: skip
        if sizes_full:  # the window measured the plan under its graphs
            self.fit.stop_trees(store=trainer.is_global_zero)
            return
        where = f"over its last {self.fit.pace.window} steps in epoch {trainer.current_epoch}"
        eager_ms = self.fit.eager_step_ms()
        compiles_counted = eager_ms is not None and len(window.judged(eager_ms)) > len(window.steady)
        how = ("(mean step, the slowest tenth left out; its compiling steps counted, as the steps between them ran "
               "no faster than eager or they were half of it)" if compiles_counted
               else "(mean step, compiling steps and the slowest tenth left out)")
        self._drop_plan_below_margin(speedup, f"{where} {how}", trainer.current_epoch)

    def _end_trees_holding_outputs(self, trainer: pl.Trainer) -> None:
        """torch's cudagraph trees free a training step's outputs when the next step begins (reading them then
        fails). Where the last step's are still held, before this step begins: the plan hands over to the same
        compile without graphs, or, with no such candidate (a forced mode), is dropped
        (:meth:`~lightning_fuse.fit.FitState.leave_trees`). Each rank decides by itself: it is its own outputs that
        its training step held."""
        fit = self.fit
        if fit.plan is None or not fit.plan.outputs_held:
            return
        dropped = f"torch's CUDA graphs under it {OUTPUTS_HELD.what}. {OUTPUTS_HELD.advice} Or use mode='default'"
        fit.leave_trees(OUTPUTS_HELD, dropped, trainer.current_epoch, store=trainer.is_global_zero)

    def _end_trees_that_failed(self) -> None:
        """A region's call failed in torch's cudagraph trees under the plan (it ran eagerly for the rest of that
        step, :attr:`~lightning_fuse.plan.Plan.trees_failure`): before this step begins, the plan hands over to the
        same compile without them, as for a failure in backward (:meth:`~lightning_fuse.fit.FitState.fail_plan`).
        Each rank decides by itself, as its own call failed."""
        if self.fit.plan is not None and self.fit.plan.trees_failure is not None:
            self.fit.fail_plan(self.fit.plan.trees_failure)

    def _plan_is_judged(self) -> bool:
        """With ``mode="auto"``, a plan of FuseCallback's own. The same on every rank, even where one rank alone
        dropped its plan, so that the collective deciding it is called on all of them."""
        plan = self.fit.plan
        return self.options.mode == AUTO and plan is not None and plan.owned

    def _drop_plan_below_margin(self, speedup: float | None, when: str, epoch: int) -> None:
        if speedup is not None and speedup < SLOWER_THAN_EAGER and self.fit.plan.name != "eager":
            self.fit.drop_plan(f"it measured {_below(speedup)}x of eager {when}, under the {SLOWER_THAN_EAGER}x kept",
                               epoch)  # fmt: skip

    # ------------------------------------------------------------------ fit end
    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.verdict = report(self.fit, self.history, trainer.loggers, trainer.current_epoch)
            forget_a_cached_plan_without_its_graph(self.fit)
        if self.fit.hooks.cache is not None and trainer.is_global_zero:
            self.fit.hooks.cache.save()
            self.fit.hooks.cache.warn_if_bypassed(since=self.fit.cache_at_start)

    # ------------------------------------------------------------------ undo
    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        where = self._where_it_ran_eagerly(trainer.sanity_checking)
        rescued = self.fit.hooks.rescue is not None and self.fit.hooks.rescue.reason is not None
        if isinstance(exception, RuntimeError) and where is not None and not rescued:  # else it ran compiled too
            rank_zero_warn(_ran_eagerly(where, exception))
        self._restore()

    def _where_it_ran_eagerly(self, sanity_checking: bool) -> str | None:
        """Where the fit is, if it runs the network eagerly because FuseCallback runs it so (``None``: it does not)."""
        fit = self.fit
        if fit.setting is not None and fit.plan is None and sanity_checking:
            return "in the sanity check, which runs before the plan is installed"
        if self._eager_step and fit.plan is None:
            return f"at step {fit.steps}, one of the first {fit.activation_step}, which run eagerly before the plan"
        return f"at step {fit.steps}, an eager reference step, which measures the speedup" if self._eager_step else None

    def _restore(self) -> None:
        """Leave the model exactly as it was before fit: eager, unpatched, with torch's settings restored."""
        self.fit.close()

    # ------------------------------------------------------------------ checkpointing
    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:  # fmt: skip
        for state, graph in zip(checkpoint.get("optimizer_states", []), self.fit.optimizer_graphs, strict=False):
            if graph is not None:
                graph.as_saved_without(state)

    @override
    def state_dict(self) -> dict[str, Any]:
        plan = self.fit.plan.describe() if self.fit.plan else self.resumed_plan
        return {"history": [dict(row) for row in self.history], "plan": plan}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [dict(row) for row in state_dict.get("history", [])]
        self.resumed_plan = state_dict.get("plan")


def _below(speedup: float) -> str:
    """``speedup`` with the digits that show it below the margin (0.8956 reads 0.896, not 0.90).

    Example::

        >>> _below(0.8956), _below(0.5)
        ('0.896', '0.50')
    """
    for digits in (2, 3, 4):
        if round(speedup, digits) < SLOWER_THAN_EAGER:
            return f"{speedup:.{digits}f}"
    return f"{speedup:.6f}"


def _ran_eagerly(where: str, exception: BaseException) -> str:
    """What to do where the fit raised while FuseCallback ran the network eagerly (``where``: its first steps, an
    eager reference step, or the sanity check): a model may run compiled where it cannot run eagerly (eager's
    memory, or a kernel's limit that :class:`~lightning_fuse.guard.EagerRescue` did not meet: several processes).

    Example::

        >>> _ran_eagerly("at step 0", RuntimeError("boom")).split(". ")[0]
        'FuseCallback: the fit raised (RuntimeError) at step 0, where the network ran eagerly'
    """
    return (f"FuseCallback: the fit raised ({type(exception).__name__}) {where}, where the network ran eagerly. If "
            "your model runs under torch.compile but not eagerly (eager's memory, or a kernel's limit), start "
            f"on a compiled plan with no eager step: FuseCallback({arguments(COMPILED_FROM_THE_START)}), with "
            "Trainer(num_sanity_val_steps=0).")


def arguments(kwargs: Mapping[str, Any]) -> str:
    """``kwargs`` as they are written in a call.

    Example::

        >>> arguments({"mode": "default", "eager_steps": 0})
        "mode='default', eager_steps=0"
    """
    return ", ".join(f"{name}={value!r}" for name, value in kwargs.items())


def _training(trainer: pl.Trainer) -> Training:
    """What the plan's choice needs from ``trainer``."""
    strategy = trainer.strategy
    return Training(accumulate_grad_batches=trainer.accumulate_grad_batches, is_global_zero=trainer.is_global_zero,
                    loggers=trainer.loggers, optimizers=trainer.optimizers, precision=trainer.precision_plugin,
                    reduce_all=lambda ok: bool(strategy.reduce_boolean_decision(ok, all=True)),
                    broadcast=strategy.broadcast,
                    fsdp_root=strategy.model if isinstance(strategy, FSDPStrategy) else None)  # fmt: skip


def _batches_to_run(trainer: pl.Trainer) -> float:
    """The training batches this epoch will run: its own, or fewer where ``max_steps`` ends the fit first (so that
    the epoch's reference chunks fall within the steps that run)."""
    if trainer.max_steps < 0:
        return trainer.num_training_batches
    left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
    return min(trainer.num_training_batches, max(left, 1))
