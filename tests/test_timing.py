"""Tests for lightning_fuse.timing: step timers, the budgeted eager reference schedule and the speedup interval."""

from __future__ import annotations

import itertools
import math
import statistics
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import lightning_fuse.timing as timing_module
from lightning_fuse.interval import speedup_interval
from lightning_fuse.meters import GpuMeters
from lightning_fuse.profiling import KernelStats, ProfileWindow, _union_us, kernel_stats
from lightning_fuse.timing import (
    CHUNK,
    COMPILED,
    EAGER,
    FIRST_CHUNK_DELAY,
    FIRST_REFERENCE,
    LEAD_IN,
    SKIPPED,
    EagerSchedule,
    ReferencePool,
    StepTimer,
    affordable_reference,
    summarize,
)

# ------------------------------------------------------------------ the schedule: fit start and the dense mode


def test_the_schedule_runs_warmup_and_profiled_steps_eagerly_at_fit_start_untimed():
    schedule = EagerSchedule(eager_steps=4, warmup=2, profiled=3)
    assert schedule.start_length == 5
    assert [s for s in range(5) if schedule.is_eager(s)] == [0, 1, 2, 3, 4]
    assert [s for s in range(5) if schedule.is_profiled(s)] == [2, 3, 4]
    assert not any(schedule.is_timed(s) for s in range(5))


def test_without_a_budget_each_epoch_spreads_eager_steps_in_chunks_after_an_untimed_lead_in():
    schedule = EagerSchedule(eager_steps=20, reference_budget=None, warmup=3)
    assert schedule.plan_epoch(first_step=0, steps=200, settle=3) == 20
    eager = [s for s in range(200) if schedule.is_eager(s)]
    timed = [s for s in range(200) if schedule.is_timed(s)]
    assert eager[:3] == [0, 1, 2] and len(timed) == 20 and len(eager) == 3 + 20 + 7  # 7 chunks of 3 or 2, 7 lead-ins
    chunks = runs(timed)
    assert [len(chunk) for chunk in chunks] == [CHUNK] * 6 + [2]  # contiguous runs
    assert all(schedule.is_lead_in(chunk[0] - 1) and not schedule.is_timed(chunk[0] - 1) for chunk in chunks)
    assert min(eager[3:]) > 6 and max(timed) < 199  # after compile and warmup; never the epoch's last step
    gaps = [b[0] - a[0] for a, b in zip(chunks, chunks[1:])]
    assert max(gaps) - min(gaps) <= 1  # evenly spaced over the epoch
    assert schedule.plan_epoch(first_step=200, steps=200, settle=3) == 20  # the next epoch: its own chunks
    assert not any(schedule.is_timed(s) for s in range(200))
    assert [s for s in range(200, 400) if schedule.is_timed(s)][0] - 200 < chunks[0][0]  # no settle steps now


def test_a_short_epoch_gets_at_most_a_third_of_its_steps_as_reference_and_a_tiny_one_none():
    schedule = EagerSchedule(eager_steps=20, reference_budget=None, warmup=3)
    placed = schedule.plan_epoch(first_step=100, steps=31, settle=3)
    assert placed == 7  # 7 timed + 3 lead-ins = 10 of the epoch's 30 steps that can have an end
    assert sum(schedule.is_eager(s) for s in range(100, 131)) == 10
    assert schedule.plan_epoch(first_step=0, steps=8, settle=3) == 0
    assert not any(schedule.is_eager(s) for s in range(3, 8))


