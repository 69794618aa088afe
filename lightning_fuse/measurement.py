"""What a fit measures and what it makes of it: the step timer, the eager reference's schedule and the counters' values
at fit start; each epoch's ``fuse/`` scalars; at the fit's end, the verdict and the summary.

The scalars and the words are :mod:`~lightning_fuse.metrics`'; this module reads them off the fit's state
(:class:`~lightning_fuse.fit.FitState`) and hands them to the Trainer's loggers.

Example::

    >>> from lightning_fuse.fit import FitState
    >>> from lightning_fuse.plan import Plan
    >>> fit = FitState(candidates=[Plan()], plan=Plan())  # nothing selected to compile, nothing searched
    >>> verdict(fit, [{"epoch": 0, "fuse/step_ms": 3.0}])
    'FuseCallback: measure only (nothing selected to compile): eager steps of 3.0 ms, no speedup to measure'
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lightning_fuse.cache import cache_counters
from lightning_fuse.meters import cudagraph_trees
from lightning_fuse.metrics import (
    device_word,
    epoch_metrics,
    measure_only_line,
    per_rank,
    scalars,
    summary_table,
    verdict_line,
)
from lightning_fuse.plan import plan_graphs
from lightning_fuse.timing import EAGER, EagerSchedule, StepTimer, summarize

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_fuse.fit import FitState
    from lightning_fuse.options import FuseOptions

log = logging.getLogger("lightning_fuse")


# ------------------------------------------------------------------ the fit's start
def start_measuring(fit: FitState, options: FuseOptions, pl_module: pl.LightningModule, precision: str) -> None:
    """The step timer, the GPU's meters and profile windows (``precision``: the Trainer's), the eager reference's
    schedule, and the counters' values at fit start (compile cache hits and misses, torch's cudagraph trees), which
    the fit's own are counted from."""
    device = pl_module.device
    fit.timer = StepTimer(device)
    fit.gpu.start(device, precision, getattr(pl_module, "flops_per_batch", None), options.gpu_sample_hz,
                  options.profile_steps)  # fmt: skip
    fit.schedule = EagerSchedule(options.eager_steps, reference_budget=options.reference_budget,
                                 profiled=options.profile_steps if fit.gpu.profiles else 0)  # fmt: skip
    fit.cache_at_start = cache_counters()
    fit.trees_at_start = cudagraph_trees(fit.setting.device)


# ------------------------------------------------------------------ each epoch's end
def end_epoch(fit: FitState, epoch: int, device: torch.device,
              gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, Any]:  # fmt: skip
    """The epoch's scalars (and its plan's name), from all of its steps' times and the reference pool.

    Args:
        fit: The fit's state.
        epoch: The epoch that ends.
        device: The LightningModule's device.
        gather: With several processes, the strategy's ``all_gather`` (a collective: every rank calls it).
    """
    times = fit.timer.collect(include_skipped=True)  # all of the epoch's steps: the reference's cost is a share
    fit.pool.add(times.get(EAGER, []), epoch, runs=fit.timer.runs.get(EAGER))  # none: the pool stays as it was
    pooled = fit.runs_compiled()  # eager against eager is no speedup
    timing = summarize(times, reference=fit.pool.samples if pooled else [], reference_age=fit.pool.age(epoch) or 0,
                       reference_chunks=fit.pool.chunks if pooled else None)  # fmt: skip
    fit.compiled_ms = timing.step_ms or fit.compiled_ms
    fit.reference_ms, fit.train_ms = fit.reference_ms + timing.reference_ms, fit.train_ms + timing.train_ms
    fit.schedule.settle_epoch(sum(map(len, times.values())), timing.reference_ms, timing.reference_steps,
                              fit.compiled_ms)
    return epoch_metrics(
        timing, fit.nominal_batch, fit.tracker.total_s, fit.tracker.total_recompiles,
        items_per_batch=float(sum(fit.items)) / len(fit.items) if fit.items else None,  # one sync
        flops_per_batch=fit.gpu.flops_per_batch, peak_flops=fit.gpu.peak_flops,
        extra=epoch_extras(fit, device, gather), plan=fit.plan_name(),
    )  # fmt: skip


