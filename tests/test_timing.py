import time

import pytest
import torch

from lightning_fuse.metrics import epoch_metrics, summary_table
from lightning_fuse.profiling import _union_us
from lightning_fuse.shapes import CompileTracker
from lightning_fuse.timing import CHUNK, COMPILED, EAGER, SKIPPED, EagerSchedule, EpochTiming, StepTimer, summarize


def test_the_schedule_runs_warmup_and_profiled_steps_eagerly_at_fit_start_untimed():
    schedule = EagerSchedule(eager_steps=4, warmup=2, profiled=3)
    assert schedule.start_length == 5
    assert [s for s in range(5) if schedule.is_eager(s)] == [0, 1, 2, 3, 4]
    assert [s for s in range(5) if schedule.is_profiled(s)] == [2, 3, 4]
    assert not any(schedule.is_timed(s) for s in range(5))


def test_each_epoch_spreads_its_timed_eager_steps_in_chunks_after_an_untimed_lead_in():
    schedule = EagerSchedule(eager_steps=20, warmup=3)
    assert schedule.plan_epoch(first_step=0, steps=200, settle=3) == 20
    eager = [s for s in range(200) if schedule.is_eager(s)]
    timed = [s for s in range(200) if schedule.is_timed(s)]
    assert eager[:3] == [0, 1, 2] and len(timed) == 20 and len(eager) == 3 + 20 + 4  # 4 chunks of 5, 4 lead-ins
    chunks = [timed[i : i + CHUNK] for i in range(0, 20, CHUNK)]
    assert all(chunk == list(range(chunk[0], chunk[0] + CHUNK)) for chunk in chunks)  # contiguous runs of 5
    assert all(schedule.is_eager(chunk[0] - 1) and not schedule.is_timed(chunk[0] - 1) for chunk in chunks)
    assert min(eager[3:]) > 6 and max(timed) < 199  # after compile and warmup; never the epoch's last step
    gaps = [b[0] - a[0] for a, b in zip(chunks, chunks[1:])]
    assert max(gaps) - min(gaps) <= 1  # evenly spaced over the epoch
    assert schedule.plan_epoch(first_step=200, steps=200, settle=3) == 20  # the next epoch: its own chunks
    assert not any(schedule.is_timed(s) for s in range(200)) and min(eager[3:]) > 6
    assert [s for s in range(200, 400) if schedule.is_timed(s)][0] - 200 < chunks[0][0]  # no settle steps now


def test_a_short_epoch_gets_at_most_a_third_of_its_steps_as_reference_and_a_tiny_one_none():
    schedule = EagerSchedule(eager_steps=20, warmup=3)
    placed = schedule.plan_epoch(first_step=100, steps=31, settle=3)
    assert placed == 8  # 8 timed + 2 lead-ins = 10 of the epoch's 30 steps that can have an end
    assert sum(schedule.is_eager(s) for s in range(100, 131)) == 10
    assert schedule.plan_epoch(first_step=0, steps=8, settle=3) == 0
    assert not any(schedule.is_eager(s) for s in range(3, 8))


def test_eager_steps_zero_runs_nothing_eagerly():
    schedule = EagerSchedule(eager_steps=0, profiled=3)
    assert schedule.plan_epoch(first_step=0, steps=500, settle=1) == 0
    assert schedule.start_length == 0 and not any(schedule.is_eager(s) or schedule.is_timed(s) for s in range(500))


def test_cpu_timer_times_each_step_to_the_next_start_by_kind():
    timer = StepTimer(torch.device("cpu"))
    for kind, seconds in ((COMPILED, 0.01), (EAGER, 0.02), (SKIPPED, 0.01), (COMPILED, 0.0)):
        timer.start()
        time.sleep(seconds)
        timer.stop(kind)
    times = timer.collect()  # the last step has no end: untimed
    assert sorted(times) == [COMPILED, EAGER] and len(times[COMPILED]) == 1
    assert times[COMPILED][0] == pytest.approx(10, abs=8) and times[EAGER][0] == pytest.approx(20, abs=8)
    assert timer.collect() == {}
    timing = summarize(times)
    assert timing.speedup == pytest.approx(times[EAGER][0] / times[COMPILED][0])


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


def test_epoch_metrics_leave_out_what_was_not_measured():
    row = epoch_metrics(EpochTiming(None, None, 0, 0), batch_size=8, compile_s=3.0)
    assert row == {"fuse/compile_s": 3.0, "fuse/recompiles": 0.0}
    slower = epoch_metrics(EpochTiming(12.0, 10.0, 5, 5), batch_size=8, compile_s=3.0)
    assert slower["fuse/speedup"] == pytest.approx(10 / 12) and "fuse/break_even_step" not in slower
    full = epoch_metrics(EpochTiming(10.0, 20.0, 5, 5), 8, 3.0, items_per_batch=800, flops_per_batch=1e12,
                         peak_flops=1e15)
    assert full["fuse/samples_per_s"] == pytest.approx(800) and full["fuse/items_per_s"] == pytest.approx(8e4)
    assert full["fuse/mfu"] == pytest.approx(0.1) and full["fuse/break_even_step"] == 300


def test_summary_table_has_a_row_per_epoch_and_region_notes():
    tracker = CompileTracker()
    stats = tracker.stats("model.blocks.0")
    stats.compiles, stats.recompiles = 2, 1
    stats.recompile_reasons.append("size mismatch at index 0")
    stats.break_reasons.append("Data-dependent branching")
    text = summary_table([{"fuse/step_ms": 2.0, "fuse/speedup": 1.5}, {"fuse/mfu": 0.25}], tracker, "plan x")
    assert "| 0 | 2.00 | - | 1.50x |" in text and "| 25.0 |" in text
    assert "model.blocks.0 recompiled: size mismatch" in text and "data-dependent control flow" in text


def test_kernel_busy_time_is_the_union_of_overlapping_kernels():
    assert _union_us([(0, 10), (5, 12), (20, 25)]) == 17
    assert _union_us([]) == 0
