"""What a run tells its user: the per-epoch ``fuse/`` scalars, the speedup in words, a one-line verdict and the
end-of-fit summary table (plain text for the terminal, Markdown for TensorBoard).

Example::

    >>> from lightning_fuse.timing import EpochTiming
    >>> row = epoch_metrics(EpochTiming(10.0, 25.0, 40, 4, 2.3, 2.7), batch_size=32, compile_s=12.0)
    >>> row["fuse/speedup"], row["fuse/break_even_step"]
    (2.5, 800)
    >>> format_speedup(row["fuse/speedup"], row["fuse/speedup_low"], row["fuse/speedup_high"])
    '2.5x (2.3-2.7)'
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_fuse.gpu import mfu
from lightning_fuse.options import REFERENCE_BUDGET
from lightning_fuse.shapes import CompileTracker, RegionCompiles, explain_graph_break
from lightning_fuse.timing import THIN_REFERENCE, EpochTiming

PREFIX = "fuse/"
PLAN_KEY = "plan"
"""Key of the plan's label in an :func:`epoch_metrics` row (a string: not logged, see :func:`scalars`)."""
Row = Mapping[str, Any]


def epoch_metrics(
    timing: EpochTiming,
    batch_size: int | None,
    compile_s: float,
    recompiles: int = 0,
    items_per_batch: float | None = None,
    flops_per_batch: float | None = None,
    peak_flops: float | None = None,
    extra: Mapping[str, float] | None = None,
    plan: str | None = None,
) -> dict[str, float | str]:
    """The scalars of one epoch; a value that was not measured is left out rather than logged as zero.

    Besides step times, throughput and MFU: ``fuse/speedup`` with ``fuse/speedup_low`` and ``fuse/speedup_high``
    (its interval, when there were at least 2 steps on each side), and ``fuse/reference_cost`` (the eager
    reference's share of the epoch's training time, when the timer saw that time). Wherever there is an eager
    reference, ``fuse/reference_age`` says how old it is (:attr:`EpochTiming.reference_age`); ``fuse/eager_step_ms``
    is logged only at age 0, in an epoch that timed eager steps of its own, so an older epoch's value is never
    logged as this one's (the speedup still divides the pooled reference). With ``plan`` (a short label
    such as ``"regions + graph"``) the row also has ``"plan"``, a string that :func:`verdict_line` and
    :func:`summary_table` read: pass the row through :func:`scalars` before ``logger.log_metrics``.
    """
    row: dict[str, float | str] = {"fuse/compile_s": compile_s, "fuse/recompiles": float(recompiles)}
    if timing.step_ms:
        row["fuse/step_ms"] = timing.step_ms
        step_s = timing.step_ms / 1e3
        if batch_size:
            row["fuse/samples_per_s"] = batch_size / step_s
        if items_per_batch:
            row["fuse/items_per_s"] = items_per_batch / step_s
        utilisation = mfu(flops_per_batch or 0.0, step_s, peak_flops)
        if utilisation is not None:
            row["fuse/mfu"] = utilisation
    if timing.eager_step_ms:
        row["fuse/reference_age"] = float(timing.reference_age)
        if timing.reference_age == 0:
            row["fuse/eager_step_ms"] = timing.eager_step_ms
    if timing.speedup is not None:
        row["fuse/speedup"] = timing.speedup  # never clamped: below 1 when the plan is slower than eager
        if timing.speedup_low is not None and timing.speedup_high is not None:
            row["fuse/speedup_low"], row["fuse/speedup_high"] = timing.speedup_low, timing.speedup_high
        saved_s = (timing.eager_step_ms - timing.step_ms) / 1e3
        if saved_s > 0:
            row["fuse/break_even_step"] = math.ceil(compile_s / saved_s)
    if timing.reference_cost is not None:
        row["fuse/reference_cost"] = timing.reference_cost
    row.update({f"{PREFIX}{k}": float(v) for k, v in (extra or {}).items()})
    if plan is not None:
        row[PLAN_KEY] = plan
    return row


def scalars(row: Row) -> dict[str, float]:
    """The numeric entries of a row, for ``logger.log_metrics`` (loggers reject strings such as the plan).

    Example::

        >>> scalars({"fuse/speedup": 2.0, "plan": "regions", "epoch": 1})
        {'fuse/speedup': 2.0, 'epoch': 1.0}
    """
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def per_rank(name: str, values: Sequence[float]) -> dict[str, float]:
    """``{name}_rank<r>`` for every rank that measured a value (NaN: that rank had nothing to report).

    Example::

        >>> per_rank("gpu_util", [41.0, float("nan"), 38.5])
        {'gpu_util_rank0': 41.0, 'gpu_util_rank2': 38.5}
    """
    return {f"{name}_rank{rank}": value for rank, value in enumerate(values) if not math.isnan(value)}