def test_eager_steps_zero_runs_nothing_eagerly():
    schedule = EagerSchedule(eager_steps=0, profiled=3)
    assert schedule.plan_epoch(first_step=0, steps=500, settle=1, eager_ms=20.0, compiled_ms=10.0) == 0
    assert schedule.start_length == 0 and not any(schedule.is_eager(s) or schedule.is_timed(s) for s in range(500))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"eager_steps": -1}, "`eager_steps` must be >= 0"),
    ({"reference_budget": 0.0}, r"`reference_budget` must be in \(0, 0.5\]"),
    ({"reference_budget": 0.9}, "eager_steps=0 to turn"),
])  # fmt: skip
def test_the_schedule_rejects_bad_arguments_saying_what_to_do(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EagerSchedule(**kwargs)


# ------------------------------------------------------------------ the schedule: a time budget


def runs(steps: list[int]) -> list[list[int]]:
    """``steps`` (sorted) cut into runs of consecutive steps: the chunks."""
    chunks: list[list[int]] = []
    for step in steps:
        if chunks and chunks[-1][-1] == step - 1:
            chunks[-1].append(step)
        else:
            chunks.append([step])
    return chunks


def test_the_first_measurement_is_three_moments_spread_over_the_epoch_a_while_after_the_plan_settles():
    schedule = EagerSchedule(eager_steps=20, warmup=3)
    assert schedule.plan_epoch(first_step=0, steps=1000, settle=2) == FIRST_REFERENCE == 3  # nothing known yet
    settled = 3 + 2  # the fit-start steps, then the plan's compile and capture
    chunks = runs([s for s in range(1000) if schedule.is_timed(s)])
    assert [len(chunk) for chunk in chunks] == [1, 1, 1], "three moments of the run, for the cost of one chunk of 5"
    assert all(schedule.is_lead_in(chunk[0] - 1) for chunk in chunks)
    assert chunks[0][0] > settled + FIRST_CHUNK_DELAY, "not right after the search"
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(chunks)]
    assert min(gaps) > 250 and chunks[-1][-1] < 999, "far apart, within the epoch"


def test_a_short_first_epoch_takes_its_chunks_in_what_is_left_after_a_shorter_delay():
    schedule = EagerSchedule(eager_steps=20, warmup=3)
    assert schedule.plan_epoch(first_step=0, steps=40, settle=2) == FIRST_REFERENCE
    lead_ins = [s for s in range(40) if schedule.is_lead_in(s)]
    delay = (40 - 1 - 5) // 2 - CHUNK  # half of what is left, less a chunk
    assert len(lead_ins) == 3 and 5 + delay < lead_ins[0] < lead_ins[1] < lead_ins[2] < 40 - 1


def test_the_first_measurement_is_retried_until_an_epoch_has_room_for_it():
    schedule = EagerSchedule(eager_steps=20, warmup=3)
    assert schedule.plan_epoch(first_step=0, steps=8, settle=1) == 0  # 1 step of room: too few for a lead-in + 1
    assert schedule.plan_epoch(first_step=8, steps=50, settle=1) == FIRST_REFERENCE  # nothing measured: try again
    assert len([s for s in range(8, 58) if schedule.is_lead_in(s)]) == 3


def simulate_fit(epochs: int, epoch_steps: int, speedup: float, budget: float = 0.02, eager_steps: int = 20,
                 compiled_ms: float = 10.0, lead_in_cost: float = 1.0) -> tuple[list[int], list[float]]:  # fmt: skip
    """Plan a fit epoch by epoch with the true step times as estimates, and enter each epoch's reference cost at its
    end; per epoch, the reference steps placed and the reference's share of the fit's training time up to that
    epoch's end. A lead-in takes ``lead_in_cost`` times an eager step (the pool's median)."""
    eager_ms = compiled_ms * speedup
    schedule = EagerSchedule(eager_steps=eager_steps, reference_budget=budget, warmup=3)
    placed, shares, reference_ms, train_ms = [], [], 0.0, 0.0
    for epoch in range(epochs):
        first = epoch * epoch_steps
        known = {"eager_ms": eager_ms, "compiled_ms": compiled_ms} if epoch else {}
        timed = schedule.plan_epoch(first, epoch_steps, settle=1, **known)
        steps = range(first, first + epoch_steps)
        lead_ins = sum(schedule.is_lead_in(s) for s in steps)
        reference = sum(schedule.is_timed(s) for s in steps) + lead_ins
        assert reference == timed + math.ceil(timed / (CHUNK if epoch else 1)) and timed <= eager_steps
        start = sum(schedule.is_eager(s) for s in steps) - reference  # the fit-start steps
        epoch_reference_ms = (reference + (lead_in_cost - 1) * lead_ins) * eager_ms
        schedule.settle_epoch(epoch_steps, epoch_reference_ms, reference, compiled_ms)
        reference_ms += epoch_reference_ms
        train_ms += epoch_reference_ms + start * eager_ms + (epoch_steps - start - reference) * compiled_ms
        placed.append(reference)
        shares.append(reference_ms / train_ms)
    return placed, shares


