"""Step times: timers that never synchronise per step, the eager reference's schedule, and the speedup's interval.

A step is timed from its start to the next step's start (the whole loop iteration): on CUDA with one event per
step queued on the current stream and read once per epoch, on CPU with ``time.perf_counter``. The eager reference
steps cost a fixed share of the training time (:class:`EagerSchedule`, :func:`affordable_reference`); the speedup is
the ratio of the eager and compiled medians, with a bootstrap interval (:mod:`~lightning_fuse.interval`) over a
rolling pool of recent reference steps, chunk by chunk (:class:`ReferencePool`).

Example::

    >>> timer = StepTimer(torch.device("cpu"))
    >>> for _ in range(2):
    ...     timer.start(); timer.stop("compiled")
    >>> sorted(timer.collect())
    ['compiled']
    >>> point, low, high = speedup_interval([29.0, 30.0, 31.0, 30.5], [9.9, 10.0, 10.1, 10.0])
    >>> round(point, 2), low < point < high
    (3.02, True)
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

import torch

from lightning_fuse.interval import speedup_interval
from lightning_fuse.options import REFERENCE_BUDGET, check_reference_budget

COMPILED = "compiled"
EAGER = "eager"
LEAD_IN = "lead_in"
"""The untimed eager step before each chunk of the reference, which starts on an idle device
(:meth:`StepTimer.wait_for_device`): part of the reference's cost, never of a median."""
SKIPPED = "skipped"
"""Kinds of step. Skipped steps (warmup, compiling, partial batches, profiling) never enter a median."""
_INTERRUPTED = "interrupted"  # something that is not training (validation) ran inside it: never reported


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
        self.runs: dict[str, list[int]] = {}
        """At the last :meth:`collect`, how many steps each run of one kind in a row held, by kind, in order: a
        reference chunk is one run of eager steps (:attr:`ReferencePool.chunks`)."""

    def reserve(self, steps: int) -> None:
        """Create the CUDA events of ``steps`` steps now, and look up the stream the steps run on.

        Both cost more than recording an event, so no step pays for them; call it at each epoch start.
        """
        if self._cuda:
            missing = min(steps, 4096) - len(self._free_events)
            self._free_events += [torch.cuda.Event(enable_timing=True) for _ in range(max(0, missing))]
            self._stream = torch.cuda.current_stream()

    def wait_for_device(self) -> None:
        """Wait until the device has run all the work queued so far (CUDA; nothing elsewhere).

        Marks are timed where the device reaches them. A plan step that keeps the GPU busier than the host leaves
        work queued behind it, and an eager step right after it would be timed as the queue drains, faster than
        eager runs on its own: on an H100 a GPT's first eager steps after a graph replay read 4.9 ms against eager's
        11 ms (``benchmarks/RESULTS.md``). Call it before the first of timed eager steps that follow plan steps: at a
        reference chunk's untimed first step, and where the optimizer graph's trial turns to an eager block. The
        running guard calls it too, after a step's mark, to time eager steps to their device's end
        (:mod:`~lightning_fuse.running_guard`).
        """
        if self._cuda:
            torch.cuda.synchronize()

    def start(self) -> None:
        """Mark the start of a step, which is also the end of the one before."""
        self.stop(SKIPPED)  # a step that never said what it was stays untimed
        self._marks.append(self._mark())

    def stop(self, kind: str) -> None:
        """Say what the current step was (``kind``); its time is known at the next :meth:`start`."""
        if len(self._kinds) < len(self._marks):
            self._kinds.append(kind)

    def interrupt(self) -> None:
        """Leave the current step out entirely: something that is not training (validation, say) runs before the
        next, so its time is not a training step's, not even a skipped one's."""
        if self._marks:
            self.stop(_INTERRUPTED)
            self._kinds[-1] = _INTERRUPTED

    def collect(self, include_skipped: bool = False) -> dict[str, list[float]]:
        """Milliseconds per step, by kind, for every ended step since the last call (one sync on CUDA).

        With ``include_skipped`` the untimed steps (warmup, compiling, partial batches) come back too, under
        :data:`SKIPPED`, so that the sum of every list is the epoch's training time (less interrupted steps and the
        last one); :func:`summarize` reads that as the denominator of the reference's cost.
        """
        times: dict[str, list[float]] = defaultdict(list)
        runs: dict[str, list[int]] = defaultdict(list)
        marks, previous = self._marks, None
        if self._cuda and len(marks) > 1:
            marks[-1].synchronize()  # the last event done means every earlier one is done
        for kind, begin, end in zip(self._kinds, marks, marks[1:]):
            if kind != _INTERRUPTED and (kind != SKIPPED or include_skipped):
                times[kind].append(begin.elapsed_time(end) if self._cuda else (end - begin) * 1e3)
                if kind == previous:
                    runs[kind][-1] += 1
                else:
                    runs[kind].append(1)
            previous = kind
        self.runs = dict(runs)
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


