"""Tests for lightning_fuse.metrics: per-epoch scalars, the speedup in words, the verdict and the summary table."""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect

import pytest

from lightning_fuse.metrics import (
    epoch_metrics,
    format_speedup,
    pooled_speedup,
    scalars,
    summary_table,
    verdict_line,
)
from lightning_fuse.shapes import CompileTracker
from lightning_fuse.timing import EpochTiming

# ------------------------------------------------------------------ epoch_metrics


def test_epoch_metrics_leave_out_what_was_not_measured():
    row = epoch_metrics(EpochTiming(None, None, 0, 0), batch_size=8, compile_s=3.0)
    assert row == {"fuse/compile_s": 3.0, "fuse/recompiles": 0.0}
    full = epoch_metrics(EpochTiming(10.0, 20.0, 5, 5), 8, 3.0, items_per_batch=800, flops_per_batch=1e12,
                         peak_flops=1e15)  # fmt: skip
    assert full["fuse/samples_per_s"] == pytest.approx(800) and full["fuse/items_per_s"] == pytest.approx(8e4)
    assert full["fuse/mfu"] == pytest.approx(0.1) and full["fuse/break_even_step"] == 300
    assert "fuse/speedup_low" not in full and "fuse/reference_cost" not in full  # no interval, no epoch time


def test_epoch_metrics_carry_the_interval_the_reference_cost_and_the_plan():
    timing = EpochTiming(10.0, 25.0, 40, 4, speedup_low=2.2, speedup_high=2.9, reference_ms=500.0, train_ms=25_000.0)
    row = epoch_metrics(timing, batch_size=32, compile_s=12.0, plan="regions + graph")
    assert row["fuse/speedup"] == 2.5 and (row["fuse/speedup_low"], row["fuse/speedup_high"]) == (2.2, 2.9)
    assert row["fuse/reference_cost"] == pytest.approx(0.02) and row["plan"] == "regions + graph"
    logged = scalars({"epoch": 0, **row})
    assert "plan" not in logged and logged["fuse/speedup"] == 2.5 and logged["epoch"] == 0.0


def test_an_epoch_without_reference_steps_of_its_own_logs_the_age_of_the_pool_not_its_eager_time():
    own = epoch_metrics(EpochTiming(10.0, 25.0, 40, 5, reference_age=0), batch_size=8, compile_s=3.0)
    assert own["fuse/eager_step_ms"] == 25.0 and own["fuse/reference_age"] == 0.0
    pooled = epoch_metrics(EpochTiming(10.0, 25.0, 40, 5, reference_age=2), batch_size=8, compile_s=3.0)
    assert "fuse/eager_step_ms" not in pooled, "an older epoch's eager time is not this epoch's"
    assert pooled["fuse/reference_age"] == 2.0 and pooled["fuse/speedup"] == 2.5  # still against the pool
    assert pooled["fuse/break_even_step"] == own["fuse/break_even_step"] == 200
    table = summary_table([{"epoch": 0, **own}, {"epoch": 1, **pooled}], CompileTracker(), "regions")
    rows = [line.split() for line in table.splitlines() if line[:2] in ("0 ", "1 ")]
    assert [row[3:5] for row in rows] == [["25.00", "0"], ["-", "2"]]  # after speedup and step ms: eager ms, ref age


def test_a_slower_plan_keeps_its_speedup_below_one_with_no_break_even():
    row = epoch_metrics(EpochTiming(12.0, 10.0, 5, 5, 0.78, 0.88), batch_size=8, compile_s=3.0)
    assert row["fuse/speedup"] == pytest.approx(10 / 12) and row["fuse/speedup_high"] == 0.88
    assert "fuse/break_even_step" not in row


# ------------------------------------------------------------------ words


@pytest.mark.parametrize(("args", "expected"), [
    ((3.41, 3.2, 3.62), "3.4x (3.2-3.6)"),
    ((1.02, 0.97, 1.08), "1.02x (0.97-1.08): no clear difference from eager"),
    ((0.95, 0.91, 0.99), "0.95x (0.91-0.99)"),
    ((2.41, 2.38, 2.44), "2.41x (2.38-2.44)"),  # more decimals where one would not tell the bounds apart
    ((1.5, None, None), "1.50x"),
    ((1.5, float("nan"), float("nan")), "1.50x"),
    ((None, None, None), "not measured"),
])  # fmt: skip
def test_format_speedup(args, expected):
    assert format_speedup(*args) == expected


def test_format_speedup_leaves_the_words_out_of_table_cells():
    assert format_speedup(1.02, 0.97, 1.08, words=False) == "1.02x (0.97-1.08)"


def history_row(epoch: int, plan: str, speedup: float, low: float, high: float) -> dict:
    return {"epoch": epoch, "plan": plan, "fuse/speedup": speedup, "fuse/speedup_low": low,
            "fuse/speedup_high": high, "fuse/step_ms": 10.0, "fuse/compile_s": 31.0}  # fmt: skip


