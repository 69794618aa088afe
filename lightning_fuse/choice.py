"""The moment the plan is chosen: at the activation step, from the cached decision, by measurement on the recorded
inputs (:mod:`~lightning_fuse.search`), or forced by explicit settings; then installed, the other candidates released.

Where the shapes of the network's first training calls vary, the varying dims are compiled as dynamic from then on,
and the candidates that capture FuseCallback's own CUDA graphs (one shape each) are left out of the search, unless
``pad_buckets`` pads the lengths to a few sizes; torch's cudagraph trees (a graph per size) stay in.

Example::

    >>> from lightning_fuse.fit import FitState
    >>> fit = FitState()  # one process: no optimizer graph waits for rank zero's verdict
    >>> share_optimizer_verdict(fit, broadcast=lambda verdict: verdict); fit.optimizer_verdict_pending
    False
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_fuse import compat
from lightning_fuse.compiler import changes_in_training
from lightning_fuse.decision import Decision, DecisionFile, announce, decision_key
from lightning_fuse.optimizer_graph import SETTLE_EVERY, install_optimizer_graphs, settle_together
from lightning_fuse.plan import for_varying_shapes
from lightning_fuse.search import Consensus, PlanSearch, TrialCall, sandbox, through_wrapper
from lightning_fuse.shapes import mark_dims, mark_region_inputs

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_fuse.fit import FitState


@dataclass(frozen=True)
class Training:
    """What choosing and installing the plan reads from Lightning's Trainer, gathered by FuseCallback (every
    ``trainer.`` access stays in the callback).

    Example::

        >>> training = Training(accumulate_grad_batches=1, is_global_zero=True, loggers=[], optimizers=[],
        ...                     precision=None, reduce_all=bool, broadcast=lambda obj: obj)
        >>> training.fsdp_root is None
        True
    """

    accumulate_grad_batches: int
    is_global_zero: bool
    loggers: Sequence[Any]
    optimizers: Sequence[torch.optim.Optimizer]
    precision: Any
    """Lightning's precision plugin: its ``forward_context`` for the trials, its ``scaler`` (fp16) if any."""
    reduce_all: Callable[[bool], bool]
    """``True`` on every process when it is ``True`` on all (the strategy's ``reduce_boolean_decision``)."""
    broadcast: Callable[[Any], Any]
    fsdp_root: nn.Module | None = None
    """Under Lightning's ``FSDPStrategy``, its root unit, which wraps the LightningModule."""


def activate_plan(fit: FitState, training: Training, pl_module: pl.LightningModule) -> None:
    """Choose the plan (by measurement on the recorded inputs, from the cache, or forced) and install it, with
    the optimizers' captured updates where the plan runs compiled."""
    fit.hooks.stop_recording()
    _hold_over_varying_shapes(fit)
    fit.hooks.set_plan_step(True)  # the candidates, eager's trial too, run as the plan will
    if pl_module.automatic_optimization and training.accumulate_grad_batches == 1:
        # Dynamo traces each parameter with its .grad: FSDP's bf16 grads left by the eager steps made every region
        # fall back ("grad_dtype 'BFloat16'"). Lightning would set them to None after this step's forward anyway.
        pl_module.zero_grad(set_to_none=True)
    if not fit.searching:
        plan = fit.candidates[0]
    elif fit.hooks.recorded is None:
        plan = fit.candidates[0]
        plan.reason = f"the network {fit.setting.target[0]!r} was not called in a training step, so nothing to measure"
    else:
        fit.decision_file = _decision_file(fit)
        cached = fit.decision_file.load([p.name for p in fit.candidates]) if fit.decision_file else None
        fit.decision = cached or _search(fit, training, pl_module)
        plan = fit.candidate(fit.decision.winner)
        plan.reason = "from the cached decision" if fit.decision.cached else "chosen by measurement"
        if fit.decision.graphs_stopped:
            plan.stop_trees()
            plan.reason += f", without CUDA graphs (an earlier fit stopped them {fit.decision.graphs_stopped})"
        announce(fit.decision, training.loggers if training.is_global_zero else [])
        if fit.decision_file is not None and training.is_global_zero:
            fit.decision_file.store(fit.decision)
    fit.hooks.recorded = None
    for loser in fit.candidates:
        if loser is not plan:
            loser.release()
    plan.install()
    fit.plan = plan
    if fit.graphless_candidate() is not None:  # a failure in the trees hands over (FitState.fail_plan)
        plan.watch_trees_failures()
    if fit.optimizer_graph and fit.runs_compiled():
        _install_optimizer_graphs(fit, training)
    if plan.name == "eager" and fit.decision is not None:
        fit.schedule.eager_steps = 0  # nothing runs but eager: an eager reference would measure eager against itself
        fit.schedule.plan_epoch(fit.steps, 1, 0)  # and the chunks already placed in this epoch go


