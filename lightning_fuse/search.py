"""The plan chosen by measurement: try each candidate on the run's own inputs, keep the fastest that works.

After the fit's first eager steps, :class:`PlanSearch` installs each candidate plan in turn
(:func:`lightning_fuse.plan.candidates`, most promising first), runs a few forward and backward passes of the network
on the inputs the last training step gave it (the first compile and capture happen here, and so does any failure,
in forward or in backward), times them with one clock, and uninstalls it. Every trial runs inside
:func:`sandbox`: gradients, buffers and RNG states are as before when the search ends, so training goes on as if
nothing had run. A candidate that raises, whose graph was not captured, or whose loss or gradients differ from eager's,
is dropped with its reason; a candidate is not tried when one that does all it does and more already ran faster than
eager, or one that runs its kernels under graphs was timed at all. A candidate beats the baseline (eager) only when it
is clearly faster (:func:`clearly_faster`): where the host's noise hides the difference, switching would be a gamble,
and the baseline is kept. A candidate whose median is ahead but not clearly is tried once more, and the second trial
decides: one slow call among its few (a CUDA graph recorded a call late, say) is enough to turn the test. With several
processes every rank measures, a candidate that fails on any rank is dropped on all, and rank zero's timings decide
(:class:`Consensus`). When the other candidates are done, the baseline is timed once more (``eager again``): how far the
machine's own speed moved while the others were tried. Where it moved by more than :data:`DRIFT_LIMIT`, the comparisons
with the first timing are void, and each timed candidate is timed again between two timings of the baseline
(``side by side``; not one slower than both by more than :data:`OUT_OF_REACH`): the winner is the candidate clearly
faster than the baseline around it by the largest factor, or the baseline. Either way a candidate wins over one tried
before it (more promising) only where its own calls ran clearly faster than that one's. The decision can be stored
with the compile cache, so a warm run goes straight to the winner (:mod:`~lightning_fuse.decision`).

Example::

    >>> from lightning_fuse.plan import Plan
    >>> class Slow(Plan):
    ...     name = "slow"
    ...     def install(self): self.on = True
    ...     def uninstall(self): self.on = False
    >>> slow = Slow()
    >>> search = PlanSearch([Plan(), slow], clock=iter(range(100)).__next__)
    >>> decision = search.run(lambda: None)
    >>> decision.winner, [t.outcome for t in decision.trials]
    ('eager', ['chosen', 'slower than eager'])
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from scipy import stats
from torch import nn

from lightning_fuse import compat, replay
from lightning_fuse.compiler import TOLERANCES, describe_error, effective_dtype, lowest_precision
from lightning_fuse.decision import Decision, Trial
from lightning_fuse.plan import Plan
from lightning_fuse.sharding import local_shard
from lightning_fuse.state import Snapshot

WARM_CALLS = 2
"""Untimed calls per candidate: the first compiles (and captures), the second settles the allocator."""
TIMED_CALLS = 5
"""Timed calls per candidate; their median is its time."""
CLEAR_P = 0.05
"""A candidate is clearly faster than the baseline when a one-sided Mann-Whitney test of their timed calls gives
less than this p (5 calls each: at most 4 of the 25 pairs may have the candidate's call slower)."""
FAILURE_TRACEBACK = r"Error detected in \w+\. Traceback of forward call"
"""What autograd's anomaly mode prints when a backward raises: the forward's traceback. AOTAutograd traces each
compile's backward under that mode, so a candidate failing there printed it (HF Mixtral's search on an H200: four,
some 40 lines each) for a failure its trial line names: :meth:`PlanSearch._trial` leaves it out."""
GRAPH_REFUSED = r"FuseCallback: no CUDA graph over "
"""The warning a graph of FuseCallback's own gives where its capture fails, "It runs without one"
(:meth:`~lightning_fuse.graphs.GraphedModule.disable`). In a trial the trial's line names the failure and the
candidate runs no further: an LSTM language model's search on an H200 printed it for two candidates it then left
out, and the fit ran eagerly. :meth:`PlanSearch._trial` leaves it out."""
DRIFT_LIMIT = 1.10
"""Where the baseline's second timing lies further than this factor from its first (either way), the candidates are
timed again side by side with it. Within one timing the calls spread by 1-7% on the GPUs; on 2x H200 the baseline's
second timing of one FSDP search read 1.27x its first, and that search kept eager where ``compile`` ran 0.72x of it."""
OUT_OF_REACH = 3.0
"""Where the candidates are timed again side by side, one whose first timing was more than this factor slower than
the slower of the baseline's two timings is not: in 77 searches on the H200 the baseline's second timing lay
0.64-1.86x from its first, and a candidate so slow is slower than eager at any speed the machine showed (Wav2Vec2's
``reduce-overhead``, re-recording its graphs at each call, 476 ms against eager's 39.2 and 27.2)."""


def clearly_faster(candidate_ms: Sequence[float], baseline_ms: Sequence[float]) -> bool:
    """Whether ``candidate_ms`` are faster than ``baseline_ms`` beyond their noise (one-sided Mann-Whitney U).

    On the H100 the calls of a host-bound model spread by 30% within one search (an MoE's compiled candidates
    measured 5% ahead of eager and then ran 10-18% behind it); a median alone would pick a candidate on noise.

    Example::

        >>> clearly_faster([8.0, 8.1, 7.9, 8.2, 8.0], [10.0, 10.2, 9.9, 10.1, 10.0])
        True
        >>> clearly_faster([8.0, 12.0, 7.0, 13.0, 9.0], [10.0, 11.0, 9.5, 10.5, 10.0])  # faster median, no more
        False
    """
    p = stats.mannwhitneyu(candidate_ms, baseline_ms, alternative="less").pvalue
    return bool(p < CLEAR_P)  # NaN (every call equal) is not clear


Score = tuple[float, bool]
"""A timed candidate's score in the search, lower is faster (its median ms, or side by side its median over the
baseline's around it), and whether it is clearly faster than the baseline (the baseline's own: ``True``)."""


class Consensus:
    """How ranks agree: a candidate that fails on one rank fails on all, and rank zero's numbers decide.

    Args:
        agree: ``ok -> all ranks ok`` (e.g. ``strategy.reduce_boolean_decision(ok, all=True)``).
        share: ``value -> rank zero's value`` (e.g. ``strategy.broadcast``).

    Example::

        >>> Consensus().agree(True), Consensus().share(3.0)
        (True, 3.0)
    """

    def __init__(self, agree: Callable[[bool], bool] = bool, share: Callable[[Any], Any] = lambda value: value):
        self.agree = agree
        self.share = share


class PlanSearch:
    """Measure candidate plans on the run's own inputs and keep the fastest that works.

    Args:
        candidates: The plans, most promising first; the first is the baseline (eager) every other must beat.
        consensus: How several processes agree (one process: trivially).
        clock: Seconds, read after the device finished its work (the caller synchronises on CUDA).
        reference: ``() -> Outcome`` of the last call, compared between eager and each candidate when the network
            is deterministic; ``None`` skips the check.

    Example::

        >>> from lightning_fuse.plan import Plan
        >>> PlanSearch([Plan()]).run(lambda: None).winner
        'eager'
    """

    def __init__(
        self,
        candidates: Sequence[Plan],
        consensus: Consensus | None = None,
        clock: Callable[[], float] = time.perf_counter,
        reference: Callable[[], Outcome] | None = None,
    ) -> None:
        self.candidates = list(candidates)
        self.consensus = consensus or Consensus()
        self._clock = clock
        self._reference = reference
        self._eager_reference: Outcome | None = None
        self._times: dict[str, list[float]] = {}  # each timed candidate's calls, ms
        self._skipped_for: dict[str, str] = {}  # a candidate left out because this one does its work faster

    def run(self, call: Callable[[], None]) -> Decision:
        """Try every candidate with ``call`` (one forward+backward of the network) and return the decision."""
        trials: list[Trial] = []
        for plan in self.candidates:
            skip = self._skip_reason(plan, trials)
            trials.append(Trial(plan.name, outcome=f"skipped: {skip}") if skip else self._try(plan, call, trials))
        first_times = self._times.get(self.candidates[0].name)
        again = self._baseline_again(call, trials)
        side_by_side: list[Trial] = []
        if _drifted(trials[0], again):
            again.outcome += (f", outside {1 / DRIFT_LIMIT:.2f}-{DRIFT_LIMIT:.2f}x: the candidates timed again "
                              "beside it")
            side_by_side, scores = self._side_by_side(call, trials, again)
        else:
            self._times[self.candidates[0].name] = first_times  # judged as the skips were: on the first timing
            timed = (t for t in trials if t.ms is not None)
            scores = {t.name: (t.ms, t is trials[0] or self._beats_baseline(t, trials)) for t in timed}
        return Decision(_judge(trials, scores, self._times), trials, baseline_again=again, side_by_side=side_by_side)

    def _side_by_side(
        self, call: Callable[[], None], trials: list[Trial], again: Trial
    ) -> tuple[list[Trial], dict[str, Score]]:
        """Each timed candidate again, then the baseline after it (its second timing stands before the first), so
        each is judged against the baseline's two timings around it, whatever the machine's speed did between the
        candidates; a candidate skipped for one that, timed so, no longer ran clearly faster is timed so too, and one
        slower than both of the baseline's timings by more than :data:`OUT_OF_REACH` is not timed again (on an H200,
        Wav2Vec2's ``reduce-overhead`` and ``regions+trees`` at 12x and 6x of eager: 3.4 s of its cold start). The
        timings, and each candidate's score: its median over the baseline's around it."""
        baseline = self.candidates[0]
        rows, scores = [], {baseline.name: (1.0, True)}
        slower = max(trials[0].ms or 0.0, again.ms or 0.0)  # both timed: the search drifted between them
        for plan, first in zip(self.candidates[1:], trials[1:]):
            skipped_for = self._skipped_for.get(plan.name)
            if first.ms is None and (skipped_for is None or scores.get(skipped_for, (0.0, False))[1]):
                continue  # failed, or skipped for a plan that beside the baseline still ran clearly faster
            if first.ms is not None and first.ms > OUT_OF_REACH * slower:
                ratio = first.ms / slower
                first.outcome = f"slower than {baseline.name}: {ratio:.2f}x its slower timing, not timed again"
                continue
            before = self._times[baseline.name]
            trial, after = self._trial(plan, call), self._trial(baseline, call)
            around = before + (self._times[baseline.name] if after.ms is not None else [])
            name, took_s = f"{plan.name} beside {baseline.name}", (trial.took_s or 0.0) + (after.took_s or 0.0)
            if trial.ms is None:
                rows.append(Trial(name, outcome=trial.outcome, took_s=took_s))
                first.outcome = trial.outcome
                continue
            ratio, clear = trial.ms / statistics.median(around), clearly_faster(self._times[plan.name], around)
            noise = ": within its noise" if ratio < 1 and not clear else ""
            rows.append(Trial(name, trial.ms, f"{ratio:.2f}x of {baseline.name} around it{noise}", trial.slowest,
                              of_baseline=ratio, took_s=took_s))  # fmt: skip
            scores[plan.name] = (ratio, clear)
        return rows, scores

    def _baseline_again(self, call: Callable[[], None], trials: list[Trial]) -> Trial | None:
        """The baseline timed once more, after the candidates that were timed (``None`` where none was): how far
        the second timing lies from the first is how far the machine drifted (:func:`_drifted`)."""
        first = trials[0]
        if first.ms is None or all(t.ms is None for t in trials[1:]):
            return None
        again = self._trial(self.candidates[0], call)
        if again.ms is None:
            return Trial(f"{first.name} again", outcome=again.outcome, took_s=again.took_s)
        return Trial(f"{first.name} again", again.ms, f"after the candidates: {again.ms / first.ms:.2f}x its first "
                     "timing", slowest=again.slowest, took_s=again.took_s)  # fmt: skip

    def _beats_baseline(self, trial: Trial, trials: list[Trial]) -> bool:
        baseline = trials[0]
        measured = baseline.ms is not None and trial.ms is not None
        return measured and clearly_faster(self._times[trial.name], self._times[baseline.name])

    def _skip_reason(self, plan: Plan, trials: list[Trial]) -> str | None:
        if plan.tried_after is not None and not any(
            t.name == plan.tried_after and t.outcome.startswith("failed") for t in trials
        ):
            ran = any(t.name == plan.tried_after for t in trials)
            return f"a fallback for {plan.tried_after}, which {'did not fail' if ran else 'was left out'}"
        for trial in trials:
            if trial.name in plan.same_kernels_as and trial.ms is not None:
                return f"{trial.name} ran its kernels under a graph already ({trial.ms:.2f} ms)"
            if trial.name in plan.dominated_by and self._beats_baseline(trial, trials):
                self._skipped_for[plan.name] = trial.name
                return f"{trial.name} does what it does and ran faster than eager"
        return None

    def _try(self, plan: Plan, call: Callable[[], None], trials: list[Trial]) -> Trial:
        trial = self._trial(plan, call)
        if self._ahead_within_noise(trial, trials):  # rank zero's times, so every rank agrees
            first_s = trial.took_s or 0.0
            trial = self._trial(plan, call)  # one slow call (a graph recorded late) can turn the test: try again
            trial.tries, trial.took_s = 2, first_s + (trial.took_s or 0.0)
        return trial

    def _ahead_within_noise(self, trial: Trial, trials: list[Trial]) -> bool:
        baseline = trials[0].ms if trials else None  # none yet: ``trial`` is the baseline's own
        ahead = baseline is not None and trial.ms is not None and trial.ms < baseline
        return ahead and not self._beats_baseline(trial, trials)

    def _trial(self, plan: Plan, call: Callable[[], None]) -> Trial:
        """``plan``'s check, install, first calls and timed calls, as one trial, with the seconds they took."""
        started = time.perf_counter()
        trial = self._trial_untimed(plan, call)
        trial.took_s = time.perf_counter() - started
        return trial

    def _trial_untimed(self, plan: Plan, call: Callable[[], None]) -> Trial:
        with warnings.catch_warnings():
            for named_in_the_trials_line in (FAILURE_TRACEBACK, GRAPH_REFUSED):
                warnings.filterwarnings("ignore", message=named_in_the_trials_line)
            failure, times = _unfit(plan, call), None
            if failure is None:
                failure, times = self._measure(plan, call)
        if not self.consensus.agree(failure is None):
            return Trial(plan.name, outcome=f"failed: {failure or 'it failed on another rank'}")
        times = self._times[plan.name] = self.consensus.share(times)
        return Trial(plan.name, statistics.median(times), slowest=max(times))

    def _measure(self, plan: Plan, call: Callable[[], None]) -> tuple[str | None, list[float] | None]:
        """Install the plan, check its first call, time it; its failure (or ``None``) and its timed calls' ms."""
        plan.install()
        failure, times = None, None
        try:
            with replay.capture_failure_undone():  # a capture failed in the backward, say (torch's cudagraph trees)
                plan.step_begin()
                call()
                failure = plan.failure or self._check()
                for _ in range(WARM_CALLS - 1):
                    plan.step_begin()
                    call()
                times = None if failure else self._time(plan, call)
                failure = failure or plan.failure
        except Exception as err:  # noqa: BLE001 - a candidate that raises costs only itself
            failure = describe_error(err)
        finally:
            plan.uninstall()
        return failure, times

    def _time(self, plan: Plan, call: Callable[[], None]) -> list[float]:
        times = []
        for _ in range(TIMED_CALLS):
            start = self._clock()
            plan.step_begin()
            call()
            times.append((self._clock() - start) * 1e3)
        return times

    def _check(self) -> str | None:
        """Whether the first call's loss and gradient norm match eager's (the first candidate's), within the
        tolerance of the lower precision the two calls' math ran in (autocast's, under mixed precision)."""
        if self._reference is None:
            return None
        got = self._reference()
        if self._eager_reference is None:
            self._eager_reference = got
            return None
        want = self._eager_reference
        rtol, atol = TOLERANCES[lowest_precision([got.precision, want.precision])]
        for what, a, b in (("loss", got.loss, want.loss), ("gradient norm", got.grad_norm, want.grad_norm)):
            if not torch.allclose(a.float(), b.float(), rtol=4 * rtol, atol=4 * atol):
                return f"its {what} {a.item():.6g} differs from eager's {b.item():.6g}"
        return None


def _judge(trials: list[Trial], scores: dict[str, Score], times: dict[str, list[float]]) -> str:
    """The winner, and each scored trial's outcome. Of the candidates clearly faster than the baseline
    (``trials[0]``), the one with the lowest score wins, unless one tried before it, more promising, ran within its
    noise (``times``: each one's last timed calls): then that one does; where none is clearly faster, the baseline
    (where it was not scored, the lowest score of all)."""
    if not scores:
        return trials[0].name
    baseline = trials[0].name
    ahead = [t.name for t in trials[1:] if scores.get(t.name, (0.0, False))[1]]  # clearly faster than the baseline
    if ahead:
        fastest = min(ahead, key=lambda name: scores[name][0])
        winner = next(name for name in ahead if not clearly_faster(times[fastest], times[name]))
    else:
        winner = baseline if baseline in scores else min(scores, key=lambda name: scores[name][0])
    for trial in (t for t in trials if t.name in scores):
        trial.outcome = "chosen" if trial.name == winner else f"slower than {winner}"
        if trial.name not in (winner, baseline) and scores[trial.name][0] < scores[winner][0]:
            trial.outcome = (f"not clearly faster than {winner}, tried first: within its noise" if trial.name in ahead
                             else f"not clearly faster than {baseline}: within its noise")  # fmt: skip
        if trial.ms is None:  # skipped at first, then timed beside the baseline: its time is on that line
            trial.outcome += f" (timed beside {baseline} only)"
    return winner


def _drifted(first: Trial, again: Trial | None) -> bool:
    """Whether the baseline's second timing lies beyond :data:`DRIFT_LIMIT` of its first, either way."""
    if again is None or again.ms is None or first.ms is None:
        return False
    return max(again.ms / first.ms, first.ms / again.ms) > DRIFT_LIMIT


def _unfit(plan: Plan, call: Callable[[], None]) -> str | None:
    """The plan's own cheap check, before anything is compiled (``None``: measure it)."""
    try:
        return plan.unfit(getattr(call, "forward_backward", call))  # a TrialCall's, without its synchronize
    except Exception:  # noqa: BLE001 - a check that raises leaves the plan to its trial
        return None


@contextmanager
def sandbox(module: nn.Module) -> Iterator[None]:
    """Whatever runs inside, the module's gradients, buffers and the RNG states are as before when it ends.

    Example::

        >>> lin = torch.nn.Linear(2, 1)
        >>> with sandbox(lin):
        ...     lin(torch.ones(1, 2)).sum().backward()
        >>> lin.weight.grad is None
        True
    """
    snapshot = Snapshot(module)
    try:
        yield
    finally:
        snapshot.restore()


class Outcome(NamedTuple):
    """A trial call's loss and the gradient norm it left, and the precision its math ran in (:func:`effective_dtype`
    of its outputs inside the call's context: ``torch.bfloat16`` under bf16 autocast, though the loss comes out in
    float32, and for a network in bf16)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    precision: torch.dtype = torch.float32


class TrialCall:
    """One forward and backward of ``module`` on recorded inputs: what :class:`PlanSearch` times.

    The loss is what the training step most likely backpropagates: the output's scalar leaves that need gradients
    (a ``ModelOutput``'s own loss), or, where there are none, the sum of the means of its floating tensor leaves
    that need gradients (logits, a tuple), so every output is in the backward. A call does nothing beyond forward
    and backward: the gradient norm for the check against eager is computed only when :meth:`last` is asked
    (a norm per parameter is hundreds of kernel launches, which would weigh on every timed call).

    Args:
        module: The network.
        args: Positional inputs of one of its training calls (detached).
        kwargs: Its keyword inputs.
        context: A context every call runs under (the Trainer's precision, e.g. autocast).
        synchronize: Called after each backward, so a host clock sees the device's work.
        within: ``run(forward) -> loss``: where the forward runs, for a strategy that must wrap it (FSDP gathers its
            sharded parameters in its wrapper's forward: :func:`through_wrapper`); ``None``: called directly.

    Example::

        >>> lin = torch.nn.Linear(2, 1)
        >>> call = TrialCall(lin, (torch.ones(3, 2),), {})
        >>> with sandbox(lin):
        ...     call()
        ...     outcome = call.last()
        >>> round(float(outcome.loss), 4) == round(float(lin(torch.ones(3, 2)).mean().detach()), 4)
        True
    """

    def __init__(
        self, module: nn.Module, args: tuple, kwargs: dict, context: Callable[[], Any] | None = None,
        synchronize: Callable[[], None] = lambda: None,
        within: Callable[[Callable[[], torch.Tensor | None]], torch.Tensor | None] | None = None,
    ) -> None:  # fmt: skip
        self.module = module
        self.args, self.kwargs = detached((args, kwargs))
        self._context = context
        self._synchronize = synchronize
        self._within = within or (lambda forward: forward())
        self._loss = torch.zeros(())
        self._precision = torch.float32

    def __call__(self) -> None:
        self.forward_backward()
        self._synchronize()

    def forward_backward(self) -> None:
        """The call without its synchronize (what a host-sync check runs)."""
        for param in self.module.parameters():
            param.grad = None
        with self._context() if self._context else _nothing():
            loss = self._within(self._forward)
        if loss is not None:
            loss.backward()
        self._loss = loss.detach() if loss is not None else torch.zeros(())

    def _forward(self) -> torch.Tensor | None:
        """The trial's loss, noting the lowest precision among the outputs it is taken from (in the call's context:
        autocast's dtype, or a bf16 network's own)."""
        leaves = differentiable_leaves(self.module(*self.args, **self.kwargs))
        self._precision = lowest_precision(effective_dtype(leaf) for leaf in leaves)
        return trial_loss(leaves)

    def last(self) -> Outcome:
        """The last call's loss, the gradient norm it left (of this rank's shards, where FSDP2 shards them) and the
        precision its math ran in."""
        grads = [local_shard(p.grad).float().norm() for p in self.module.parameters() if p.grad is not None]
        return Outcome(self._loss, torch.stack(grads).norm() if grads else torch.zeros(()), self._precision)


def through_wrapper(wrapper: nn.Module, inner: nn.Module) -> Callable[[Callable[[], Any]], Any]:
    """``run(forward)``: ``forward()`` called by ``wrapper``'s forward where it would call ``inner``'s, as Lightning
    runs a training step under FSDP: the wrapper gathers the parameters it shards before, and its hooks reduce the
    gradients in the backward after. ``inner``'s own forward is back when ``run`` returns.

    Example::

        >>> class Wrapper(nn.Module):  # as FSDP's root wraps the LightningModule
        ...     def __init__(self, inner):
        ...         super().__init__()
        ...         self.inner = inner
        ...     def forward(self, *args):
        ...         print("gathered")
        ...         return self.inner(*args)
        >>> inner = nn.Linear(2, 2)
        >>> through_wrapper(Wrapper(inner), inner)(lambda: "the trial's forward")
        gathered
        "the trial's forward"
        >>> "forward" in vars(inner)
        False
    """

    def run(forward: Callable[[], Any]) -> Any:
        own = vars(inner).get("forward")  # a forward the user set on the instance, if any
        inner.forward = lambda *args, **kwargs: forward()
        try:
            return wrapper()
        finally:
            if own is None:
                del inner.forward
            else:
                inner.forward = own

    return run


def differentiable_leaves(out: Any) -> list[torch.Tensor]:
    """The floating tensors in an output (a ``ModelOutput``, a tuple...) that need gradients."""
    return [leaf for leaf in compat.tree_leaves(out)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point()]  # fmt: skip


def trial_loss(leaves: list[torch.Tensor]) -> torch.Tensor | None:
    """The scalar a trial backpropagates from an output's :func:`differentiable_leaves` (``None``: there are none).

    Example::

        >>> w = torch.ones(2, requires_grad=True)
        >>> float(trial_loss(differentiable_leaves({"loss": w.sum(), "logits": w * 3})).detach())  # its own loss
        2.0
        >>> float(trial_loss(differentiable_leaves((w * 3, None))).detach())
        3.0
    """
    scalars = [leaf for leaf in leaves if leaf.dim() == 0]
    if scalars:
        return sum(leaf.float() for leaf in scalars)
    return sum(leaf.float().mean() for leaf in leaves) if leaves else None


def detached(tree: Any) -> Any:
    """``tree`` with every tensor leaf detached from its autograd graph (keeping ``requires_grad``)."""
    return compat.tree_map(
        lambda leaf: leaf.detach().requires_grad_(leaf.requires_grad) if isinstance(leaf, torch.Tensor) else leaf,
        tree,
    )


@contextmanager
def _nothing() -> Iterator[None]:
    yield
