"""The plan search's decision and its cache: the winner and every candidate's trial, kept as JSON beside the compile
cache, so a warm run with the same inputs goes straight to the winner.

:class:`Decision` is what :class:`~lightning_fuse.search.PlanSearch` returns; :class:`DecisionFile` is where one is
stored, named by the compile cache's key and the recorded inputs' signature (:func:`decision_key`), and read back,
written, or forgotten (a dropped plan's file, so the next run measures again); :func:`announce` says it once.

Example::

    >>> decision = Decision("regions", [Trial("eager", 3.0, "slower than regions"), Trial("regions", 2.0, "chosen")])
    >>> Decision.from_json(decision.to_json()).winner, Decision.from_json(decision.to_json()).cached
    ('regions', True)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_fuse import compat


@dataclass
class Trial:
    """One candidate's result: its median ms per forward+backward, and what became of it.

    Example::

        >>> Trial("regions", 2.5, "chosen")
        Trial(name='regions', ms=2.5, outcome='chosen')
    """

    name: str
    ms: float | None = None
    outcome: str = "not tried"
    """``chosen``, ``slower than <winner>``, ``not clearly faster than <baseline>: within its noise``, ``not
    clearly faster than <winner>, tried first: within its noise``, ``slower than <baseline>: <n>x its slower timing,
    not timed again`` (:data:`~lightning_fuse.search.OUT_OF_REACH`), ``failed: <reason>`` or ``skipped: <reason>``."""
    slowest: float | None = field(default=None, repr=False)
    """Its slowest timed call, ms: one slow call can hide a lead from the search's test."""
    tries: int = field(default=1, repr=False)
    """How many times it was installed and timed (a second time where its lead was within the noise)."""
    of_baseline: float | None = field(default=None, repr=False)
    """A side-by-side row's median over the baseline's timed around it (``None`` for the other trials)."""
    took_s: float | None = field(default=None, repr=False)
    """The host's seconds the trial took, its tries together: its check, compile, capture and calls (``None``:
    not measured). What each candidate added to the fit's first search, the cold start's largest part."""

    def timing(self) -> str:
        """Its median, and where known its slowest call and its tries: ``   7.51 ms, slowest 52.10, 2 tries``."""
        if self.ms is None:
            return ""
        slowest = f", slowest {self.slowest:.2f}" if self.slowest is not None else ""
        return f"{self.ms:8.2f} ms{slowest}" + (f", {self.tries} tries" if self.tries > 1 else "")


