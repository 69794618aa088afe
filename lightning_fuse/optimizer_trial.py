"""The optimizer graph's trial: whole steps with the replayed update and with the eager one, alternated in blocks,
and the verdict on their medians' ratio (:class:`Trial`, used by :mod:`~lightning_fuse.optimizer_graph`).

Example::

    >>> trial, replayed = Trial(), []
    >>> for _ in range(2 * BLOCK_STEPS):
    ...     replayed.append(trial.wants_graph()); trial.advance(replayed[-1])
    >>> replayed
    [True, True, True, True, False, False, False, False]
"""

from __future__ import annotations

import statistics

BLOCK_STEPS = 4
"""The trial's whole steps run in blocks of this many with the replay, then as many with the eager update."""
TRIAL_BLOCKS = 5
"""Blocks of each kind the trial runs before deciding (more if eager reference steps left too few timed)."""
KEEP_BELOW = 0.97
"""The graph is kept where the trial's median whole step with it is below this share of the eager update's."""
GRAPH, EAGER = "graph", "eager"
"""How a step's update ran: replayed from the graph, or the optimizer's own."""


class Trial:
    """Alternates whole steps with the replayed and the eager update in blocks, measures their medians' ratio, and
    is settled on a ratio (its own, or rank zero's).

    Example::

        >>> trial = Trial()
        >>> trial.measure([4.0, 4.1, 3.9] * 4, [5.0, 5.2, 4.9] * 4)
        >>> round(trial.measured, 2)
        0.8
        >>> trial.settle(trial.measured); trial.keep
        True
    """

    def __init__(self) -> None:
        self.decided = False
        self.keep = False
        self.ratio: float | None = None
        self.measured: float | None = None
        """The replay's median whole step over the eager update's (``None``: too few timed steps yet)."""
        self._steps = 0  # whole steps since the capture
        self._graph_ms: list[float] = []
        self._eager_ms: list[float] = []

    def wants_graph(self) -> bool:
        """Whether the next update replays: always once kept, in alternating blocks during the trial."""
        return self.keep if self.decided else (self._steps // BLOCK_STEPS) % 2 == 0

    def advance(self, replayed: bool) -> None:
        if replayed or self._steps:
            self._steps += 1

    def due(self) -> bool:
        return self._steps >= 2 * TRIAL_BLOCKS * BLOCK_STEPS and self._steps % (2 * BLOCK_STEPS) == 0

    def measure(self, graph_ms: list[float], eager_ms: list[float]) -> None:
        """Add a round's whole steps and measure; with fewer than half a trial's steps timed of either (eager
        reference steps between), :attr:`measured` waits for another round."""
        self._graph_ms += graph_ms
        self._eager_ms += eager_ms
        enough = TRIAL_BLOCKS * BLOCK_STEPS // 2
        if min(len(self._graph_ms), len(self._eager_ms)) >= enough:
            self.measured = statistics.median(self._graph_ms) / statistics.median(self._eager_ms)

    def settle(self, ratio: float) -> None:
        """Decide on ``ratio``: keep the graph where it is below :data:`KEEP_BELOW`."""
        self.ratio, self.keep, self.decided = ratio, ratio < KEEP_BELOW, True

    def describe(self) -> str:
        if not self.decided:
            return ", in its trial"
        verdict = "kept" if self.keep else "dropped"
        return f", {verdict} at {self.ratio:.2f}x of the eager update's whole step"
