import time

import pytest
import torch

from lightning_fuse.metrics import epoch_metrics, summary_table
from lightning_fuse.profiling import _union_us
from lightning_fuse.shapes import CompileTracker
from lightning_fuse.timing import COMPILED, EAGER, SKIPPED, EagerWindow, EpochTiming, StepTimer, summarize


def test_eager_window_is_the_first_steps_of_the_fit_warmup_and_profiling_untimed():
    window = EagerWindow(eager_steps=4, warmup=2, profiled=3)
    assert [s for s in range(20) if window.is_eager(s)] == list(range(9))
    assert [s for s in range(20) if window.is_profiled(s)] == [2, 3, 4]
    assert [s for s in range(20) if window.is_timed(s)] == [5, 6, 7, 8]
    assert window.length == 9


def test_eager_window_off():
    window = EagerWindow(eager_steps=0, profiled=3)
    assert window.length == 0 and not any(window.is_eager(s) or window.is_timed(s) for s in range(10))


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