CHUNK = 3
"""Timed eager steps in a row, each run of them after one untimed eager step (the switch from compiled code).

Why 3: a shared host's speed moves more between moments of a run than within one. On the H100 machines eager
ResNet-18 ran 8.2 ms a step while the host was fast and 10.5 ms while it was slow (medians of 100-step blocks), the
two alternating within seconds; the medians of one fit's 5-step chunks spread by 13-25% (lognormal sd), and one
chunk missed the fit's median by 7-15% where two missed it by 6-8% (``benchmarks/RESULTS.md``). So a budget buys
more by sampling more moments than by timing more steps of one. A chunk's lead-in is pure cost: a chunk of ``n``
spends ``n / (n + 1)`` of its eager time on timed steps, 67% at 2, 75% at 3, 83% at 5, and chunks of 3 give 1.5
times the moments of chunks of 5 for a budget. The first timed step of a chunk ran 7% slower than the chunk's later
ones (the median over eight fits), the second 2%: a chunk's median of 3 leaves the first out where a median of 2
would take half of it."""
FIRST_REFERENCE = 3
"""Timed eager steps of the fit's first measurement, taken before any step time is known (so before any budget is
earned): one at each of three moments of the first epoch, each after its lead-in, for the six eager steps one chunk
of 5 cost. Three moments, not two chunks of 2: the interval's Student-t over the moments has two degrees of freedom
instead of one, a third of the width at the same spread (:mod:`~lightning_fuse.interval`). A single timed step
carries the switch's transient (a chunk's first step ran 7% slower than its later ones, the median over eight fits,
0.95-1.11), less than the host's spread between moments (13-26%), which the interval covers."""
MAX_EAGER_SHARE = 1 / 3
"""At most this share of an epoch's steps run eagerly for the reference; a short epoch gets fewer reference steps."""
UNKNOWN_EPOCH_STEPS = 1000
"""Steps an epoch of unknown length (an iterable dataset) is planned for: its chunks fall within these."""
FIRST_CHUNK_DELAY = 40
"""At least this many plan steps come before the first measurement (fewer in a short epoch: at most half its steps
after the plan settles). Taken right after the plan search, the reference ran up to 37% slower than plain eager on
GPU-bound models (ResNet-18 at batch 256, BERT at 128, H100), while chunks taken later matched plain eager within
1-3%. The cause is not pinned down (the search leaves the GPU idle and inductor's workers busy, and the optimizer
graph's trial starts then); ``benchmarks/RESULTS.md`` has the measurements."""
THIN_REFERENCE = 2 * CHUNK
"""A pooled reference of fewer timed eager steps than this is thin: the verdict says so. Two full chunks sample two
moments of the run, which the interval then resamples (:mod:`~lightning_fuse.interval`); a fit too short for its
budget gets only the first measurement (:data:`FIRST_REFERENCE` steps, :class:`EagerSchedule`), which is thin."""


def reference_step_cost(eager_ms: float, compiled_ms: float, budget: float) -> float:
    """Milliseconds of credit one reference step uses: its eager time, less the budget's share of that time.

    A reference step runs for ``eager_ms`` instead of ``compiled_ms``; the budget allows ``budget`` of the training
    time, which that step lengthens by ``eager_ms - compiled_ms``. Hence ``k`` reference steps in an epoch of ``n``
    fit the budget when ``k * eager_ms <= budget * (k * eager_ms + (n - k) * compiled_ms)``, that is when
    ``k * reference_step_cost(...) <= budget * n * compiled_ms``. The cost is linear: given the total eager time of
    several steps and the compiled time they replaced, it is theirs.

    Example::

        >>> round(reference_step_cost(eager_ms=30.0, compiled_ms=10.0, budget=0.02), 6)
        29.6
        >>> round(reference_step_cost(eager_ms=180.0, compiled_ms=60.0, budget=0.02), 6)  # six such steps
        177.6
    """
    return eager_ms * (1 - budget) + budget * compiled_ms


