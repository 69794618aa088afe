"""Step timers that never synchronise per step, and the schedule of eager reference steps.

A step is timed from its start to the next step's start (the whole loop iteration): on CUDA with one event per
step queued on the current stream and read once per epoch, on CPU with ``time.perf_counter``. The eager
reference steps are spread through every epoch (:class:`EagerSchedule`).

Example::

    >>> timer = StepTimer(torch.device("cpu"))
    >>> for _ in range(2):
    ...     timer.start(); timer.stop("compiled")
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


CHUNK = 5
"""Timed eager steps in a row. Each run of them starts with one untimed eager step: the switch from compiled code."""
MAX_EAGER_SHARE = 1 / 3
"""At most this share of an epoch's steps run eagerly for the reference; a short epoch gets fewer reference steps."""
UNKNOWN_EPOCH_STEPS = 1000
"""Steps an epoch of unknown length (an iterable dataset) is planned for: its chunks fall within these."""


class EagerSchedule:
    """Which training steps run eagerly: a few untimed ones at fit start, then the eager reference in every epoch.

    The fit starts with ``warmup`` untimed eager steps (CUDA context, library handles, allocator growth; the FLOP
    count runs here) and ``profiled`` ones for ``profile_steps``; then the model compiles. In each epoch,
    ``eager_steps`` timed eager steps run in chunks of up to :data:`CHUNK`, each after one untimed eager step,
    spaced evenly over the epoch's steps after compile and warmup. The epoch's eager and compiled medians thus come
    from the same minutes of the same run: on shared machines host-bound steps drift by 5-10% within a run, and a
    reference taken once, at fit start, carried that drift into every epoch's speedup.

    Args:
        eager_steps: Timed eager steps per epoch; ``0`` turns the reference off (the model compiles on the first
            step, and no step runs eagerly).
        warmup: Untimed eager steps at fit start.
        profiled: Untimed eager steps after the warmup, for ``profile_steps``.

    Example::

        >>> schedule = EagerSchedule(eager_steps=6, warmup=2)
        >>> schedule.plan_epoch(first_step=0, steps=40, settle=1)  # 2 chunks of 3, each after a lead-in step
        6
        >>> [step for step in range(40) if schedule.is_eager(step)]
        [0, 1, 10, 11, 12, 13, 28, 29, 30, 31]
        >>> [step for step in range(40) if schedule.is_timed(step)]
        [11, 12, 13, 29, 30, 31]
    """

    def __init__(self, eager_steps: int, warmup: int = 3, profiled: int = 0) -> None:
        self.eager_steps = eager_steps
        self.warmup = warmup if eager_steps else 0
        self.start_length = self.warmup + (profiled if eager_steps else 0)
        self._timed: set[int] = set()
        self._lead_ins: set[int] = set()

    def plan_epoch(self, first_step: int, steps: int, settle: int) -> int:
        """Place the reference chunks of the epoch whose fit steps are ``first_step`` to ``first_step + steps - 1``.

        ``settle`` compiled steps after the fit-start steps get no chunk (they compile and capture). The epoch's
        last step has no end and gets none either. Returns how many timed eager steps were placed.
        """
        low = max(first_step, self.start_length + settle)
        span = first_step + steps - 1 - low
        timed = self.eager_steps
        while timed and timed + math.ceil(timed / CHUNK) > span * MAX_EAGER_SHARE:
            timed -= 1
        self._timed, self._lead_ins = set(), set()
        chunks = math.ceil(timed / CHUNK)
        for index in range(chunks):
            size = timed // chunks + (index < timed % chunks)
            lead_in = low + int((index + 0.5) * span / chunks - (size + 1) / 2)
            self._lead_ins.add(lead_in)
            self._timed.update(range(lead_in + 1, lead_in + 1 + size))
        return timed

    def is_eager(self, fit_step: int) -> bool:
        return fit_step < self.start_length or fit_step in self._timed or fit_step in self._lead_ins

    def is_profiled(self, fit_step: int) -> bool:
        return self.warmup <= fit_step < self.start_length

    def is_timed(self, fit_step: int) -> bool:
        return fit_step in self._timed


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