@pytest.mark.parametrize("epoch_steps", [50, 1000])
@pytest.mark.parametrize("speedup", [1.1, 5.0])
def test_the_reference_stays_within_its_budget_over_a_fit_and_keeps_measuring(epoch_steps, speedup):
    budget, first_steps = 0.02, 2 * FIRST_REFERENCE  # each timed step after its lead-in
    payback_steps = first_steps * speedup / budget  # steps after which the first measurement's debt is repaid
    epochs = max(5, math.ceil(8 * payback_steps / epoch_steps))  # long enough for a few chunks after the first
    placed, shares = simulate_fit(epochs, epoch_steps, speedup, budget)
    assert placed[0] == first_steps, "the first epoch measures once, before anything is known"
    assert shares[-1] <= budget, f"the reference took {shares[-1]:.2%} of the fit"
    assert shares[-1] >= 0.6 * budget, f"only {shares[-1]:.2%}: the budget should be used to follow drift"
    for epoch, share in enumerate(shares):
        if (epoch + 1) * epoch_steps >= 1.05 * payback_steps:
            assert share <= budget, f"over budget after epoch {epoch}: {share:.2%}"
    chunk_epochs = [epoch for epoch, steps in enumerate(placed) if steps]
    assert len(chunk_epochs) >= 4, f"re-measured in epochs {chunk_epochs} only"


@pytest.mark.parametrize("speedup", [1.5, 5.0])
def test_the_budget_holds_when_the_reference_costs_more_than_its_median_step(speedup):
    """Lead-ins start on an idle device and carry the switch from the plan: the ledger charges what they took."""
    budget, first_steps = 0.02, 2 * FIRST_REFERENCE
    epochs = max(5, math.ceil(8 * first_steps * speedup / budget / 1000))
    placed, shares = simulate_fit(epochs, 1000, speedup, budget, lead_in_cost=2.0)
    assert shares[-1] <= budget, f"the reference took {shares[-1]:.2%} of the fit"
    assert sum(placed) > first_steps, "it still measures again"


def test_the_budget_ledger_survives_a_checkpoint():
    schedule = EagerSchedule(eager_steps=20)
    schedule.plan_epoch(first_step=0, steps=100, settle=1)
    schedule.settle_epoch(steps=100, reference_ms=200.0, reference_steps=6, compiled_ms=None)  # no plan step yet
    schedule.plan_epoch(first_step=100, steps=100, settle=1, eager_ms=30.0, compiled_ms=10.0)
    resumed = EagerSchedule(eager_steps=20)
    resumed.load_state_dict(schedule.state_dict())
    for ledger in (schedule, resumed):
        ledger.settle_epoch(steps=100, reference_ms=0.0, reference_steps=0, compiled_ms=10.0)
    assert resumed.credit_ms == schedule.credit_ms < 0  # still repaying the first measurement, entered late


@pytest.mark.parametrize(("epochs", "epoch_steps", "speedup"), [(1, 50, 5.0), (1, 1000, 5.0), (3, 50, 1.1)])
def test_a_short_fit_always_gets_one_measurement_and_no_more(epochs, epoch_steps, speedup):
    placed, shares = simulate_fit(epochs, epoch_steps, speedup)
    first_steps = 2 * FIRST_REFERENCE  # the floor, the least that measures: each timed step after its lead-in
    assert placed[0] == first_steps and sum(placed) == first_steps
    assert shares[-1] > 0


def test_eager_steps_caps_each_epoch_and_the_rest_is_carried_as_credit():
    placed, shares = simulate_fit(epochs=20, epoch_steps=1000, speedup=1.1, eager_steps=4)
    assert max(placed) == 6 and shares[-1] < 0.01  # 4 timed + 2 lead-ins: the cap binds, the budget does not


