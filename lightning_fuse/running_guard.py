"""The running guard: a plan slower than eager over a window of steps is found out mid-epoch, not at its end.

The plan is chosen on a few calls of one recorded input; a plan that then crawls in training (it recompiles at
every new sequence length, say) would otherwise run a whole epoch before the epoch-end check drops it.
:class:`RunningGuard` times, on the host clock, each step from its start to its end: the plan's steps (a step that
compiled counts: a recompile at every new length is the crawl), and the eager reference's timed steps. A step in
which torch's cudagraph trees recorded a graph counts as a step of its window, but its time is left out: the sizes
recorded are capped per fit (:data:`~lightning_fuse.compiler.TREE_SIZES`), so recording is a one-time cost, and
the recordings of a few lengths met close together would otherwise make a window of a plan that then replays at 5x
eager read slower than eager. Every :data:`GUARD_WINDOW` steps the guard hands back the window's plan step times,
which :func:`window_speedup` compares with eager's median step; the caller drops the plan below its margin.
Windows are counted in steps since the plan was installed, the same on every rank, so a decision shared between
ranks (one collective) falls on the same step everywhere.

Example::

    >>> ticks = iter([tick / 8 for tick in range(100)])  # a fake clock: each step takes 125 ms
    >>> guard = RunningGuard(window=3, clock=lambda: next(ticks))
    >>> closed = []
    >>> for kind in (EAGER, PLAN, PLAN, PLAN):
    ...     guard.begin(kind); closed.append(guard.end())
    >>> closed, guard.eager_ms()
    ([None, None, [125.0, 125.0], None], 125.0)
    >>> window_speedup([25.0, 30.0, 35.0], eager_ms=15.0)
    0.5
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

from lightning_fuse.timing import EAGER

GUARD_WINDOW = 30
"""Steps in one window of the running guard: long enough that a median shrugs off a few compiling or
capturing steps, short enough that a crawling plan (3 s a step where eager takes 0.2 s) costs about 1.5 minutes."""
PLAN = "plan"
"""A step that runs the plan (the eager reference's timed steps are :data:`~lightning_fuse.timing.EAGER`)."""
BEFORE = "before"
"""An eager step before the plan is installed (the first steps, which the plan search waits for)."""
EAGER_SAMPLES = 20
"""The guard's most recent eager reference steps kept for eager's median (four of the reference's chunks)."""


class RunningGuard:
    """Times the steps after the plan is installed and closes a window every ``window`` of them.

    Args:
        window: Steps per window (plan, eager and untimed steps alike); ``None``: :data:`GUARD_WINDOW`.
        clock: Seconds on the host.

    Example::

        >>> guard = RunningGuard(window=2)
        >>> guard.begin(None); guard.end() is None
        True
        >>> guard.begin(PLAN); guard.end() is not None  # the window's plan step times, in ms
        True
    """

    def __init__(self, window: int | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.window = GUARD_WINDOW if window is None else window
        self._clock = clock
        self._plan_ms: list[float] = []
        self._eager_ms: deque[float] = deque(maxlen=EAGER_SAMPLES)
        self._before_ms: deque[float] = deque(maxlen=EAGER_SAMPLES)
        self._steps = 0
        self._open: tuple[str | None, float] | None = None  # the running step's kind and start

    def begin(self, kind: str | None) -> None:
        """A step starts: ``PLAN`` (it runs the plan), ``EAGER`` (a timed reference step), ``BEFORE`` (an eager
        step before the plan, outside every window) or ``None`` (not timed)."""
        self._open = (kind, self._clock())

    def end(self, judged: bool = True) -> list[float] | None:
        """The step ended; at a window's end, that window's plan step times (ms), and the next window begins.
        ``judged=False``: the step counts in its window, but its time is left out (it recorded a CUDA graph)."""
        if self._open is None:
            return None
        kind, start = self._open
        self._open = None
        ms = (self._clock() - start) * 1e3
        if kind == BEFORE:
            self._before_ms.append(ms)
            return None  # windows count the steps since the plan was installed
        if kind == PLAN and judged:
            self._plan_ms.append(ms)
        elif kind == EAGER and judged:
            self._eager_ms.append(ms)
        self._steps += 1
        if self._steps % self.window:
            return None
        closed, self._plan_ms = self._plan_ms, []
        return closed

    def eager_ms(self) -> float | None:
        """The median of the recent eager reference steps the guard timed (``None``: none yet)."""
        return statistics.median(self._eager_ms) if self._eager_ms else None

    def before_ms(self) -> float | None:
        """The median of the eager steps before the plan but the first, which creates the optimizer's state and the
        libraries' handles (``None``: no such step)."""
        later = list(self._before_ms)[1:]
        return statistics.median(later) if later else None


def window_speedup(plan_ms: Sequence[float], eager_ms: float | None, least: int = 1) -> float | None:
    """Eager's step time over the window's median plan step; ``None`` without eager's time or with fewer than
    ``least`` plan steps to judge (a window that was mostly the eager reference).

    Example::

        >>> window_speedup([10.0, 12.0, 400.0], eager_ms=12.0), window_speedup([10.0], eager_ms=12.0, least=2)
        (1.0, None)
    """
    if not eager_ms or len(plan_ms) < max(1, least):
        return None
    return eager_ms / statistics.median(plan_ms)