def _fit_in_room(timed: int, room: float, chunk: int = CHUNK) -> int:
    """The most timed steps, at most ``timed``, whose chunks of ``chunk`` and their lead-ins fit in ``room`` steps."""
    while timed and timed + math.ceil(timed / chunk) > room:
        timed -= 1
    return timed


def affordable_reference(
    epoch_steps: int,
    eager_ms: float,
    compiled_ms: float,
    budget: float = REFERENCE_BUDGET,
    credit_ms: float = 0.0,
    max_timed: int = 20,
    room: float | None = None,
) -> tuple[int, float]:
    """How many timed eager reference steps an epoch can afford, and the credit it leaves for the next epochs.

    The epoch earns ``budget * epoch_steps * compiled_ms`` (its share of the training time, counting every step as
    compiled: a lower bound, since warmup and compiling steps take longer). Reference steps are bought in whole
    chunks (:data:`CHUNK` timed steps and one lead-in, each step at :func:`reference_step_cost`); what is left,
    or what a chunk could not yet buy, carries over as credit, so a budget worth a fraction of a chunk per epoch
    places one chunk every few epochs. A negative ``credit_ms`` is a debt (the fit's first measurement is taken
    before any step time is known). At most ``max_timed`` timed steps, and chunks fill at most ``room`` steps
    (default: :data:`MAX_EAGER_SHARE` of the epoch).

    Args:
        epoch_steps: Steps in the epoch.
        eager_ms: Estimated eager step time (the reference's median so far).
        compiled_ms: Estimated compiled step time.
        budget: Share of the training time the reference may take, e.g. ``0.02``.
        credit_ms: Credit (or, negative, debt) carried from earlier epochs.
        max_timed: Upper bound on the epoch's timed eager steps (``eager_steps``).
        room: Steps of the epoch that can hold the reference's steps.

    Returns:
        ``(timed, credit_ms)``: timed eager steps to place (their lead-ins are ``ceil(timed / CHUNK)`` more) and the
        credit after paying for them.

    Example::

        >>> timed, credit = affordable_reference(1000, eager_ms=11.0, compiled_ms=10.0)  # 1.1x: 200 ms, 4 chunks
        >>> timed, round(credit, 2)
        (12, 24.32)
        >>> affordable_reference(50, eager_ms=50.0, compiled_ms=10.0)  # 5x: 10 ms is credit, no chunk yet
        (0, 10.0)
    """
    if not (eager_ms > 0 and compiled_ms > 0):
        raise ValueError(f"Step times must be > 0 ms, got eager_ms={eager_ms}, compiled_ms={compiled_ms}.")
    unit = reference_step_cost(eager_ms, compiled_ms, budget)
    available = credit_ms + budget * epoch_steps * compiled_ms
    chunk = min(CHUNK, max_timed)
    chunks = max(0, math.floor(available / ((chunk + 1) * unit))) if chunk else 0
    room = epoch_steps * MAX_EAGER_SHARE if room is None else room
    timed = _fit_in_room(min(max_timed, chunks * chunk), room)
    return timed, available - (timed + math.ceil(timed / CHUNK)) * unit