def epoch_extras(fit: FitState, device: torch.device,
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:  # fmt: skip
    """The epoch's scalars beyond timing: GPU, memory, kernels, cache, graph breaks, what ran (``gather``: see
    :func:`end_epoch`)."""
    extra = fit.gpu.read()
    if device.type == "cuda":
        extra["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    extra.update(fit.gpu.kernel_metrics())
    if gather is not None and device.type == "cuda":  # a collective: every rank calls it
        mine = torch.tensor(float(extra.get("gpu_util", float("nan"))), device=device)
        extra.update(per_rank("gpu_util", gather(mine).flatten().tolist()))
    cache = cache_counters().since(fit.cache_at_start)
    if fit.hooks.buckets is not None:
        extra["pad_waste"] = fit.hooks.buckets.waste
    trees = fit.trees_recorded()
    if trees is not None:
        extra["graphs_recorded"] = float(trees[0])
    extra.update(cache_hits=cache.hits, cache_misses=cache.misses, cache_bypasses=cache.bypasses,
                 graph_breaks=fit.tracker.total_graph_breaks,
                 compiled=float(fit.runs_compiled()),
                 plan_dropped=float(fit.dropped is not None),
                 graph_replays=float(sum(graph.replays for graph in plan_graphs(fit.plan))))  # fmt: skip
    return extra


def log_epoch(row: dict[str, Any], loggers: Sequence[Any], epoch: int) -> None:
    """Hand the epoch's scalars to the loggers (the plan's name, a string, is not one)."""
    for logger in loggers:
        logger.log_metrics(scalars(row), step=epoch)


# ------------------------------------------------------------------ the fit's end
def verdict(fit: FitState, history: list[dict[str, Any]]) -> str:
    """The fit in one line (:func:`~lightning_fuse.metrics.verdict_line`), or why nothing was compared."""
    if fit.decision is not None and fit.decision.winner == "eager" and fit.dropped is None:
        return _eager_verdict(fit)
    last = history[-1] if history else {}
    if _measures_only(fit):
        return measure_only_line(last.get("fuse/step_ms"))
    return verdict_line(fit.plan_name(), history, fit.tracker.total_s,
                        break_even_step=last.get("fuse/break_even_step"), dropped=fit.dropped,
                        dropped_in_epoch=fit.dropped_in_epoch,
                        device_type=fit.setting.device.type if fit.setting else "cpu",
                        eager_steps=fit.schedule.eager_steps,
                        reference_steps=len(fit.pool.samples),
                        reference_cost=fit.reference_cost, steps=fit.steps,
                        shortfall=fit.plan_shortfall(), unmeasured=fit.unmeasured)  # fmt: skip


def _measures_only(fit: FitState) -> bool:
    """Eager by design: nothing selected to compile and no search (a dropped plan leaves an eager plan too)."""
    plan = fit.plan
    return plan is not None and plan.owned and not plan.modules() and fit.decision is None and not fit.dropped


def _eager_verdict(fit: FitState) -> str:
    """The search kept eager: say how the best candidate measured against it, and what finding out cost (beside
    eager where the search timed them side by side: the machine's speed moved, and its decision stands on those)."""
    eager = fit.decision.trials[0]
    beside = [t for t in fit.decision.side_by_side if t.of_baseline]
    timed = [t for t in fit.decision.trials[1:] if t.ms is not None]
    if beside:
        best = min(beside, key=lambda t: t.of_baseline)
        name = best.name.removesuffix(f" beside {eager.name}")
        against = f"the best plan, {name}, timed again beside eager, ran {_as_fast(1 / best.of_baseline)}"
    elif timed and eager.ms:
        best = min(timed, key=lambda t: t.ms)
        against = f"the best plan, {best.name}, ran {_as_fast(eager.ms / best.ms)}"
    else:
        against = "every other plan failed"
    device = device_word(fit.setting.device.type)
    return (f"FuseCallback: 1.00x, kept eager: no plan was clearly faster on this {device} ({against}); compile "
            f"{fit.tracker.total_s:.0f} s spent finding out")


def _as_fast(speed: float) -> str:
    """A kept-eager plan's speed against eager's, said as a speed (the trial lines give times), e.g. ``1.31x as fast
    as eager, within its noise`` (faster, but not clearly: else it would have been chosen)."""
    return f"{speed:.2f}x as fast as eager" + (", within its noise" if speed > 1 else "")


def report(fit: FitState, history: list[dict[str, Any]], loggers: Sequence[Any], epoch: int) -> str:
    """The fit's end: the summary with the verdict (Python logging, the loggers' TensorBoard text at ``epoch``), and
    the verdict on the terminal, once (printed, unless a logging handler already wrote the summary there); returns
    the verdict."""
    line = verdict(fit, history)
    ran = fit.what_ran()
    log.info(summary_table(history, fit.tracker, ran, verdict=line))
    for logger in loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            text = summary_table(history, fit.tracker, ran, markdown=True, verdict=line)
            experiment.add_text("fuse/summary", text, global_step=epoch)
            experiment.flush()
    if not _logging_reaches_terminal(log):  # else (a Hydra run) the summary just logged showed it there
        print(f"\n{line}", flush=True)  # noqa: T201 - the fit's verdict, on a line of its own on the terminal
    return line


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