def forget_a_cached_plan_without_its_graph(fit: FitState) -> None:
    """At the fit's end (rank zero's): where the plan came from the cached decision and each of its CUDA graphs of
    FuseCallback's own was refused in this fit before its first replay (the search's trial, which timed the plan,
    had captured them), the cached decision is forgotten: the next run on the same inputs measures the plans again
    rather than run this one without its graphs again. On an H200, HF Whisper's warm fits lost their graph at its
    capture and ran ``regions+graph`` at 29.3 ms a step, where the cold fit's trial had timed 8.1 ms and the one
    line's ``reduce-overhead`` ran 15.8 ms.

    Example::

        >>> from lightning_fuse.fit import FitState
        >>> forget_a_cached_plan_without_its_graph(FitState())  # no plan, no graph: nothing to forget
    """
    graphs = fit.plan.graphs() if fit.plan is not None else []
    lost = bool(graphs) and all(graph.disabled_reason is not None and not graph.replays for graph in graphs)
    if lost and fit.decision is not None and fit.decision.cached and fit.decision_file is not None:
        fit.decision_file.forget()
        rank_zero_info(f"FuseCallback: {fit.plan.name!r}, from the cached decision, ran without its CUDA graph in "
                       "this fit: the next run on these inputs measures the plans again.")


def _install_optimizer_graphs(fit: FitState, training: Training) -> None:
    scaler = getattr(training.precision, "scaler", None)  # MixedPrecision's GradScaler (fp16)
    alone = fit.setting.world_size == 1
    fit.optimizer_graphs = install_optimizer_graphs(training.optimizers, scaler, fit.setting.device,
                                                    fit.capture_optimizer, decides_alone=alone,
                                                    precision=training.precision)  # fmt: skip
    fit.optimizer_verdict_pending = not alone and any(graph is not None for graph in fit.optimizer_graphs)


def share_optimizer_verdict(fit: FitState, broadcast: Callable[[Any], Any]) -> None:
    """With several processes, rank zero's trial decides every rank's optimizer graphs: one ``broadcast`` every
    :data:`~lightning_fuse.optimizer_graph.SETTLE_EVERY` steps from the plan's activation, on every rank alike,
    until rank zero has a word for each (:func:`~lightning_fuse.optimizer_graph.settle_together`)."""
    if fit.optimizer_verdict_pending and (fit.steps - fit.activation_step) % SETTLE_EVERY == 0:
        fit.optimizer_verdict_pending = not settle_together(fit.optimizer_graphs, broadcast)


def _decision_file(fit: FitState) -> DecisionFile | None:
    """Where the decision for the recorded inputs is cached, beside the compile cache (``None``: no cache)."""
    cache = fit.hooks.cache
    if cache is None:
        return None
    setting = fit.setting
    return DecisionFile(cache.directory, decision_key(fit.hooks.recorded, fit.varying_dims, setting.world_size,
                                                      setting.max_graphs))  # fmt: skip


def _search(fit: FitState, training: Training, pl_module: pl.LightningModule) -> Decision:
    module = fit.setting.target[1]
    args, kwargs = fit.hooks.recorded
    cuda = fit.setting.device.type == "cuda"
    # FSDP (Lightning's FSDPStrategy) shards the parameters outside its units, and its root unit, which wraps the
    # LightningModule, gathers them only in its own forward: the trials run there, as training steps do. DDP's
    # wrapper stays out: its all-reduce would need every parameter in each trial's loss
    within = through_wrapper(training.fsdp_root, pl_module) if training.fsdp_root is not None else None
    call = TrialCall(module, args, kwargs, context=training.precision.forward_context,
                     synchronize=torch.cuda.synchronize if cuda else lambda: None, within=within)  # fmt: skip
    # the trial's inputs are detached copies: give them the batch's dynamic dims, or the candidates compile for
    # other shapes than training then calls them with (one recompile of every candidate, at its first step)
    mark_region_inputs(compat.tree_leaves((call.args, call.kwargs)), fit.setting.policy.dynamic_sizes)
    # compiled candidates compile the varying dims as dynamic from their first call: no recompile per length
    fit.setting.policy.dynamic_sizes |= mark_dims((call.args, call.kwargs), fit.varying_dims, fit.static_sizes)
    consensus = Consensus(training.reduce_all, training.broadcast)
    deterministic = not changes_in_training(module) and not fit.hooks.random.drew  # F.dropout shows only there
    search = PlanSearch(fit.candidates, consensus, reference=call.last if deterministic else None)
    with sandbox(module):
        return search.run(call)


def _hold_over_varying_shapes(fit: FitState) -> None:
    """Where the shapes recorded before the plan search vary, those dims are marked dynamic from now on, only the
    candidates that hold over them compete (no graph of FuseCallback's own without ``pad_buckets``), and on CUDA
    without ``pad_buckets`` the plan's steps and the eager reference's leave cuDNN attention out
    (:class:`~lightning_fuse.call_shapes.NoCudnnAttention`); a line says each."""
    shapes = fit.hooks.shapes
    if not shapes.varies:
        return
    fit.varying_dims, fit.static_sizes = shapes.varying_dims, shapes.static_sizes()
    buckets = len(fit.hooks.buckets.sizes) if fit.hooks.buckets is not None else 0
    kept = for_varying_shapes(fit.candidates, buckets) if fit.searching else fit.candidates
    left_out = [plan for plan in fit.candidates if plan not in kept]
    for plan in left_out:
        plan.release()
    fit.candidates = kept
    rank_zero_info(shapes.note([plan.name for plan in left_out], buckets))
    if fit.setting.device.type == "cuda" and not buckets:
        fit.hooks.attention.apply()
