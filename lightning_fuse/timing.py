"""Step timers that never synchronise per step, and the window of eager reference steps.

A step is timed from its start to the next step's start (the whole loop iteration): on CUDA with one event per
step queued on the current stream and read once per epoch, on CPU with ``time.perf_counter``. The eager
reference steps are the first steps of the fit, before the model is compiled.

Example::

    >>> timer = StepTimer(torch.device("cpu"))
    >>> for _ in range(2):
    ...     timer.start(); timer.stop("compiled")
    >>> sorted(timer.collect())
    ['compiled']
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

COMPILED = "compiled"
EAGER = "eager"
SKIPPED = "skipped"
"""Kinds of step. Skipped steps (warmup, compiling, partial batches, profiling) never enter a median."""


class StepTimer:
    """Times training steps on ``device`` without a per-step ``synchronize()``: one mark per step, at its start.

    A step runs from its mark to the next step's mark, so its time is the whole loop iteration: the forward,
    backward and optimizer step, and the loop's own work between steps (fetching the batch, logging, hooks). That
    is what sets an epoch's duration. The last step before :meth:`collect` or :meth:`interrupt` has no end and is
    not timed.

    Args:
        device: Where the steps run; CUDA marks with events on the current stream, anything else with
            ``time.perf_counter``.

    Example::

        >>> timer = StepTimer(torch.device("cpu"))
        >>> for _ in range(4):
        ...     timer.start(); timer.stop("eager")
        >>> len(timer.collect()["eager"])  # the last step has no end yet
        3
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[object] = []
        self._kinds: list[str] = []
        self._free_events: list[torch.cuda.Event] = []
        self._stream: torch.cuda.Stream | None = None

    def reserve(self, steps: int) -> None:
        """Create the CUDA events of ``steps`` steps now, and look up the stream the steps run on.

        Both cost more than recording an event, so no step pays for them; call it at each epoch start.
        """
        if self._cuda:
            missing = min(steps, 4096) - len(self._free_events)
            self._free_events += [torch.cuda.Event(enable_timing=True) for _ in range(max(0, missing))]
            self._stream = torch.cuda.current_stream()

    def start(self) -> None:
        """Mark the start of a step, which is also the end of the one before."""
        self.stop(SKIPPED)  # a step that never said what it was stays untimed
        self._marks.append(self._mark())

    def stop(self, kind: str) -> None:
        """Say what the current step was (``kind``); its time is known at the next :meth:`start`."""
        if len(self._kinds) < len(self._marks):
            self._kinds.append(kind)

    def interrupt(self) -> None:
        """Leave the current step untimed: something that is not training (validation, say) runs before the next."""
        if self._marks:
            self.stop(SKIPPED)
            self._kinds[-1] = SKIPPED

    def collect(self) -> dict[str, list[float]]:
        """Milliseconds per step, by kind, for every ended step since the last call (one sync on CUDA)."""
        times: dict[str, list[float]] = defaultdict(list)
        marks = self._marks
        if self._cuda and len(marks) > 1:
            marks[-1].synchronize()  # the last event done means every earlier one is done
        for kind, begin, end in zip(self._kinds, marks, marks[1:]):
            if kind != SKIPPED:
                times[kind].append(begin.elapsed_time(end) if self._cuda else (end - begin) * 1e3)
        if self._cuda:
            self._free_events += marks
        self._marks, self._kinds = [], []
        return dict(times)

    def _mark(self) -> object:
        if not self._cuda:
            return time.perf_counter()
        event = self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)
        event.record(self._stream)  # None (no reserve() yet): the current stream
        return event


class EagerWindow:
    """The eager reference: the first steps of the fit run eagerly, before anything is compiled or captured.

    Args:
        eager_steps: Timed eager steps; ``0`` turns the reference off (the model compiles on the first step).
        warmup: Untimed eager steps first (CUDA context, library handles, allocator growth).
        profiled: Untimed eager steps after the warmup, for ``profile_steps``.

    Why first and not interleaved with compiled steps: once a CUDA graph was captured over compiled regions, each
    eager op cost 30-150% more host time in the same process (``benchmarks/results/step_trace/``), so eager steps
    run among compiled ones read 10-16% slower than a separate eager run and overstated the speedup.

    Example::

        >>> window = EagerWindow(eager_steps=3, warmup=2, profiled=1)
        >>> [window.is_eager(step) for step in range(7)]
        [True, True, True, True, True, True, False]
        >>> [window.is_timed(step) for step in range(7)]
        [False, False, False, True, True, True, False]
    """

    def __init__(self, eager_steps: int, warmup: int = 3, profiled: int = 0) -> None:
        self.warmup = warmup
        self.profiled = profiled
        self.length = warmup + profiled + eager_steps if eager_steps else 0

    def is_eager(self, fit_step: int) -> bool:
        return fit_step < self.length

    def is_profiled(self, fit_step: int) -> bool:
        return self.warmup <= fit_step < self.warmup + self.profiled and self.is_eager(fit_step)

    def is_timed(self, fit_step: int) -> bool:
        return self.warmup + self.profiled <= fit_step < self.length


@dataclass
class EpochTiming:
    """Median step times of one epoch."""

    step_ms: float | None
    eager_step_ms: float | None
    compiled_steps: int
    eager_steps: int

    @property
    def speedup(self) -> float | None:
        if self.step_ms and self.eager_step_ms:
            return self.eager_step_ms / self.step_ms
        return None


def summarize(times: dict[str, list[float]]) -> EpochTiming:
    compiled, eager = times.get(COMPILED, []), times.get(EAGER, [])
    return EpochTiming(
        step_ms=statistics.median(compiled) if compiled else None,
        eager_step_ms=statistics.median(eager) if eager else None,
        compiled_steps=len(compiled),
        eager_steps=len(eager),
    )
