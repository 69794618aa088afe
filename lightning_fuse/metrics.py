"""The per-epoch ``fuse/`` scalars and the end-of-fit summary table.

Example::

    >>> from lightning_fuse.timing import EpochTiming
    >>> row = epoch_metrics(EpochTiming(10.0, 25.0, 40, 4), batch_size=32, compile_s=12.0)
    >>> row["fuse/speedup"], row["fuse/break_even_step"]
    (2.5, 800)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_fuse.shapes import CompileTracker, explain_graph_break
from lightning_fuse.timing import EpochTiming

PREFIX = "fuse/"


def epoch_metrics(
    timing: EpochTiming,
    batch_size: int | None,
    compile_s: float,
    recompiles: int = 0,
    items_per_batch: float | None = None,
    flops_per_batch: float | None = None,
    peak_flops: float | None = None,
    extra: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """The scalars of one epoch; a value that was not measured is left out rather than logged as zero."""
    row: dict[str, float] = {"fuse/compile_s": compile_s, "fuse/recompiles": float(recompiles)}
    if timing.step_ms:
        row["fuse/step_ms"] = timing.step_ms
        step_s = timing.step_ms / 1e3
        if batch_size:
            row["fuse/samples_per_s"] = batch_size / step_s
        if items_per_batch:
            row["fuse/items_per_s"] = items_per_batch / step_s
        if flops_per_batch and peak_flops:
            row["fuse/mfu"] = flops_per_batch / step_s / peak_flops
    if timing.eager_step_ms:
        row["fuse/eager_step_ms"] = timing.eager_step_ms
    if timing.speedup is not None:
        row["fuse/speedup"] = timing.speedup
        saved_s = (timing.eager_step_ms - timing.step_ms) / 1e3
        if saved_s > 0:
            row["fuse/break_even_step"] = math.ceil(compile_s / saved_s)
    row.update({f"{PREFIX}{k}": float(v) for k, v in (extra or {}).items()})
    return row


def per_rank(name: str, values: Sequence[float]) -> dict[str, float]:
    """``{name}_rank<r>`` for every rank that measured a value (NaN: that rank had nothing to report).

    Example::

        >>> per_rank("gpu_util", [41.0, float("nan"), 38.5])
        {'gpu_util_rank0': 41.0, 'gpu_util_rank2': 38.5}
    """
    return {f"{name}_rank{rank}": value for rank, value in enumerate(values) if not math.isnan(value)}


def summary_table(history: Sequence[Mapping[str, float]], tracker: CompileTracker, plan: str) -> str:
    """A markdown summary of the run: the plan, one line per epoch, and what torch.compile did per region."""
    lines = [f"**FuseCallback** plan: {plan}", "", _epoch_table(history), "", _region_table(tracker)]
    notes = _region_notes(tracker)
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def _epoch_table(history: Sequence[Mapping[str, float]]) -> str:
    columns = [  # (title, key, format, scale)
        ("epoch", "epoch", "{:.0f}", 1),
        ("step ms", "fuse/step_ms", "{:.2f}", 1),
        ("eager ms", "fuse/eager_step_ms", "{:.2f}", 1),
        ("speedup", "fuse/speedup", "{:.2f}x", 1),
        ("samples/s", "fuse/samples_per_s", "{:.0f}", 1),
        ("compile s", "fuse/compile_s", "{:.1f}", 1),
        ("recompiles", "fuse/recompiles", "{:.0f}", 1),
        ("GPU util %", "fuse/gpu_util", "{:.0f}", 1),
        ("MFU %", "fuse/mfu", "{:.1f}", 100),
        ("peak GB", "fuse/peak_mem_gb", "{:.2f}", 1),
    ]
    header = "| " + " | ".join(title for title, *_ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    rows = []
    for epoch, row in enumerate(history):
        values = {"epoch": epoch, **row}
        cells = [fmt.format(values[key] * scale) if key in values else "-" for _, key, fmt, scale in columns]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join([header, rule, *rows]) if rows else "(no epoch finished)"


def _region_table(tracker: CompileTracker) -> str:
    lines = ["| region | compiles | recompiles | graph breaks | compile s |", "|---|---|---|---|---|"]
    for name, stats in sorted(tracker.regions.items()):
        lines.append(
            f"| {name} | {stats.compiles} | {stats.recompiles} | {stats.graph_breaks} | {stats.compile_s:.1f} |"
        )
    return "\n".join(lines)


def _region_notes(tracker: CompileTracker) -> list[str]:
    notes = []
    for name, stats in sorted(tracker.regions.items()):
        for reason in stats.recompile_reasons:
            notes.append(f"- {name} recompiled: {reason}")
        for reason in stats.break_reasons:
            notes.append(f"- {name} graph break: {reason} -> fix: {explain_graph_break(reason)}")
    return notes


def count_items(length_fn: Callable[[Any], Any], batch: Any) -> float | torch.Tensor:
    """``length_fn(batch)``, kept as a tensor if it is one (no host sync per step), or a ``TypeError`` that says what
    it returned instead."""
    items = length_fn(batch)
    if isinstance(items, torch.Tensor) and items.numel() == 1:
        return items.detach().reshape(()).float()
    if isinstance(items, (int, float)) and not isinstance(items, bool):
        return float(items)
    got = f"a tensor of shape {tuple(items.shape)}" if isinstance(items, torch.Tensor) else (
        f"{type(items).__name__}: {items!r:.80}"
    )
    raise TypeError(
        "`length_fn` must return the number of items in a batch (an int, a float or a one-element tensor), "
        f"got {got}. Example: length_fn=lambda batch: batch['attention_mask'].sum()."
    )