@pytest.mark.parametrize("epoch_steps", [50, 1000])
@pytest.mark.parametrize("speedup", [1.1, 5.0])
def test_affordable_reference_never_spends_more_than_the_epochs_earned(epoch_steps, speedup):
    compiled_ms, budget, credit = 10.0, 0.02, 0.0
    eager_ms, reference, total = compiled_ms * speedup, 0, 0.0
    for _ in range(200):
        timed, credit = affordable_reference(epoch_steps, eager_ms, compiled_ms, budget, credit)
        steps = timed + math.ceil(timed / CHUNK)
        assert credit >= 0 and (timed % CHUNK == 0 or timed == 20) and timed <= 20  # whole chunks, or the cap
        reference += steps
        total += steps * eager_ms + (epoch_steps - steps) * compiled_ms
    share = reference * eager_ms / total
    assert 0.8 * budget <= share <= budget


def test_affordable_reference_says_what_was_wrong_with_a_step_time():
    with pytest.raises(ValueError, match="Step times must be > 0 ms, got eager_ms=0"):
        affordable_reference(100, eager_ms=0.0, compiled_ms=10.0)


# ------------------------------------------------------------------ the interval


def lognormal_steps(rng: np.random.Generator, median_ms: float, n: int, sigma: float = 0.15) -> np.ndarray:
    return rng.lognormal(math.log(median_ms), sigma, n)  # the median of a lognormal is exp(mu)


@pytest.mark.parametrize(("true_ratio", "n_eager", "n_compiled"), [(3.0, 10, 100), (0.9, 5, 300), (1.4, 20, 1000)])
def test_the_interval_covers_the_true_speedup_in_nine_of_ten_trials(true_ratio, n_eager, n_compiled):
    covered = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        eager = lognormal_steps(rng, 10.0 * true_ratio, n_eager)
        compiled = lognormal_steps(rng, 10.0, n_compiled)
        point, low, high = speedup_interval(eager, compiled)
        assert low <= point <= high
        covered += low <= true_ratio <= high
    assert covered >= 180, f"covered the truth in {covered} of 200 trials"


def drifting_chunks(rng: np.random.Generator, median_ms: float, chunks: int, drift: float) -> list[np.ndarray]:
    """``chunks`` chunks of CHUNK steps, each at a moment whose speed drifted (lognormal, ``drift``) from the run's
    median, with a little noise within each: a shared machine between the moments of a reference."""
    return [lognormal_steps(rng, median_ms * math.exp(rng.normal(0.0, drift)), CHUNK, sigma=0.03)
            for _ in range(chunks)]  # fmt: skip


def test_resampling_the_chunks_covers_a_speedup_that_drift_between_them_hides_from_a_resampling_of_steps():
    covered = {"steps": 0, "chunks": 0}
    for seed in range(100):
        rng = np.random.default_rng(seed)
        chunks = drifting_chunks(rng, 30.0, chunks=4, drift=0.1)
        eager, compiled = np.concatenate(chunks), lognormal_steps(rng, 10.0, 300, sigma=0.03)
        for name, sizes in (("steps", None), ("chunks", [CHUNK] * 4)):
            _, low, high = speedup_interval(eager, compiled, chunks=sizes)
            covered[name] += low <= 3.0 <= high
    assert covered["chunks"] >= 80 and covered["chunks"] >= covered["steps"] + 10, covered


@pytest.mark.parametrize("sizes", [[1, 1, 1], [CHUNK, CHUNK], [1, 1, 1] + [CHUNK] * 4])
def test_at_the_hosts_drift_between_moments_the_interval_covers_the_speedup_from_two_moments_up(sizes):
    """The H100 machines' chunks spread by 13-26% between the moments of one fit: at 15%, the interval over a first
    measurement (three single steps), two chunks or a pool of seven still covers the truth, narrowing with moments."""
    covered, half_widths = 0, []
    for seed in range(200):
        rng = np.random.default_rng(seed)
        eager = np.concatenate([lognormal_steps(rng, 30.0 * math.exp(rng.normal(0.0, 0.15)), size, sigma=0.03)
                                for size in sizes])  # fmt: skip
        point, low, high = speedup_interval(eager, lognormal_steps(rng, 10.0, 300, sigma=0.03), chunks=sizes)
        covered += low <= 3.0 <= high
        half_widths.append((high - low) / 2 / point)
    assert covered >= 180, f"covered the truth in {covered} of 200 trials"
    if len(sizes) > 3:  # seven moments know the run's eager speed within about 14% at this drift
        assert statistics.median(half_widths) < 0.2


