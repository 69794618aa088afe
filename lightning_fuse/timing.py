"""Step timers that never synchronise per step, and the schedule of eager reference steps.

On CUDA a step is timed with two events queued on the current stream and read once per epoch; on CPU with
``time.perf_counter``. Eager reference steps are spread through each epoch in short chunks, so the compiled and
eager medians see the same data, the same machine state and the same drift.

Example::

    >>> timer = StepTimer(torch.device("cpu"))
    >>> timer.start(); timer.stop("compiled")
    >>> sorted(timer.collect())
    ['compiled']
"""

from __future__ import annotations

import math
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
    """Times training steps on ``device`` without a per-step ``synchronize()``.

    Args:
        device: Where the steps run; CUDA uses events, anything else ``time.perf_counter``.

    Example::

        >>> timer = StepTimer(torch.device("cpu"))
        >>> for _ in range(3):
        ...     timer.start(); timer.stop("eager")
        >>> len(timer.collect()["eager"])
        3
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._pending: list[tuple[str, object, object]] = []
        self._free_events: list[torch.cuda.Event] = []
        self._start: object = None

    def reserve(self, steps: int) -> None:
        """Create the CUDA events of ``steps`` steps now, so no step pays for creating its events."""
        if self._cuda:
            missing = 2 * min(steps, 4096) - len(self._free_events)
            self._free_events += [torch.cuda.Event(enable_timing=True) for _ in range(max(0, missing))]

    def start(self) -> None:
        self._start = self._mark()

    def stop(self, kind: str) -> None:
        if self._start is None:
            return
        self._pending.append((kind, self._start, self._mark()))
        self._start = None

    def collect(self) -> dict[str, list[float]]:
        """Milliseconds per step, by kind, for every step since the last call (one sync on CUDA)."""
        if self._cuda and self._pending:
            self._pending[-1][2].synchronize()  # the last event done means every earlier one is done
        times: dict[str, list[float]] = defaultdict(list)
        for kind, begin, end in self._pending:
            if self._cuda:
                times[kind].append(begin.elapsed_time(end))
                self._free_events += [begin, end]
            else:
                times[kind].append((end - begin) * 1e3)
        self._pending.clear()
        return dict(times)

    def _mark(self) -> object:
        if not self._cuda:
            return time.perf_counter()
        event = self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)
        event.record()
        return event


class EagerSchedule:
    """Which steps of an epoch run eagerly (under ``torch.compiler.set_stance("force_eager")``) as the reference.

    Args:
        eager_steps: Eager steps per epoch; ``0`` disables the reference. At most a third of an epoch's timed steps
            run eagerly, so short epochs get fewer.
        chunk: Eager steps per visit (the count is split into count // chunk visits, spread evenly). The first step of
            a chunk, and the first compiled step after it, switch modes (allocator, caches) and are not timed.
        period: Steps between chunks when the epoch length is unknown (an iterable dataset).

    Example::

        >>> schedule = EagerSchedule(eager_steps=4, chunk=2)
        >>> schedule.plan_epoch(steps=20, first=0)
        >>> sorted(schedule.steps)
        [4, 5, 14, 15]
    """

    def __init__(self, eager_steps: int, chunk: int = 3, period: int = 50) -> None:
        self.eager_steps = eager_steps
        self.chunk = chunk
        self.period = period
        self.steps: set[int] = set()

    def plan_epoch(self, steps: int | float, first: int) -> None:
        """Plan the eager steps of an epoch of ``steps`` batches whose timed steps start at batch ``first``."""
        self.steps = set()
        count = self.eager_steps if math.isinf(steps) else min(self.eager_steps, (int(steps) - first) // 3)
        if count < 2:  # a lone eager step only switches modes: nothing to time
            return
        chunks = max(1, count // self.chunk)
        size = count // chunks
        if math.isinf(steps):
            starts = [first + self.period * (k + 1) for k in range(chunks)]
        else:
            spacing = (int(steps) - first) / chunks
            starts = [max(first, first + int(spacing * (k + 0.5)) - size // 2) for k in range(chunks)]
        self.steps = {start + offset for start in starts for offset in range(size)}

    def is_eager(self, batch_idx: int) -> bool:
        return batch_idx in self.steps

    def is_transition(self, batch_idx: int) -> bool:
        """The first step of an eager chunk, or the first compiled step after one: switching modes, not timed."""
        return (batch_idx in self.steps) != (batch_idx - 1 in self.steps)


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