def _known(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _numbers(point: float, low: float | None, high: float | None) -> tuple[str, str | None, str | None]:
    """Point and bounds as text, with the decimals that tell the bounds apart (1 from 2x up, else 2; at most 3)."""
    decimals = 1 if abs(point) >= 2 else 2
    if not (_known(low) and _known(high)):
        return f"{point:.{decimals}f}", None, None
    while decimals < 3 and low != high and f"{low:.{decimals}f}" == f"{high:.{decimals}f}":
        decimals += 1
    return f"{point:.{decimals}f}", f"{low:.{decimals}f}", f"{high:.{decimals}f}"


def straddles_one(low: float | None, high: float | None) -> bool:
    """Whether an interval holds 1: no clear difference from eager (``False`` when there is no interval)."""
    return _known(low) and _known(high) and low <= 1 <= high


def format_speedup(point: float | None, low: float | None = None, high: float | None = None,
                   words: bool = True) -> str:  # fmt: skip
    """A speedup with its interval, e.g. ``"3.4x (3.2-3.6)"``, and in words when the interval holds 1.

    Args:
        point: The speedup (``None`` or NaN: ``"not measured"``).
        low, high: Its interval (``None`` or NaN: no interval, the point alone).
        words: Add ``": no clear difference from eager"`` when ``low <= 1 <= high``; table cells leave it out.

    Example::

        >>> format_speedup(3.41, 3.2, 3.62)
        '3.4x (3.2-3.6)'
        >>> format_speedup(1.02, 0.97, 1.08)
        '1.02x (0.97-1.08): no clear difference from eager'
        >>> format_speedup(0.88, None, None), format_speedup(None)
        ('0.88x', 'not measured')
    """
    if not _known(point):
        return "not measured"
    text, low_text, high_text = _numbers(point, low, high)
    if low_text is None:
        return f"{text}x"
    note = ": no clear difference from eager" if words and straddles_one(low, high) else ""
    return f"{text}x ({low_text}-{high_text}){note}"


def pooled_speedup(rows: Sequence[Row]) -> tuple[float | None, float | None, float | None]:
    """The speedup of several epochs: the median of their speedups, lows and highs.

    The epochs share reference steps (:class:`~lightning_fuse.timing.ReferencePool`), so their intervals are not
    independent and cannot be narrowed by combining them: the median epoch's interval is the honest one.

    Example::

        >>> rows = [{"fuse/speedup": 2.0, "fuse/speedup_low": 1.8, "fuse/speedup_high": 2.2},
        ...         {"fuse/speedup": 3.0, "fuse/speedup_low": 2.8, "fuse/speedup_high": 3.2}, {}]
        >>> pooled_speedup(rows)
        (2.5, 2.3, 2.7)
    """
    measured = [row for row in rows if _known(row.get("fuse/speedup"))]
    if not measured:
        return None, None, None
    point = statistics.median(row["fuse/speedup"] for row in measured)
    bounded = [row for row in measured if _known(row.get("fuse/speedup_low")) and _known(row.get("fuse/speedup_high"))]
    if not bounded:
        return point, None, None
    return (point, statistics.median(row["fuse/speedup_low"] for row in bounded),
            statistics.median(row["fuse/speedup_high"] for row in bounded))  # fmt: skip


_DEVICE_WORDS = {"cuda": "GPU", "cpu": "CPU", "mps": "Apple GPU", "xpu": "Intel GPU"}


def device_word(device_type: str) -> str:
    """What a verdict calls a device of ``torch.device.type`` ``device_type``.

    Example::

        >>> device_word("cuda"), device_word("cpu")
        ('GPU', 'CPU')
    """
    return _DEVICE_WORDS.get(device_type, device_type.upper())


def measure_only_line(step_ms: float | None) -> str:
    """The verdict of a run that selects nothing to compile (``fuse=measure_only``): eager by design, timed.

    Example::

        >>> measure_only_line(10.24)
        'FuseCallback: measure only (nothing selected to compile): eager steps of 10.2 ms, no speedup to measure'
    """
    steps = f"eager steps of {step_ms:.1f} ms" if step_ms else "eager steps, none timed"
    return f"FuseCallback: measure only (nothing selected to compile): {steps}, no speedup to measure"


def _seconds(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def _dropped_line(plan: str, history: Sequence[Row], device_type: str, reason: str, cost: str,
                  epoch: int | None) -> str:  # fmt: skip
    """The verdict when a plan was dropped (measured slower than eager, or failed) in ``epoch`` (``None``: at the
    end of its last epoch in ``history``): its epochs are another plan's. ``plan`` is what ran after it (``eager``,
    or ``user-compiled``: the user's own compile)."""
    gone = [(index, row) for index, row in enumerate(history) if row.get(PLAN_KEY, plan) != plan]
    label = str(gone[-1][1][PLAN_KEY]) if gone else "the plan"
    rest = "the rest trained eagerly" if plan == "eager" else f"the rest ran {plan}"
    if "raised" in reason or not gone:  # failed mid-fit (the step was redone eagerly), or dropped before an epoch end
        return f"FuseCallback: {label} was dropped, {reason}; {rest}, no step lost; {cost}"
    rows = [row for _, row in gone if row.get(PLAN_KEY) == label]
    point, low, high = pooled_speedup(rows)
    text, low_text, high_text = _numbers(point, low, high) if point is not None else ("?", None, None)
    figure = f"{text}x" + (f", {low_text}-{high_text}" if low_text else "")
    if epoch is None:
        index, last = gone[-1]
        epoch = int(last.get("epoch", index))
    device = device_word(device_type)
    return f"FuseCallback: no gain on this {device} ({figure}) with {label}; dropped in epoch {epoch}, {rest}; {cost}"


def verdict_line(plan: str, history: Sequence[Row], compile_s: float, *, break_even_step: float | None = None,
                 dropped: str | None = None, dropped_in_epoch: int | None = None, device_type: str = "cuda",
                 eager_steps: int | None = None, reference_steps: int | None = None,
                 reference_cost: float | None = None, steps: int | None = None,
                 shortfall: str | None = None, unmeasured: str | None = None) -> str:  # fmt: skip
    """The run in one line: how much faster, with what, and what it cost.

    Args:
        plan: Label of the final plan, e.g. ``"regions + graph"`` (``"eager"`` after a drop); only epochs whose row
            has this ``"plan"`` (or no ``"plan"`` at all) are pooled (:func:`pooled_speedup`).
        history: The :func:`epoch_metrics` rows of the fit, each with ``"epoch"`` where known.
        compile_s: Seconds spent compiling.
        break_even_step: The step at which the compile time was paid back, if it was.
        dropped: Why (or which) plan was dropped for measuring slower than eager; ``None``: none was. The dropped
            plan's figures come from the history rows whose ``"plan"`` is not ``plan``.
        dropped_in_epoch: The epoch it was dropped in (Lightning's numbering, as the drop's warning says);
            ``None``: the last epoch the dropped plan measured.
        device_type: ``torch.device.type`` of the run (``"cuda"``, ``"cpu"``...).
        eager_steps: The ``eager_steps`` setting, to say why nothing was measured.
        reference_steps: Timed eager steps in the pooled reference at the end; below :data:`THIN_REFERENCE` the
            line says the reference is thin.
        reference_cost: The reference's share of the fit's training time, named above :data:`REFERENCE_BUDGET`.
        steps: The training steps the fit ran: a ``break_even_step`` past them is said to be still to come.
        shortfall: What of the plan did not happen (``"its graph not captured"``), said beside its name.
        unmeasured: Why no eager step ran, where the fit knows more than ``eager_steps`` says (e.g. eager refused a
            call of the network for its size).

    Example::

        >>> rows = [{"epoch": 0, "fuse/speedup": 2.41, "fuse/speedup_low": 2.3, "fuse/speedup_high": 2.5}]
        >>> verdict_line("regions + graph", rows, compile_s=31.2, break_even_step=310)
        'FuseCallback: 2.4x faster (2.3-2.5) with regions + graph; compile 31 s, paid back at step 310'
        >>> thin = verdict_line("regions", rows, compile_s=4.0, reference_steps=3, reference_cost=0.041)
        >>> thin.split("; ")[2].split(" (")[0], thin.split("; ")[3]  # what buys more: _reference_notes
        ('reference thin: 3 eager steps', 'reference cost 4.1% of training time')
        >>> verdict_line("regions", [], compile_s=4.0, eager_steps=0)
        'FuseCallback: ran regions; speedup not measured (eager_steps=0); compile 4.0 s'
        >>> verdict_line("compile+graph", rows, compile_s=3.4, shortfall="its graph not captured").split(";")[0]
        'FuseCallback: 2.4x faster (2.3-2.5) with compile+graph (its graph not captured)'
    """
    cost = f"compile {_seconds(compile_s)}"
    if dropped is not None:
        return _dropped_line(plan, history, device_type, dropped, cost, dropped_in_epoch)
    point, low, high = pooled_speedup([row for row in history if row.get(PLAN_KEY, plan) == plan])
    plan += f" ({shortfall})" if shortfall else ""
    if point is None:
        why = unmeasured or ("eager_steps=0" if eager_steps == 0 else "no eager reference step was timed")
        return f"FuseCallback: ran {plan}; speedup not measured ({why}); {cost}"
    text, low_text, high_text = _numbers(point, low, high)
    notes = _reference_notes(reference_steps, reference_cost, eager_steps)
    if low_text is None:
        return f"FuseCallback: {text}x of eager with {plan} (too few reference steps for an interval); {cost}{notes}"
    interval = f"({low_text}-{high_text})"
    if low > 1:
        return f"FuseCallback: {text}x faster {interval} with {plan}; {cost}{_payback(break_even_step, steps)}{notes}"
    judgement = "slower than eager" if high < 1 else "no clear difference from eager"
    return f"FuseCallback: {text}x {interval}, {judgement} with {plan}; {cost}{notes}"


def _payback(break_even_step: float | None, steps: int | None) -> str:
    """When compiling was paid back by the steps it sped up, or will be where the fit ended before that step.

    Example::

        >>> _payback(310, 200), _payback(310, None)
        (', pays back at step 310 (this fit ran 200)', ', paid back at step 310')
    """
    if not _known(break_even_step):
        return ""
    if steps is not None and break_even_step > steps:
        return f", pays back at step {break_even_step:.0f} (this fit ran {steps})"
    return f", paid back at step {break_even_step:.0f}"


def _reference_notes(steps: int | None, cost: float | None, eager_steps: int | None = None) -> str:
    """What the verdict adds about the eager reference: that it is thin, and what buys more (``eager_steps`` where
    it caps the reference below a thin one, ``reference_budget`` otherwise), and that it cost more than its budget.

    Example::

        >>> _reference_notes(3, 0.068).split("; ")[1:]  # doctest: +NORMALIZE_WHITESPACE
        ['reference thin: 3 eager steps (raise reference_budget for a narrower interval)',
         'reference cost 6.8% of training time']
        >>> _reference_notes(2, None, eager_steps=2)
        '; reference thin: 2 eager steps (raise eager_steps for a narrower interval)'
    """
    notes = ""
    if steps is not None and steps < THIN_REFERENCE:
        setting = "eager_steps" if eager_steps is not None and eager_steps < THIN_REFERENCE else "reference_budget"
        plural = "" if steps == 1 else "s"
        notes += f"; reference thin: {steps} eager step{plural} (raise {setting} for a narrower interval)"
    if cost is not None and cost > REFERENCE_BUDGET:
        notes += f"; reference cost {cost:.1%} of training time"
    return notes


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False) -> str:
    """A table as Markdown (pipes) or as plain text (aligned columns under a dashed rule).

    Example::

        >>> print(render_table(["epoch", "speedup"], [["0", "2.5x (2.3-2.7)"]]))
        epoch  speedup
        -----  --------------
        0      2.5x (2.3-2.7)
    """
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        return "\n".join(lines + ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows])
    widths = [max([len(title)] + [len(row[i]) for row in rows]) for i, title in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    return "\n".join([line(headers), line(["-" * width for width in widths]), *map(line, rows)])


def summary_table(
    history: Sequence[Row], tracker: CompileTracker, plan: str, *, markdown: bool = False, verdict: str | None = None
) -> str:
    """The run's summary: the plan, the verdict, one row per epoch, and what torch.compile did per region.

    Args:
        history: The :func:`epoch_metrics` rows of the fit.
        tracker: The fit's compile accounting.
        plan: The plan as printed at fit start.
        markdown: Markdown (for TensorBoard's text tab) instead of plain text (for the terminal and logging).
        verdict: A :func:`verdict_line` to put under the plan.
    """
    if markdown:  # blank lines between blocks, or Markdown runs the lines into one paragraph
        blocks = [f"**FuseCallback** plan: {plan}", verdict, "**Epochs**", _epoch_table(history, True), "**Regions**",
                  _region_table(tracker, True), "\n".join(_region_notes(tracker))]  # fmt: skip
        return "\n\n".join(block for block in blocks if block)
    lines = [f"FuseCallback plan: {plan}"] + ([verdict] if verdict else [])
    lines += ["", "Epochs", _epoch_table(history, False), "", "Regions", _region_table(tracker, False)]
    notes = _region_notes(tracker)
    return "\n".join(lines + (["", *notes] if notes else []))


_EPOCH_COLUMNS: tuple[tuple[str, str, str, float], ...] = (  # (title, key, format, scale)
    ("step ms", "fuse/step_ms", "{:.2f}", 1),
    ("eager ms", "fuse/eager_step_ms", "{:.2f}", 1),
    ("ref age", "fuse/reference_age", "{:.0f}", 1),
    ("ref %", "fuse/reference_cost", "{:.1f}", 100),
    ("samples/s", "fuse/samples_per_s", "{:.0f}", 1),
    ("compile s", "fuse/compile_s", "{:.1f}", 1),
    ("recompiles", "fuse/recompiles", "{:.0f}", 1),
    ("GPU util %", "fuse/gpu_util", "{:.0f}", 1),
    ("MFU %", "fuse/mfu", "{:.1f}", 100),
    ("peak GB", "fuse/peak_mem_gb", "{:.2f}", 1),
)


def _epoch_table(history: Sequence[Row], markdown: bool) -> str:
    """One row per epoch; columns that no epoch measured are left out, the plan only when it changed."""
    if not history:
        return "(no epoch finished)"
    plans = {row.get(PLAN_KEY) for row in history}
    columns: list[tuple[str, Callable[[Row], str]]] = [("epoch", lambda row: str(int(row["epoch"])))]
    if len(plans) > 1:
        columns.append(("plan", lambda row: str(row.get(PLAN_KEY, "-"))))
    columns.append(("speedup", lambda row: format_speedup(
        row["fuse/speedup"], row.get("fuse/speedup_low"), row.get("fuse/speedup_high"), words=False
    ) if _known(row.get("fuse/speedup")) else "-"))  # fmt: skip
    for title, key, fmt, scale in _EPOCH_COLUMNS:
        columns.append((title, lambda row, k=key, f=fmt, s=scale: f.format(row[k] * s) if k in row else "-"))
    rows = [{"epoch": index, **row} for index, row in enumerate(history)]
    cells = [[cell(row) for _, cell in columns] for row in rows]
    keep = [i for i, (title, _) in enumerate(columns) if title == "epoch" or any(r[i] != "-" for r in cells)]
    return render_table([columns[i][0] for i in keep], [[r[i] for i in keep] for r in cells], markdown)


def _name_key(name: str) -> list[tuple[int, int, str]]:
    """Sort key that puts ``blocks.2`` before ``blocks.10`` and the outside row last."""
    if name == CompileTracker.OUTSIDE:
        return [(2, 0, "")]
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]