def test_without_drift_resampling_the_chunks_costs_little_width():
    rng = np.random.default_rng(0)
    eager, compiled = np.concatenate(drifting_chunks(rng, 30.0, 4, drift=0.0)), lognormal_steps(rng, 10.0, 300, 0.03)
    _, low, high = speedup_interval(eager, compiled)
    point, chunked_low, chunked_high = speedup_interval(eager, compiled, chunks=[CHUNK] * 4)
    assert chunked_low < point < chunked_high and chunked_high - chunked_low < 2 * (high - low)
    assert speedup_interval(eager, compiled, chunks=[len(eager)]) == (point, low, high), "one chunk: the steps'"
    with pytest.raises(ValueError, match=f"hold 10 steps, but `eager_ms` has {len(eager)}"):
        speedup_interval(eager, compiled, chunks=[5, 5])


def test_the_interval_narrows_with_more_steps():
    widths = []
    for n_eager, n_compiled in [(5, 50), (20, 200), (80, 800)]:
        half_widths = []
        for seed in range(30):
            rng = np.random.default_rng(seed)
            _, low, high = speedup_interval(lognormal_steps(rng, 30.0, n_eager), lognormal_steps(rng, 10.0, n_compiled))
            half_widths.append((high - low) / 2)
        widths.append(statistics.mean(half_widths))
    assert widths[0] > 1.5 * widths[1] > 1.5 * 1.5 * widths[2], widths


def test_a_plan_slower_than_eager_reads_below_one_with_its_interval():
    rng = np.random.default_rng(0)
    point, low, high = speedup_interval(lognormal_steps(rng, 9.0, 20), lognormal_steps(rng, 10.0, 200))
    assert 0.8 < low < point < high < 1.0  # not clamped at 1


def test_the_interval_is_reproducible_and_cheap_on_a_long_epoch():
    rng = np.random.default_rng(1)
    eager, compiled = lognormal_steps(rng, 30.0, 20), lognormal_steps(rng, 10.0, 100_000)
    started = time.perf_counter()
    first = speedup_interval(eager, compiled)
    assert time.perf_counter() - started < 2.0  # the compiled side is thinned for the bootstrap
    assert speedup_interval(eager, compiled) == first
    assert first[0] == pytest.approx(np.median(eager) / np.median(compiled))  # the point uses every step


@pytest.mark.parametrize(("eager", "compiled", "expected"), [
    ([], [10.0, 11.0], (None, None, None)),
    ([20.0, 21.0], [], (None, None, None)),
    ([20.0], [10.0, 10.0], (2.0, None, None)),
    ([20.0, 22.0], [10.0], (2.1, None, None)),
    ([20.0, 20.0], [10.0, 10.0], (2.0, None, None)),
    ([20.0, 20.0], [0.0, 0.0], (None, None, None)),
])  # fmt: skip
def test_degenerate_samples_give_the_point_alone_and_never_raise(eager, compiled, expected):
    point, low, high = speedup_interval(eager, compiled)
    assert (point, low, high) == (pytest.approx(expected[0]) if expected[0] else None, *expected[1:])


def test_the_reference_pool_keeps_the_last_chunks_so_the_median_follows_drift():
    pool = ReferencePool(chunks=2)
    assert pool.median() is None and pool.epochs is None and pool.thin
    pool.add([30.0] * CHUNK, epoch=0)
    assert pool.thin  # one chunk: too few steps to judge a plan by (THIN_REFERENCE)
    pool.add([33.0] * CHUNK, epoch=3)
    pool.add([36.0] * CHUNK, epoch=6)  # the machine's eager speed drifted: the oldest chunk leaves
    assert pool.samples == [33.0] * CHUNK + [36.0] * CHUNK and pool.epochs == (3, 6) and not pool.thin
    assert pool.median() == pytest.approx(34.5)
    restored = ReferencePool(chunks=2)
    restored.load_state_dict(pool.state_dict())
    assert restored.samples == pool.samples and restored.epochs == (3, 6)
    with pytest.raises(ValueError, match="`chunks` must be >= 1"):
        ReferencePool(chunks=0)