def test_the_verdict_of_a_faster_plan_says_how_much_and_when_compile_paid_back():
    history = [history_row(0, "regions + graph", 2.3, 2.2, 2.4), history_row(1, "regions + graph", 2.4, 2.3, 2.5),
               history_row(2, "regions + graph", 2.5, 2.4, 2.6)]  # fmt: skip
    line = verdict_line("regions + graph", history, compile_s=31.2, break_even_step=310, device_type="cuda")
    assert line == "FuseCallback: 2.4x faster (2.3-2.5) with regions + graph; compile 31 s, paid back at step 310"
    at_the_end = verdict_line("regions + graph", history, compile_s=31.2, break_even_step=310, steps=310)
    assert at_the_end == line, "the step that pays it back is the fit's last: paid back"
    short = verdict_line("regions + graph", history, compile_s=31.2, break_even_step=310, steps=230)
    assert short.endswith("compile 31 s, pays back at step 310 (this fit ran 230)"), "a fit that ended before paying"


def test_the_verdict_of_a_slower_plan_and_of_one_no_different_from_eager():
    slower = [history_row(0, "compiled regions", 0.95, 0.91, 0.99)]
    assert verdict_line("compiled regions", slower, compile_s=12.0, device_type="cuda") == (
        "FuseCallback: 0.95x (0.91-0.99), slower than eager with compiled regions; compile 12 s")
    same = [history_row(0, "regions", 1.02, 0.97, 1.08)]
    assert verdict_line("regions", same, compile_s=5.0, device_type="cpu") == (
        "FuseCallback: 1.02x (0.97-1.08), no clear difference from eager with regions; compile 5.0 s")


def test_the_verdict_of_a_dropped_plan_names_the_epoch_it_was_dropped_in():
    history = [history_row(0, "regions", 0.88, 0.85, 0.91), {"epoch": 1, "plan": "eager", "fuse/speedup": 1.0}]
    line = verdict_line("eager", history, compile_s=20.0, dropped="it measured 0.88x of eager", device_type="cpu")
    assert line == ("FuseCallback: no gain on this CPU (0.88x, 0.85-0.91) with regions; dropped in epoch 0, "
                    "the rest trained eagerly; compile 20 s")
    mid_epoch = verdict_line("eager", history, compile_s=20.0, dropped="it measured 0.88x of eager over its last "
                             "50 steps in epoch 1", dropped_in_epoch=1, device_type="cpu")  # fmt: skip
    assert "; dropped in epoch 1, the rest" in mid_epoch, "the epoch its warning named, not the last it measured"
    failed = verdict_line("eager", history, compile_s=20.0, dropped="backward raised AssertionError: boom (step 7)")
    assert failed == ("FuseCallback: regions was dropped, backward raised AssertionError: boom (step 7); the rest "
                      "trained eagerly, no step lost; compile 20 s")
    with pytest.raises(TypeError):  # everything after compile_s is a keyword: no silent mix-up of positions
        verdict_line("eager", history, 20.0, "it measured 0.88x of eager")


def test_the_verdict_without_a_measurement_says_why():
    assert verdict_line("regions + graph", [{"epoch": 0, "fuse/compile_s": 12.0}], compile_s=12.0, eager_steps=0) == (
        "FuseCallback: ran regions + graph; speedup not measured (eager_steps=0); compile 12 s")
    assert "no eager reference step was timed" in verdict_line("regions", [], compile_s=1.0, eager_steps=20)
    only_point = verdict_line("regions", [{"fuse/speedup": 1.7}], compile_s=1.0)
    assert only_point.startswith("FuseCallback: 1.70x of eager with regions (too few reference steps")


def test_the_verdict_names_a_thin_reference_and_one_that_cost_more_than_its_budget():
    history = [history_row(0, "regions", 2.4, 2.3, 2.5)]
    thin = verdict_line("regions", history, compile_s=3.0, reference_steps=5, reference_cost=0.041)
    assert thin == ("FuseCallback: 2.4x faster (2.3-2.5) with regions; compile 3.0 s; reference thin: 5 eager steps "
                    "(raise reference_budget for a narrower interval); reference cost 4.1% of training time")
    enough = verdict_line("regions", history, compile_s=3.0, reference_steps=10, reference_cost=0.02)
    assert enough == "FuseCallback: 2.4x faster (2.3-2.5) with regions; compile 3.0 s"  # two chunks, on budget
    no_interval = verdict_line("regions", [{"fuse/speedup": 1.7}], compile_s=1.0, reference_steps=1)
    assert no_interval.endswith("for an interval); compile 1.0 s; reference thin: 1 eager step (raise "
                                "reference_budget for a narrower interval)")
    capped = verdict_line("regions", history, compile_s=3.0, reference_steps=4, eager_steps=4)
    assert capped.endswith("reference thin: 4 eager steps (raise eager_steps for a narrower interval)")
    unmeasured = verdict_line("regions", [], compile_s=1.0, reference_steps=0, reference_cost=0.1)
    assert unmeasured == "FuseCallback: ran regions; speedup not measured (no eager reference step was timed); " \
        "compile 1.0 s"  # nothing to qualify  # fmt: skip