@dataclass
class Decision:
    """The search's result: the winner and every candidate's trial.

    Example::

        >>> Decision("eager", [Trial("eager", 3.0, "chosen"), Trial("regions", None, "failed: boom")]).lines()
        ['eager       3.00 ms  chosen', 'regions              failed: boom']
        >>> trials = [Trial("eager", 3.0, "slower than compile", 3.2), Trial("compile", 2.0, "chosen", 9.0, 2)]
        >>> Decision("compile", trials).lines()
        ['eager       3.00 ms, slowest 3.20           slower than compile', \
'compile     2.00 ms, slowest 9.00, 2 tries  chosen']
    """

    winner: str
    trials: list[Trial] = field(default_factory=list)
    cached: bool = False
    baseline_again: Trial | None = None
    """The baseline timed once more after the other candidates (``None`` where none of them was timed): how far
    the machine's own speed moved while they were tried, which the comparisons with its first timing cannot see."""
    side_by_side: list[Trial] = field(default_factory=list)
    """Where the machine's speed moved beyond the search's limit: the timed candidates timed again between two
    timings of the baseline (not one far slower than both), named ``<candidate> beside <baseline>``, which the
    decision stands on."""
    graphs_stopped: str | None = None
    """Where a fit stopped the winner's torch CUDA graphs (:meth:`stopped_graphs`), when and why: a run from this
    decision runs the winner without them from its first step (``None``: it runs as the search chose it)."""

    def lines(self) -> list[str]:
        """One line per candidate, e.g. ``regions+graph   3.21 ms, slowest 3.40     12.5 s  chosen`` (its median
        call, its slowest, the seconds its trial took), and the baseline's second timing where there is one.

        Example::

            >>> again = Trial("eager again", 3.3, "after the candidates: 1.10x its first timing")
            >>> Decision("eager", [Trial("eager", 3.0, "chosen")], baseline_again=again).lines()[-1]
            'eager again     3.30 ms  after the candidates: 1.10x its first timing'
            >>> trials = [Trial("eager", 3.0, "slower than compile", took_s=0.4), Trial("compile", 2.0, "chosen")]
            >>> trials[1].took_s = 31.25  # the seconds a trial took, where the search measured them
            >>> Decision("compile", trials).lines()
            ['eager       3.00 ms      0.4 s  slower than compile', 'compile     2.00 ms     31.2 s  chosen']
        """
        shown = [*self.trials, *filter(None, [self.baseline_again]), *self.side_by_side]
        width = max(len(t.name) for t in shown)
        times = [t.timing() for t in shown]
        span = max(11, *map(len, times))
        took = [f"{t.took_s:7.1f} s  " if t.took_s is not None else "" for t in shown]
        if any(took):  # a column of its own, "took" seconds, where the search measured them
            took = [cost or " " * 11 for cost in took]
        return [f"{t.name:<{width}} {ms:<{span}}  {cost}{t.outcome}" for t, ms, cost in zip(shown, times, took)]

    def handed_over(self, successor: str, step: int, reason: str) -> Decision:
        """The decision a later run should start from, where this fit handed its winner over to ``successor`` at
        ``step`` for ``reason`` (:meth:`~lightning_fuse.fit.FitState.hand_over`): the same trials, ``successor``
        the winner. A new decision, not a cached one, so that :meth:`DecisionFile.store` writes it.

        Example::

            >>> trials = [Trial("eager", 30.0, "slower than reduce-overhead"), Trial("reduce-overhead", 9.0, "chosen")]
            >>> decision = Decision("reduce-overhead", trials, cached=True)
            >>> handed = decision.handed_over("compile", 93, "its graphs reached their cap of sizes")
            >>> handed.winner, handed.cached, [t.name for t in handed.trials]
            ('compile', False, ['eager', 'reduce-overhead', 'compile'])
            >>> handed.trials[1].outcome
            'handed over at step 93: its graphs reached their cap of sizes'
            >>> handed.trials[2].outcome
            "chosen: handed over from 'reduce-overhead' at step 93"
        """
        why = f"handed over at step {step}: {reason}"
        chosen = f"chosen: handed over from {self.winner!r} at step {step}"
        outcomes = {self.winner: why, successor: chosen}
        trials = [replace(t, outcome=outcomes.get(t.name, t.outcome)) for t in self.trials]
        if successor not in {t.name for t in trials}:
            trials.append(Trial(successor, outcome=chosen))
        return Decision(successor, trials, baseline_again=self.baseline_again, side_by_side=self.side_by_side)

    def stopped_graphs(self, step: int, reason: str) -> Decision:
        """The decision a later run should start from, where this fit stopped its winner's torch CUDA graphs at
        ``step`` for ``reason`` (:meth:`~lightning_fuse.fit.FitState.stop_trees`): the same winner and trials, the
        winner run without graphs. A new decision, not a cached one, so that :meth:`DecisionFile.store` writes it.

        Example::

            >>> trials = [Trial("eager", 30.0, "slower than reduce-overhead"), Trial("reduce-overhead", 9.0, "chosen")]
            >>> stopped = Decision("reduce-overhead", trials, cached=True).stopped_graphs(93, "its graphs reached "
            ...                                                                          "their cap of sizes")
            >>> stopped.winner, stopped.cached, stopped.graphs_stopped
            ('reduce-overhead', False, 'at step 93: its graphs reached their cap of sizes')
            >>> stopped.trials[1].outcome
            'chosen; no CUDA graphs from step 93: its graphs reached their cap of sizes'
        """
        why = f"at step {step}: {reason}"
        trials = [replace(t, outcome=f"chosen; no CUDA graphs from step {step}: {reason}") if t.name == self.winner
                  else t for t in self.trials]  # fmt: skip
        return replace(self, trials=trials, cached=False, graphs_stopped=why)

    def to_json(self) -> str:
        again = asdict(self.baseline_again) if self.baseline_again else None
        return json.dumps({"winner": self.winner, "trials": [asdict(t) for t in self.trials], "baseline_again": again,
                           "side_by_side": [asdict(t) for t in self.side_by_side],
                           "graphs_stopped": self.graphs_stopped})  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> Decision:
        data = json.loads(text)
        again = data.get("baseline_again")  # absent from the files of earlier versions, as are the fields after it
        return cls(data["winner"], [Trial(**t) for t in data["trials"]], cached=True,
                   baseline_again=Trial(**again) if again else None,
                   side_by_side=[Trial(**t) for t in data.get("side_by_side", [])],
                   graphs_stopped=data.get("graphs_stopped"))  # fmt: skip