def test_the_pool_keeps_its_chunks_apart_so_the_interval_can_resample_the_moments():
    pool = ReferencePool(chunks=5)  # 15 steps
    pool.add([30.0] * 5, epoch=0)
    pool.add([33.0] * 4 + [36.0] * 5, epoch=1, runs=[4, 5])
    pool.add([], epoch=2, runs=[])
    assert pool.chunks == [5, 4, 5] and pool.samples[4:6] == [30.0, 33.0]
    pool.add([39.0] * 3, epoch=3)  # the oldest chunk is cut to what is left of it
    assert pool.chunks == [3, 4, 5, 3] and sum(pool.chunks) == len(pool.samples) == 15
    restored = ReferencePool(chunks=5)
    restored.load_state_dict(pool.state_dict())
    assert restored.chunks == pool.chunks and restored.samples == pool.samples
    restored.add([40.0], epoch=4)
    assert restored.chunks[-1] == 1, "a restored pool numbers its next chunk after its newest"
    old = ReferencePool(chunks=3)
    old.load_state_dict({"steps": [[0, 30.0], [0, 31.0], [2, 35.0]]})  # a checkpoint from before chunks
    assert old.chunks == [2, 1] and old.epochs == (0, 2)
    with pytest.raises(ValueError, match="hold 4 steps, but `eager_ms` has 5"):
        pool.add([30.0] * 5, epoch=5, runs=[2, 2])


def test_the_pool_says_how_many_epochs_old_its_newest_chunk_is():
    pool = ReferencePool(chunks=1)
    assert pool.age(epoch=0) is None  # nothing measured yet: no age
    pool.add([30.0] * 5, epoch=0)
    assert [pool.age(epoch) for epoch in (0, 1, 2)] == [0, 1, 2]
    pool.add([], epoch=1)  # an epoch without reference steps does not make the pool newer
    assert pool.age(epoch=1) == 1
    pool.add([31.0] * 2, epoch=3)  # a partial chunk is still this epoch's own
    assert pool.age(epoch=3) == 0 and pool.age(epoch=4) == 1 and pool.epochs == (0, 3)


def test_summarize_carries_the_age_of_the_reference_it_compares_with():
    times = {COMPILED: [10.0] * 4}  # no eager step of its own: the pool's, two epochs old
    timing = summarize(times, reference=[30.0] * 5, reference_age=2)
    assert timing.reference_age == 2 and timing.speedup == pytest.approx(3.0) and timing.reference_ms == 0
    assert summarize({COMPILED: [10.0], EAGER: [20.0]}).reference_age == 0  # its own eager steps


# ------------------------------------------------------------------ timers and summaries