def _family(name: str) -> str:
    """``model.blocks.3.mlp`` -> ``model.blocks.*.mlp``: regions that are one class's repeats."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)


def _region_note(name: str, stats: RegionCompiles, compiled_siblings: Mapping[str, str]) -> str:
    if stats.compiles or stats.compile_s:
        return ""
    sibling = compiled_siblings.get(_family(name))
    if sibling is not None and sibling != name:
        return f"shares {sibling}'s code"  # dynamo caches per code object: one class's blocks compile once
    return "no compile recorded"


def _region_table(tracker: CompileTracker, markdown: bool) -> str:
    """Compiles per region; repeats of one class say whose compiled code they run, the outside row says what it is."""
    names = sorted(tracker.regions, key=_name_key)
    compiled_siblings: dict[str, str] = {}
    for name in names:
        if tracker.regions[name].compiles and name != CompileTracker.OUTSIDE:
            compiled_siblings.setdefault(_family(name), name)
    rows = []
    for name in names:
        stats = tracker.regions[name]
        if name == CompileTracker.OUTSIDE:
            if stats.compile_s:
                rows.append(["(outside any region)", "-", "-", "-", f"{stats.compile_s:.1f}",
                             "time only: backward graphs and code outside the regions"])
            continue  # fmt: skip
        rows.append([name, str(stats.compiles), str(stats.recompiles), str(stats.graph_breaks),
                     f"{stats.compile_s:.1f}", _region_note(name, stats, compiled_siblings)])  # fmt: skip
    if not rows:
        return "(no region compiled)"
    headers = ["region", "compiles", "recompiles", "graph breaks", "compile s", "note"]
    if not any(row[-1] for row in rows):
        headers, rows = headers[:-1], [row[:-1] for row in rows]
    return render_table(headers, rows, markdown)


def _region_notes(tracker: CompileTracker) -> list[str]:
    notes = []
    for name, stats in sorted(tracker.regions.items(), key=lambda item: _name_key(item[0])):
        for reason in stats.recompile_reasons:
            notes.append(f"- {name} recompiled: {reason}")
        for reason in stats.break_reasons:
            notes.append(f"- {name} graph break: {reason} -> fix: {explain_graph_break(reason)}")
    return notes