def test_the_verdict_pools_only_the_final_plans_epochs():
    history = [history_row(0, "regions + graph", 4.0, 3.8, 4.2), history_row(1, "regions", 1.5, 1.4, 1.6),
               history_row(2, "regions", 1.6, 1.5, 1.7)]  # fmt: skip
    assert pooled_speedup(history[1:]) == pytest.approx((1.55, 1.45, 1.65))
    assert verdict_line("regions", history, compile_s=3.0).startswith("FuseCallback: 1.55x faster (1.45-1.65)")


# ------------------------------------------------------------------ the summary table


def a_tracker() -> CompileTracker:
    tracker = CompileTracker()
    block0 = tracker.stats("model.blocks.0")
    block0.compiles, block0.compile_s = 2, 7.5
    block0.recompiles_by_code["0"] = 1
    block0.recompile_reasons.append("size mismatch at index 0")
    block0.break_reasons.append("Data-dependent branching")
    for index in (1, 2, 10):
        tracker.stats(f"model.blocks.{index}")  # the same class: dynamo reuses block 0's code, 0 compiles
    tracker.stats("model.head").compiles = 1
    tracker.stats(CompileTracker.OUTSIDE).compile_s = 4.0
    return tracker


HISTORY = [
    {"epoch": 0, "plan": "regions + graph", "fuse/step_ms": 2.0, "fuse/speedup": 1.5, "fuse/speedup_low": 1.4,
     "fuse/speedup_high": 1.6, "fuse/reference_cost": 0.019},
    {"epoch": 1, "plan": "eager", "fuse/step_ms": 3.0, "fuse/mfu": 0.25},
]  # fmt: skip


def test_the_plain_text_summary_has_no_markdown_and_reads_as_aligned_columns():
    text = summary_table(HISTORY, a_tracker(), "plan x", verdict="FuseCallback: 1.5x faster")
    assert "|" not in text and "**" not in text
    lines = text.splitlines()
    assert lines[:2] == ["FuseCallback plan: plan x", "FuseCallback: 1.5x faster"]
    header = next(line for line in lines if line.startswith("epoch"))
    assert header.split() == ["epoch", "plan", "speedup", "step", "ms", "ref", "%", "MFU", "%"]
    row0 = next(line for line in lines if line.startswith("0 "))
    assert row0.split()[:5] == ["0", "regions", "+", "graph", "1.50x"] and "(1.40-1.60)" in row0
    assert row0.index("1.50x") == header.index("speedup")  # columns line up


def test_the_region_table_says_which_regions_share_compiled_code_and_what_the_outside_row_is():
    text = summary_table(HISTORY, a_tracker(), "plan x")
    lines = text.splitlines()
    regions = [line.split()[0] for line in lines if line.startswith(("model.", "(outside"))]
    assert regions == ["model.blocks.0", "model.blocks.1", "model.blocks.2", "model.blocks.10", "model.head",
                       "(outside"]  # natural order, the outside row last
    assert "model.blocks.1 " in text and "shares model.blocks.0's code" in text
    outside = next(line for line in lines if line.startswith("(outside"))
    assert "4.0" in outside and "backward graphs" in outside
    assert "model.blocks.0 recompiled: size mismatch" in text and "data-dependent control flow" in text


def test_the_markdown_summary_is_for_tensorboard():
    text = summary_table(HISTORY, a_tracker(), "plan x", markdown=True)
    assert text.startswith("**FuseCallback** plan: plan x\n\n**Epochs**\n\n| epoch |")  # blocks apart
    assert "| 0 | regions + graph | 1.50x (1.40-1.60) | 2.00 | 1.9 | - |" in text
    assert "| 1 | eager | - | 3.00 | - | 25.0 |" in text
    assert "| model.blocks.2 | 0 | 0 | 0 | 0.0 | shares model.blocks.0's code |" in text
    assert summary_table([], CompileTracker(), "p").endswith("(no epoch finished)\n\nRegions\n(no region compiled)")


# ------------------------------------------------------------------ the modules' shape (issue: a user's first hour)

MODULES = ["lightning_fuse.timing", "lightning_fuse.metrics", "lightning_fuse.gpu"]


@pytest.mark.parametrize("name", MODULES)
def test_every_function_is_at_most_60_lines(name):
    tree = ast.parse(inspect.getsource(importlib.import_module(name)))
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert not long, f"functions over 60 lines in {name}: {long}"  # fmt: skip


@pytest.mark.parametrize("name", MODULES)
def test_every_module_opens_with_a_docstring_and_a_runnable_example(name):
    module = importlib.import_module(name)
    examples = doctest.DocTestParser().get_examples(module.__doc__ or "")
    assert examples, f"{name}'s docstring has no >>> example"