def test_cpu_timer_times_each_step_to_the_next_start_by_kind(monkeypatch):
    now = [0.0]  # a fake host clock: a real sleep of 10 ms read 18.8 ms on a loaded 2-core machine
    monkeypatch.setattr(timing_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    timer = StepTimer(torch.device("cpu"))
    for kind, seconds in ((COMPILED, 0.01), (EAGER, 0.02), (SKIPPED, 0.01), (COMPILED, 0.0)):
        timer.start()
        now[0] += seconds
        timer.stop(kind)
    times = timer.collect()  # the last step has no end: untimed
    assert sorted(times) == [COMPILED, EAGER] and len(times[COMPILED]) == 1
    assert times[COMPILED][0] == pytest.approx(10) and times[EAGER][0] == pytest.approx(20)
    assert timer.collect() == {}
    timing = summarize(times)
    assert timing.speedup == pytest.approx(times[EAGER][0] / times[COMPILED][0])


def test_the_timer_says_how_many_steps_each_run_of_one_kind_held():
    timer = StepTimer(torch.device("cpu"))
    for kind in (COMPILED, LEAD_IN, EAGER, EAGER, COMPILED, COMPILED, LEAD_IN, EAGER, EAGER, EAGER, SKIPPED, EAGER,
                 COMPILED):  # fmt: skip
        timer.start()
        timer.stop(kind)
    timer.start()
    times = timer.collect()
    assert timer.runs[EAGER] == [2, 3, 1] and timer.runs[COMPILED] == [1, 2, 1] and len(times[EAGER]) == 6
    assert timer.runs[LEAD_IN] == [1, 1] and SKIPPED not in timer.runs, "the runs of the kinds collected"
    timer.collect()
    assert timer.runs == {}


def test_cpu_timer_leaves_interrupted_and_unfinished_steps_untimed():
    timer = StepTimer(torch.device("cpu"))
    timer.stop(EAGER)  # a stop before any start is ignored
    timer.start()  # never stopped: untimed
    timer.start()
    timer.stop(EAGER)
    timer.interrupt()  # validation runs before the next step
    timer.start()
    timer.stop(COMPILED)
    timer.start()
    assert timer.collect() == {COMPILED: [pytest.approx(0, abs=5)]}


def test_cpu_timer_reports_skipped_steps_on_request_but_never_interrupted_ones():
    timer = StepTimer(torch.device("cpu"))
    for kind in (SKIPPED, LEAD_IN, EAGER, COMPILED):
        timer.start()
        timer.stop(kind)
    timer.interrupt()
    timer.start()
    times = timer.collect(include_skipped=True)
    assert sorted(times) == [EAGER, LEAD_IN, SKIPPED] and len(times[SKIPPED]) == 1


def test_summarize_compares_with_the_pooled_reference_and_measures_its_cost():
    times = {COMPILED: [10.0] * 8, EAGER: [30.0, 31.0], LEAD_IN: [35.0], SKIPPED: [1000.0]}
    timing = summarize(times, reference=[29.0, 30.0, 31.0, 32.0, 33.0])
    assert timing.eager_step_ms == 31.0 and timing.eager_steps == 5 and timing.speedup == pytest.approx(3.1)
    assert timing.speedup_low <= 3.1 <= timing.speedup_high
    assert timing.reference_cost == pytest.approx(96.0 / (80.0 + 96.0 + 1000.0))
    drifted = summarize(times, reference=[29.0, 30.0, 31.0, 35.0, 36.0, 37.0], reference_chunks=[3, 3])
    assert drifted.speedup_high - drifted.speedup_low > 0.5, "two moments 6 ms apart: the interval spans both"
    empty = summarize({})
    assert empty.speedup is None and empty.speedup_low is None and empty.reference_cost is None


def test_kernel_busy_time_is_the_union_of_overlapping_kernels():
    assert _union_us([(0, 10), (5, 12), (20, 25)]) == 17
    assert _union_us([]) == 0


def test_kernel_stats_count_kernels_busy_time_and_the_hosts_waits_per_step():
    def event(name, device, start, end, annotation=False):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               is_user_annotation=annotation)  # fmt: skip

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    # the GPU range of a host annotation spans its kernels and the idle gaps between them: neither work nor a kernel
    events = [event("gemm", cuda, 0, 400), event("add", cuda, 300, 500), event("cudaStreamSynchronize", cpu, 0, 9),
              event("cudaMemcpy", cpu, 10, 20), event("cudaMemcpyAsync", cpu, 20, 30),
              event("Optimizer.step#AdamW.step", cuda, 0, 1000, annotation=True)]  # fmt: skip
    stats = kernel_stats(SimpleNamespace(events=lambda: events), steps=2, wall_s=0.001)
    expected = KernelStats(kernels_per_step=1.0, gpu_busy_frac=0.5, syncs_per_step=1.0, gpu_ms_per_step=0.25)
    assert stats == expected, "an async copy waits not"


def test_the_kernel_metrics_log_both_windows_once_when_both_are_done():
    meters = GpuMeters(profiles={COMPILED: ProfileWindow(steps=2), EAGER: ProfileWindow(steps=2)})
    meters.profiles[COMPILED].result = KernelStats(100.0, 0.8, 1.0, gpu_ms_per_step=4.0)
    assert meters.kernel_metrics() == {}, "the eager window is still open"
    meters.profiles[EAGER].result = KernelStats(300.0, 0.4, 2.0, gpu_ms_per_step=6.0)
    assert meters.kernel_metrics() == {"kernels_per_step": 100.0, "eager_kernels_per_step": 300.0,
                                       "gpu_busy_frac": 0.8, "eager_gpu_busy_frac": 0.4,
                                       "gpu_ms_per_step": 4.0, "eager_gpu_ms_per_step": 6.0}  # fmt: skip
    assert meters.kernel_metrics() == {}, "logged once a fit"