def decision_key(recorded: Any, varying_dims: Collection[int], world_size: int, max_graphs: int = 1) -> str:
    """The recorded inputs' signature: shapes (a varying dim as -1, so any length finds it) and dtypes; and the
    processes and graphs per fit (``pad_buckets``' count) the candidates were made for, so that a run that pads to
    buckets does not start from the decision of one that did not.

    Example::

        >>> inputs = ((torch.zeros(2, 7),), {})
        >>> decision_key(inputs, {1}, 1) == decision_key(((torch.zeros(2, 9),), {}), {1}, 1)
        True
        >>> decision_key(inputs, {1}, 1) == decision_key(inputs, {1}, 1, max_graphs=4)
        False
    """
    leaves = [leaf for leaf in compat.tree_leaves(recorded) if isinstance(leaf, torch.Tensor)]
    shapes = [tuple(-1 if dim in varying_dims else size for dim, size in enumerate(t.shape)) for t in leaves]
    shapes = repr([(shape, t.dtype) for shape, t in zip(shapes, leaves)]) + repr(world_size)
    shapes += f" {max_graphs} graphs" if max_graphs > 1 else ""  # the keys of earlier versions stand without buckets
    return hashlib.sha256(shapes.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DecisionFile:
    """Where the decision for one compile cache (its directory) and one input signature (its key) is stored.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as directory:
        ...     stored = DecisionFile(Path(directory), "0123abcd")
        ...     stored.store(Decision("eager", [Trial("eager", 3.0, "chosen")]))
        ...     stored.path.name, stored.load(["eager", "regions"]).winner, stored.load(["regions"])
        ('plan-0123abcd.json', 'eager', None)
    """

    directory: Path
    key: str
    """The recorded inputs' signature (:func:`decision_key`)."""

    @property
    def path(self) -> Path:
        return self.directory / f"plan-{self.key}.json"

    def load(self, candidates: Collection[str]) -> Decision | None:
        """The stored decision, if there is a readable one whose winner is among ``candidates`` (plan names)."""
        try:
            decision = Decision.from_json(self.path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return decision if decision.winner in candidates else None

    def store(self, decision: Decision) -> None:
        """Write ``decision``, unless it was read from the cache in the first place."""
        if not decision.cached:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(decision.to_json())

    def forget(self) -> None:
        """Remove the stored decision: the next run measures again."""
        self.path.unlink(missing_ok=True)


def announce(decision: Decision, loggers: Sequence[Any]) -> None:
    """Print the decision once, and write it to ``loggers`` (rank zero's) as text and as scalars."""
    how = "from the cached decision" if decision.cached else "by measurement"
    seconds = ", seconds each trial took" if any(t.took_s is not None for t in decision.trials) else ""
    rank_zero_info(f"FuseCallback: plan {decision.winner!r} chosen {how} (median ms per forward+backward{seconds}):"
                   "\n  " + "\n  ".join(decision.lines()))
    scalars = {f"fuse/search_ms/{t.name}": t.ms for t in decision.trials if t.ms is not None}
    for logger in loggers:
        logger.log_metrics(scalars, step=0)
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            experiment.add_text("fuse/plan_search", "    " + "\n    ".join(decision.lines()), global_step=0)