class EagerSchedule:
    """Which training steps run eagerly: a few untimed ones at fit start, then the eager reference, within a budget.

    The fit starts with ``warmup`` untimed eager steps (CUDA context, library handles, allocator growth; the FLOP
    count runs here) and ``profiled`` ones for ``profile_steps``; then the model compiles. The reference's timed
    eager steps run in chunks of up to :data:`CHUNK`, each after one untimed lead-in step, spaced evenly over an
    epoch's steps after compile and warmup, so the eager and compiled medians come from the same minutes of the
    same run (on shared machines host-bound steps drift by 5-10% within a run).

    How many: the first epoch takes :data:`FIRST_REFERENCE` steps, one a chunk, spread over its steps after compile
    and warmup (and :data:`FIRST_CHUNK_DELAY` plan steps more, or less in a short epoch), as nothing is known
    before; from then on, the caller passes the step times measured so far and :func:`affordable_reference` buys
    what the budget allows. At each epoch's end the caller enters what the epoch's reference steps took
    (:meth:`settle_epoch`), so the ledger holds the budget against the reference's real cost, lead-ins and slow
    steps included, and plans the next epochs at its real cost per step. So the reference (timed steps and
    lead-ins) takes at most ``reference_budget`` of the fit's training time, once the fit is long enough to repay
    that first measurement (``6 * eager_ms / compiled_ms / reference_budget`` steps: 300 at 1x, 1500 at 5x); a
    shorter fit spends the first measurement, the least that measures anything.

    Args:
        eager_steps: At most this many timed eager steps per epoch; ``0`` turns the reference off (the model
            compiles on the first step, and no step runs eagerly).
        reference_budget: Share of the training time the reference may take; ``None`` spends no budget but places
            ``eager_steps`` in every epoch that has room (the dense reference of earlier versions).
        warmup: Untimed eager steps at fit start.
        profiled: Untimed eager steps after the warmup, for ``profile_steps``.

    Raises:
        ValueError: If ``eager_steps`` is negative or ``reference_budget`` is not in (0, 0.5].

    Example::

        >>> schedule = EagerSchedule(eager_steps=20, warmup=2)
        >>> schedule.plan_epoch(first_step=0, steps=100, settle=1)  # nothing known yet: 3 moments, 40 steps on
        3
        >>> [step for step in range(100) if schedule.is_eager(step)]  # fit start, then lead-in and timed, thrice
        [0, 1, 51, 52, 70, 71, 88, 89]
        >>> schedule.settle_epoch(steps=100, reference_ms=180.0, reference_steps=6, compiled_ms=10.0)  # it ended
        >>> round(schedule.credit_ms, 1)  # 2% of 100 steps at 10 ms, less what 6 reference steps at 30 ms cost
        -157.6
        >>> schedule.plan_epoch(first_step=100, steps=100, settle=1, eager_ms=30.0, compiled_ms=10.0)  # in debt
        0
    """

    def __init__(
        self, eager_steps: int = 20, *, reference_budget: float | None = REFERENCE_BUDGET, warmup: int = 3,
        profiled: int = 0,
    ) -> None:  # fmt: skip
        if eager_steps < 0:
            raise ValueError(f"`eager_steps` must be >= 0 (0 turns the reference off), got {eager_steps}.")
        if reference_budget is not None:
            check_reference_budget(reference_budget)
        self.eager_steps = eager_steps
        self.reference_budget = reference_budget
        self.warmup = warmup if eager_steps else 0
        self.start_length = self.warmup + (profiled if eager_steps else 0)
        self.credit_ms = 0.0
        """Budget earned and not yet spent, in ms (negative: the first measurement's debt, not yet repaid)."""
        self._unsettled: list[tuple[int, float, int]] = []  # epochs (steps, reference ms, reference steps) that
        # ended before any compiled step time was known, entered with the first one
        self._spent = (0.0, 0)  # the reference's milliseconds and steps so far (timed and lead-ins)
        self._timed: set[int] = set()
        self._lead_ins: set[int] = set()

    def plan_epoch(
        self, first_step: int, steps: int, settle: int, eager_ms: float | None = None,
        compiled_ms: float | None = None,
    ) -> int:  # fmt: skip
        """Place the reference chunks of the epoch whose fit steps are ``first_step`` to ``first_step + steps - 1``.

        ``settle`` compiled steps after the fit-start steps get no chunk (they compile and capture). The epoch's
        last step has no end and gets none either. ``eager_ms`` and ``compiled_ms`` are the step times measured so
        far (e.g. the reference pool's median and the last epoch's compiled median); while the eager one is
        unknown, the epoch gets the first measurement (:data:`FIRST_REFERENCE`). Returns how many timed eager steps
        were placed.
        """
        self._timed, self._lead_ins = set(), set()
        if not self.eager_steps:
            return 0
        low = max(first_step, self.start_length + settle)
        span = first_step + steps - 1 - low
        room = span * MAX_EAGER_SHARE
        first = eager_ms is None and self.reference_budget is not None
        chunk = 1 if first else CHUNK  # the first measurement: one timed step at each of its moments
        if self.reference_budget is None:
            timed = _fit_in_room(self.eager_steps, room)
        elif first or compiled_ms is None:
            timed = _fit_in_room(min(self.eager_steps, FIRST_REFERENCE), room, chunk) if first else 0
        else:
            spent_ms, spent_steps = self._spent
            cost_ms = spent_ms / spent_steps if spent_steps else eager_ms  # what a reference step has really cost
            timed, _ = affordable_reference(
                steps, cost_ms, compiled_ms, self.reference_budget, self.credit_ms, self.eager_steps, room
            )
        if first:  # its moments spread over the epoch's steps after the delay
            delay = min(FIRST_CHUNK_DELAY, max(0, span // 2 - CHUNK))
            low, span = low + delay, span - delay
        self._place(low, span, timed, chunk)
        return timed

    def settle_epoch(self, steps: int, reference_ms: float, reference_steps: int, compiled_ms: float | None) -> None:
        """Enter an ended epoch in the budget's ledger: what its reference took, not what it was planned to take.

        The epoch earned ``reference_budget`` of ``steps`` steps at ``compiled_ms`` (every step counted as compiled,
        as :func:`affordable_reference` counts them), and its reference steps, timed and lead-ins, took
        ``reference_ms`` over ``reference_steps`` steps. An epoch that ended before any compiled step time was known
        (``compiled_ms=None``) is entered with the first one.
        """
        if self.reference_budget is None:  # the dense reference spends no budget
            return
        spent_ms, spent_steps = self._spent
        self._spent = (spent_ms + reference_ms, spent_steps + reference_steps)
        self._unsettled.append((steps, reference_ms, reference_steps))
        if compiled_ms is None:
            return
        budget = self.reference_budget
        for epoch_steps, epoch_reference_ms, epoch_reference_steps in self._unsettled:
            charge = reference_step_cost(epoch_reference_ms, compiled_ms * epoch_reference_steps, budget)
            self.credit_ms += budget * epoch_steps * compiled_ms - charge
        self._unsettled = []

    def _place(self, low: int, span: int, timed: int, chunk: int) -> None:
        """Spread ``timed`` steps in chunks of up to ``chunk`` evenly over ``span`` steps from ``low``, each after a
        lead-in step."""
        chunks = math.ceil(timed / chunk)
        for index in range(chunks):
            size = timed // chunks + (index < timed % chunks)
            lead_in = low + max(0, int((index + 0.5) * span / chunks - (size + 1) / 2))
            self._lead_ins.add(lead_in)
            self._timed.update(range(lead_in + 1, lead_in + 1 + size))

    def state_dict(self) -> dict[str, object]:
        """The budget's ledger, for a checkpoint (the placed chunks are re-planned at the next epoch start)."""
        return {"credit_ms": self.credit_ms, "ended": [list(entry) for entry in self._unsettled],
                "spent": list(self._spent)}  # fmt: skip

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`'s ledger. A checkpoint of a version that charged planned steps has no ended
        epochs, nor the reference's cost so far: its first measurement, if still unpaid, goes uncharged."""
        self.credit_ms = float(state.get("credit_ms", 0.0))
        self._unsettled = [(int(steps), float(ms), int(count)) for steps, ms, count in state.get("ended", [])]
        spent_ms, spent_steps = state.get("spent", (0.0, 0))
        self._spent = (float(spent_ms), int(spent_steps))

    def is_eager(self, fit_step: int) -> bool:
        """Whether the step runs the eager model (fit-start steps, the reference's lead-ins and timed steps)."""
        return fit_step < self.start_length or fit_step in self._timed or fit_step in self._lead_ins

    def is_lead_in(self, fit_step: int) -> bool:
        """Whether the step is a reference chunk's untimed lead-in (label it :data:`LEAD_IN`)."""
        return fit_step in self._lead_ins

    def is_profiled(self, fit_step: int) -> bool:
        return self.warmup <= fit_step < self.start_length

    def is_timed(self, fit_step: int) -> bool:
        """Whether the step is one of the reference's timed eager steps (label it :data:`EAGER`)."""
        return fit_step in self._timed


class ReferencePool:
    """The most recent eager reference steps, pooled over epochs, for the speedup's eager side.

    The reference is sparse (a chunk every few epochs when the budget is tight), so one epoch may have none and
    another only a chunk. The pool keeps the last ``chunks`` chunks' worth of steps (``chunks * CHUNK``): enough for
    a median and an interval, and recent enough to follow the drift of the machine's eager speed. It remembers which
    chunk each step came from, so that the interval can resample the moments of the run (:attr:`chunks`).

    Args:
        chunks: Chunks of :data:`CHUNK` steps to keep.

    Raises:
        ValueError: If ``chunks`` is not at least 1.

    Example::

        >>> pool = ReferencePool(chunks=4)  # 12 steps
        >>> pool.add([30.0] * 3, epoch=0)
        >>> pool.add([], epoch=1)  # an epoch without reference steps keeps the pool as it was
        >>> pool.add([32.0] * 6, epoch=2, runs=[3, 3])
        >>> len(pool.samples), pool.epochs
        (9, (0, 2))
        >>> pool.age(epoch=2), pool.age(epoch=5)  # 0: the epoch measured its own; 3: the newest chunk is 3 old
        (0, 3)
        >>> pool.add([31.0] * 4, epoch=6, runs=[2, 2])  # two chunks in one epoch; the oldest steps leave
        >>> pool.chunks
        [2, 3, 3, 2, 2]
    """

    def __init__(self, chunks: int = 7) -> None:
        if chunks < 1:
            raise ValueError(f"`chunks` must be >= 1 (chunks of {CHUNK} steps to keep), got {chunks}.")
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=chunks * CHUNK)  # (epoch, chunk, ms)
        self._chunk = 0

    def add(self, eager_ms: Sequence[float], epoch: int, runs: Sequence[int] | None = None) -> None:
        """Add one epoch's timed eager reference steps (oldest ones leave the pool); ``runs``: how many of them
        each of the epoch's chunks holds, in order (:attr:`StepTimer.runs`), ``None``: one chunk."""
        sizes = list(runs) if runs is not None else [len(eager_ms)] * bool(len(eager_ms))
        if sum(sizes) != len(eager_ms):
            raise ValueError(f"`runs` {sizes} hold {sum(sizes)} steps, but `eager_ms` has {len(eager_ms)}.")
        steps = iter(eager_ms)
        for size in sizes:
            self._steps.extend((epoch, self._chunk, float(next(steps))) for _ in range(size))
            self._chunk += 1

    @property
    def samples(self) -> list[float]:
        """The pooled step times (ms), oldest first."""
        return [ms for _, _, ms in self._steps]

    @property
    def chunks(self) -> list[int]:
        """How many of :attr:`samples` each chunk still in the pool holds, oldest first (the oldest may be cut)."""
        return [len(list(steps)) for _, steps in groupby(self._steps, key=lambda step: step[1])]

    @property
    def epochs(self) -> tuple[int, int] | None:
        """The first and last epoch the pooled steps come from, or ``None`` when empty."""
        return (self._steps[0][0], self._steps[-1][0]) if self._steps else None

    def age(self, epoch: int) -> int | None:
        """Epochs from the newest pooled step to ``epoch``: 0 when ``epoch`` timed reference steps of its own,
        ``None`` when the pool is empty."""
        return epoch - self._steps[-1][0] if self._steps else None

    @property
    def thin(self) -> bool:
        """Fewer pooled steps than :data:`THIN_REFERENCE`: too few for the interval to judge a plan by."""
        return len(self._steps) < THIN_REFERENCE

    def median(self) -> float | None:
        """The pooled median (ms), the eager estimate to plan the next epoch with, or ``None`` when empty."""
        return statistics.median(self.samples) if self._steps else None

    def state_dict(self) -> dict[str, list]:
        return {"steps": [[epoch, ms, chunk] for epoch, chunk, ms in self._steps]}

    def load_state_dict(self, state: dict[str, list]) -> None:
        """Restore :meth:`state_dict`'s steps; a checkpoint of a version before chunks counts each epoch as one."""
        self._steps.clear()
        self._steps.extend((int(step[0]), int(step[2] if len(step) > 2 else step[0]), float(step[1]))
                           for step in state.get("steps", []))  # fmt: skip
        self._chunk = self._steps[-1][1] + 1 if self._steps else 0


@dataclass
class EpochTiming:
    """Step times of one epoch: medians, the speedup's interval and the reference's cost.

    Attributes:
        step_ms: Median compiled step (ms).
        eager_step_ms: Median eager reference step (ms), pooled over recent epochs where the caller pooled.
        compiled_steps: Compiled steps timed.
        eager_steps: Eager reference steps in the median.
        speedup_low: Lower bound of the speedup's interval (``None``: too few steps).
        speedup_high: Upper bound of the speedup's interval.
        reference_ms: Time of this epoch's reference steps, timed and lead-in.
        reference_steps: How many steps those were.
        train_ms: This epoch's training time, as far as the timer saw it (0: unknown).
        reference_age: Epochs since the newest eager step in ``eager_step_ms``: 0 when the epoch timed its own,
            ``N`` when the eager side is a pool whose newest chunk is ``N`` epochs old (:meth:`ReferencePool.age`).

    Example::

        >>> EpochTiming(step_ms=10.0, eager_step_ms=30.0, compiled_steps=50, eager_steps=5).speedup
        3.0
    """

    step_ms: float | None
    eager_step_ms: float | None
    compiled_steps: int
    eager_steps: int
    speedup_low: float | None = None
    speedup_high: float | None = None
    reference_ms: float = 0.0
    reference_steps: int = 0
    train_ms: float = 0.0
    reference_age: int = 0

    @property
    def speedup(self) -> float | None:
        """Median eager step over median compiled step (below 1 when compiled is slower)."""
        if self.step_ms and self.eager_step_ms:
            return self.eager_step_ms / self.step_ms
        return None

    @property
    def reference_cost(self) -> float | None:
        """The reference's share of the epoch's training time (a fraction), or ``None`` if that time is unknown."""
        return self.reference_ms / self.train_ms if self.train_ms > 0 else None


def summarize(
    times: dict[str, list[float]], reference: Sequence[float] | None = None, confidence: float = 0.95,
    reference_age: int = 0, reference_chunks: Sequence[int] | None = None,
) -> EpochTiming:
    """One epoch's :class:`EpochTiming` from :meth:`StepTimer.collect`'s ``times``.

    Args:
        times: The epoch's step times by kind; with ``collect(include_skipped=True)`` their sum is the epoch's
            training time, the denominator of the reference's cost (without, the timed steps' sum stands in).
        reference: The eager sample to compare with, e.g. :attr:`ReferencePool.samples`; ``None``: this epoch's
            own eager steps.
        confidence: Confidence level of the speedup's interval.
        reference_age: How many epochs old the newest step of ``reference`` is (:meth:`ReferencePool.age`).
        reference_chunks: How many of ``reference``'s steps each of its chunks holds (:attr:`ReferencePool.chunks`),
            for the interval (:func:`~lightning_fuse.interval.speedup_interval`); ``None``: one chunk.

    Example::

        >>> timing = summarize({"compiled": [10.0, 10.2, 9.8], "eager": [30.0, 31.0], "lead_in": [33.0]})
        >>> timing.speedup, round(timing.reference_cost, 2)  # 94 of 124 ms were the reference's
        (3.05, 0.76)
    """
    compiled = times.get(COMPILED, [])
    eager = list(times.get(EAGER, []) if reference is None else reference)
    reference_steps = [*times.get(EAGER, []), *times.get(LEAD_IN, [])]  # this epoch's, timed and lead-in
    point, low, high = speedup_interval(eager, compiled, confidence, chunks=reference_chunks)
    return EpochTiming(
        step_ms=statistics.median(compiled) if compiled else None,
        eager_step_ms=statistics.median(eager) if eager else None,
        compiled_steps=len(compiled),
        eager_steps=len(eager),
        speedup_low=low,
        speedup_high=high,
        reference_ms=sum(reference_steps),
        reference_steps=len(reference_steps),
        train_ms=sum(sum(steps) for steps in times.values()),
        reference_age=reference_age,
    )
