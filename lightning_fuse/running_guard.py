"""The running guard: a plan slower than eager over a window of steps is found out mid-epoch, not at its end.

The plan is chosen on a few calls of one recorded input; a plan that then crawls in training (it recompiles at
every new sequence length, say) would otherwise run a whole epoch before the epoch-end check drops it.
:class:`RunningGuard` times, on the host clock, each step from its start to its end: the plan's steps, and eager's,
each run of them (a reference chunk, lead-in included) up to where the device has run it
(:meth:`RunningGuard.close_run`). A plan step that compiled or captured a graph is a one-time cost, left out of its
window's times, unless half the window's plan steps did so (a recompile at every new length is the crawl), or the
window's other plan steps ran no faster than eager: a plan that gains nothing between its compiles never pays them
back (torchvision's Faster R-CNN, each image's boxes a tensor of their own, recompiled 68 times in a 120-step fit on
an H200, and its plan measured 0.90x of eager only at the epoch's end: ``benchmarks/RESULTS.md``). A step in
which torch's cudagraph trees recorded a graph counts as a step of its window, but its time is left out, for the
fit's first :data:`EXCUSED_RECORDINGS` such steps: the sizes recorded are capped per fit
(:data:`~lightning_fuse.compiler.TREE_SIZES`), so recording is a one-time cost, and the recordings of a few lengths
met close together would otherwise make a window of a plan that then replays at 5x eager read slower than eager.
Every :data:`GUARD_WINDOW` steps the guard hands back the window's plan step times, which :func:`window_speedup`
compares with eager's step; the caller drops the plan below its margin.
Windows are counted in steps since the plan was installed, the same on every rank, so a decision shared between
ranks (one collective) falls on the same step everywhere.

Why eager's steps are timed to the device's end: the plan's steps keep the GPU's queue full, so that on the host
clock they read what the device takes; an eager step after an idle device (the fit's first steps; a reference
chunk, which starts on one) reads what its host work takes until the queue fills. Under FSDP2 on 2x H200 (GPT-2,
32 a rank), eager's first steps so read about 0.85 of a compiled plan's step that ran at 0.7 of eager's, and the
guard dropped that plan (``benchmarks/RESULTS.md``).

Example::

    >>> ticks = iter([tick / 8 for tick in range(100)])  # a fake clock: each reading 125 ms later
    >>> guard = RunningGuard(window=3, clock=lambda: next(ticks))
    >>> closed = []
    >>> for kind in (LEAD_IN, EAGER, PLAN, PLAN):
    ...     if kind == PLAN:
    ...         guard.close_run()  # the caller waited for the device to run the eager steps
    ...     guard.begin(kind); closed.append(guard.end())
    >>> closed, guard.eager_ms()  # the run: 4 readings apart over 2 steps
    ([None, None, Window(steady=[125.0], one_time=[]), None], 250.0)
    >>> window_speedup(Window([25.0, 30.0, 35.0], []), eager_ms=15.0)
    0.5
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from lightning_fuse.compiler import TREE_SIZES
from lightning_fuse.timing import EAGER, LEAD_IN

GUARD_WINDOW = 30
"""Steps in one window of the running guard: long enough to judge a plan on the steps that neither compiled nor
captured a graph (:meth:`RunningGuard.end`), short enough that a crawling plan (3 s a step where eager takes 0.2 s)
costs about 1.5 minutes."""
TRIMMED_SHARE = 0.1
"""The share of a window's plan steps, the slowest, that :func:`window_speedup` leaves out (a pause of the host's):
a cost that recurs in more steps than this shows. A median would hide one in fewer than half the steps: HF
Wav2Vec2 under ``mode="reduce-overhead"`` on an H200 ran a median step of 23 ms against eager's 36, and a mean of
141 (torch's cudagraph trees recorded again in a quarter to half of its steps; ``benchmarks/RESULTS.md``)."""
EXCUSED_RECORDINGS = TREE_SIZES + 8
"""Steps of a fit in which torch's cudagraph trees recorded a graph whose time is left out, as a one-time cost
(40): one per size the trees may record (:data:`~lightning_fuse.compiler.TREE_SIZES`) and a few for the first
steps' pieces. Past them, trees that keep recording cost the fit, and their steps are judged like any other."""
PLAN = "plan"
"""A step that runs the plan (the eager reference's timed steps are :data:`~lightning_fuse.timing.EAGER`)."""
BEFORE = "before"
"""An eager step before the plan is installed (the first steps, which the plan search waits for); the caller ends
each where its device work ends (:meth:`~lightning_fuse.timing.StepTimer.wait_for_device`)."""
EAGER_RUNS = 4
"""The guard's most recent runs of eager reference steps (chunks) kept: eager's step is the median of their mean
steps."""
EAGER_SAMPLES = 20
"""The most recent eager steps before the plan kept for their median."""


class Window(NamedTuple):
    """A closed window's plan step times (ms): ``steady``, the steps that neither compiled nor captured a graph,
    and ``one_time``, those that did (:meth:`RunningGuard.end`)."""

    steady: list[float]
    one_time: list[float]

    def judged(self, eager_ms: float) -> list[float]:
        """The times judged against eager's step ``eager_ms``: the steady steps', and those that compiled or
        captured too where they are half the window's plan steps or more (the plan crawls) or where the steady
        steps ran no faster than eager (the plan never pays them back); else those are a one-time cost, left out.

        Example::

            >>> Window([5.0, 5.0], [900.0]).judged(eager_ms=8.0), Window([5.0, 5.0], [900.0]).judged(eager_ms=4.0)
            ([5.0, 5.0], [5.0, 5.0, 900.0])
        """
        crawls = len(self.one_time) >= len(self.steady)
        no_gain = bool(self.steady) and _trimmed_mean(self.steady) >= eager_ms
        return [*self.steady, *self.one_time] if crawls or no_gain else self.steady


class RunningGuard:
    """Times the steps after the plan is installed and closes a window every ``window`` of them.

    Args:
        window: Steps per window (plan, eager and untimed steps alike); ``None``: :data:`GUARD_WINDOW`.
        clock: Seconds on the host.

    Example::

        >>> guard = RunningGuard(window=2)
        >>> guard.begin(None); guard.end() is None
        True
        >>> guard.begin(PLAN); guard.end() is not None  # the window's plan step times, in ms (a Window)
        True
    """

    def __init__(self, window: int | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.window = GUARD_WINDOW if window is None else window
        self._clock = clock
        self._plan_ms: list[float] = []
        self._one_time_ms: list[float] = []  # the window's plan steps that compiled or captured a graph
        self._eager_ms: deque[float] = deque(maxlen=EAGER_RUNS)  # mean steps of the runs of eager steps
        self._before_ms: deque[float] = deque(maxlen=EAGER_SAMPLES)
        self._steps = 0
        self._open: tuple[str | None, float] | None = None  # the running step's kind and start
        self._run: tuple[float, int] | None = None  # the open run of eager steps: its start and steps so far

    @property
    def in_eager_run(self) -> bool:
        """Whether a run of eager reference steps began and was not closed (:meth:`close_run`)."""
        return self._run is not None

    def begin(self, kind: str | None) -> None:
        """A step starts: ``PLAN`` (it runs the plan), ``EAGER`` or ``LEAD_IN`` (a reference step, timed or its
        chunk's first; either opens a run of eager steps), ``BEFORE`` (an eager step before the plan, outside every
        window) or ``None`` (not timed; inside a run, one of its steps)."""
        now = self._clock()
        if kind in (EAGER, LEAD_IN) and self._run is None:
            self._run = (now, 0)
        self._open = (kind, now)

    def end(self, judged: bool = True, one_time: bool = False) -> Window | None:
        """The step ended; at a window's end, that window's plan step times, and the next window begins.
        ``judged=False``: the step counts in its window, but its time is left out (it recorded a CUDA graph; a run
        of eager steps holding one is left out whole). ``one_time``: it compiled or captured a graph, and its time
        is kept apart (:func:`window_speedup` says when it counts)."""
        if self._open is None:
            return None
        kind, start = self._open
        self._open = None
        ms = (self._clock() - start) * 1e3
        if kind == BEFORE:
            self._before_ms.append(ms)
            return None  # windows count the steps since the plan was installed
        if kind == PLAN and judged:
            (self._one_time_ms if one_time else self._plan_ms).append(ms)
        if self._run is not None:
            self._run = (self._run[0], self._run[1] + 1) if judged else None
        self._steps += 1
        if self._steps % self.window:
            return None
        window, self._plan_ms, self._one_time_ms = Window(self._plan_ms, self._one_time_ms), [], []
        return window

    def close_run(self) -> None:
        """End the open run of eager steps where the device has run them all (call it after waiting for the
        device, before the next plan step begins): its mean step joins eager's."""
        if self._run is not None and self._run[1]:
            start, steps = self._run
            self._eager_ms.append((self._clock() - start) * 1e3 / steps)
        self._run = None

    def interrupt(self) -> None:
        """Something that is not training runs (validation): an open run of eager steps is left out."""
        self._run = None

    def eager_ms(self) -> float | None:
        """The median of the recent runs' mean eager steps (``None``: no run closed yet)."""
        return statistics.median(self._eager_ms) if self._eager_ms else None

    def before_ms(self) -> float | None:
        """The median of the eager steps before the plan but the first, which creates the optimizer's state and the
        libraries' handles (``None``: no such step)."""
        later = list(self._before_ms)[1:]
        return statistics.median(later) if later else None


def window_speedup(window: Window, eager_ms: float | None, least: int = 1) -> float | None:
    """Eager's step time (a mean over its runs) over the window's mean plan step, its slowest
    :data:`TRIMMED_SHARE` left out; ``None`` without eager's time or with fewer than ``least`` plan steps to judge
    (a window that was mostly the eager reference). Which steps are judged: :meth:`Window.judged`.

    Example::

        >>> fast = [10.0] * 9
        >>> window_speedup(Window([*fast, 4000.0], []), eager_ms=12.0)  # a pause in ten steps: left out
        1.2
        >>> window_speedup(Window(fast, [4000.0]), eager_ms=12.0)  # a compile, paid back by faster steps
        1.2
        >>> round(window_speedup(Window(fast[:7], [100.0] * 3), eager_ms=9.0), 2)  # one that never pays back
        0.3
        >>> round(window_speedup(Window(fast[:5], [100.0] * 5), eager_ms=12.0), 2)  # half the window compiled
        0.24
        >>> window_speedup(Window([10.0], []), eager_ms=12.0, least=2) is None
        True
    """
    if not eager_ms:
        return None
    times = window.judged(eager_ms)
    if len(times) < max(1, least):
        return None
    return eager_ms / _trimmed_mean(times)


def _trimmed_mean(times: list[float]) -> float:
    """The mean of ``times``, the slowest :data:`TRIMMED_SHARE` left out."""
    return statistics.fmean(sorted(times)[: len(times) - int(len(times) * TRIMMED_SHARE)])
