r"""``lightning-fuse report``: one table (and optionally one plot) over FuseCallback runs, saying what each one ran.

Every directory under the LOGDIRs that holds TensorBoard event files with ``fuse/`` scalars is one run. The
callback logs those scalars once per epoch with ``step = epoch``. :mod:`~lightning_fuse.runs` reads them back,
together with the ``fuse/summary`` text and the Hydra overrides of the run; this module summarises each run:

- **name**: its Hydra overrides (``.hydra/overrides.yaml`` next to or above the event files; ``(defaults)``
  when there are none), else the logger's ``name/version`` folders;
- **status**: ``compiled``, ``dropped in epoch N`` (the plan was dropped in epoch ``N``, Lightning's numbering
  as in the callback's warning, and the run trained eagerly after it), ``measure only`` (an eager run that only
  times itself, ``fuse=measure_only``), or ``never compiled``;
- **plan**: the plan it ended with, from its ``fuse/summary`` (``eager`` for a run that never compiled);
- **speedup**, step ms, GPU util and MFU: medians over the epochs that ran the compiled plan only; a run that
  never compiled shows no speedup. With ``fuse/speedup_low``/``fuse/speedup_high`` the speedup reads
  ``3.4x (3.2-3.6)``: the medians of the epochs' own bounds.

Reading event files needs ``tensorboard`` and ``--plot`` needs ``matplotlib``: ``pip install "lightning-fuse[report]"``.

Example::

    >>> run = Run("fuse=auto", Path("tb"), {"speedup": {0: 2.0, 1: 2.4, 2: 1.0}, "compiled": {0: 1, 1: 1, 2: 0},
    ...                                     "plan_dropped": {1: 1, 2: 1}})
    >>> row = summarise(run)
    >>> row["status"], row["speedup_text"], row["epochs"]
    ('dropped in epoch 1', '2.2x', '2/3')

From a shell::

    $ python -m lightning_fuse report outputs/2026-01-05/10-31-02 multirun/ --plot   # plot: its first folder
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any, Union

from lightning_fuse.metrics import format_speedup
from lightning_fuse.runs import INSTALL_HINT, NoRunsError, Run, load_runs, shared_overrides

Cell = Union[str, int, float, None]

# Summary columns: key in ``summarise``'s dict, header, format of a value. ``optional`` columns are left out of a
# table where no run has a value (a CPU-only report has no GPU columns).
_COLUMNS = (
    ("run", "run", "{}"),
    ("status", "status", "{}"),
    ("plan", "plan", "{}"),
    ("epochs", "epochs", "{}"),
    ("speedup_text", "speedup", "{}"),
    ("step_ms", "step ms", "{:.2f}"),
    ("gpu_util", "GPU util %", "{:.0f}"),
    ("mfu_pct", "MFU %", "{:.1f}"),
    ("compile_s", "compile s", "{:.1f}"),
)
_OPTIONAL = ("plan", "gpu_util", "mfu_pct")
COMPILED, MEASURE_ONLY, NEVER_COMPILED, UNKNOWN = "compiled", "measure only", "never compiled", "-"
_PLAN_TEXT = re.compile(r"plan: ([\w+-]+)")
_DROP_TEXT = re.compile(r"eager from epoch (\d+)|plan (?:was )?dropped", re.IGNORECASE)
_MEASURE_TEXT = re.compile(r"measure[ _-]only", re.IGNORECASE)
_EXPLAIN = {
    "dropped": "dropped in epoch N: the plan measured slower than eager, so the run trained eagerly after it;"
    " its medians pool the epochs before N.",
    MEASURE_ONLY: "measure only: an eager run that times itself (fuse=measure_only); its step ms is an eager "
    "baseline, not a speedup.",
    NEVER_COMPILED: "never compiled: every epoch ran eagerly (the measured plan kept eager, or nothing compiled); "
    "there is no speedup to show.",
}


@dataclass(frozen=True)
class PlanStatus:
    """What a run ran: a label for the table and the epochs that ran its compiled plan (the ones pooled).

    Example::

        >>> PlanStatus(COMPILED, (0, 1)).flagged, PlanStatus(MEASURE_ONLY, ()).flagged
        (False, True)
    """

    label: str
    pooled: tuple[int, ...]

    @property
    def flagged(self) -> bool:
        return self.label not in (COMPILED, UNKNOWN)


def plan_status(run: Run) -> PlanStatus:
    """Tell from the scalars ``fuse/compiled`` and ``fuse/plan_dropped``, the ``fuse/`` texts and the Hydra config
    whether the run compiled, dropped its plan, or only measured eager steps.

    Without ``fuse/compiled`` (older runs), the summary text decides: ``"eager from epoch N"`` marks a drop, and a
    finished run without one compiled every epoch.

    Example::

        >>> plan_status(Run("a", Path("a"), {"speedup": {0: 1.0}, "compiled": {0: 0.0}}))
        PlanStatus(label='never compiled', pooled=())
    """
    epochs = run.epochs
    text = "\n".join(run.texts.values())
    if _measure_only(run, text):  # nothing to compile (targets=[]), whatever else was logged
        return PlanStatus(MEASURE_ONLY, ())
    dropped_at = _drop_epoch(run, text)
    compiled = run.scalars.get("compiled")
    if compiled is not None:
        last = dropped_at if dropped_at is not None and dropped_at >= 0 else float("inf")  # epochs after: eager
        pooled = tuple(e for e, value in sorted(compiled.items()) if value >= 0.5 and e <= last)
    elif dropped_at is not None:
        pooled = tuple(e for e in epochs if e <= dropped_at)
    elif run.texts:
        return PlanStatus(COMPILED, tuple(epochs))  # a finished run that kept its plan
    else:
        pooled = ()
    if dropped_at is not None:
        return PlanStatus(f"dropped in epoch {dropped_at}" if dropped_at >= 0 else "dropped", pooled)
    if pooled:
        return PlanStatus(COMPILED, pooled)
    return PlanStatus(NEVER_COMPILED if compiled is not None else UNKNOWN, ())


def _drop_epoch(run: Run, text: str) -> int | None:
    """The epoch the plan was dropped in (the last one it ran, wholly or in part); -1 for a drop at an unknown epoch;
    ``None`` without a drop."""
    if "plan_dropped" in run.scalars:  # the callback says it each epoch: its word is final
        flagged = [epoch for epoch, value in run.series("plan_dropped") if value >= 0.5]
        return flagged[0] if flagged else None
    match = _DROP_TEXT.search(text)
    if match is None:
        return None
    return int(match.group(1)) - 1 if match.group(1) else -1  # "eager from epoch N": dropped in the one before


def _measure_only(run: Run, text: str) -> bool:
    """An eager run that only times itself: said in its texts, or its Hydra config compiles no targets."""
    if _MEASURE_TEXT.search(text):
        return True
    if "fuse=measure_only" in (run.overrides or ()):
        return True
    config = run.config()
    fuse = config.get("fuse") if isinstance(config, dict) else None
    return isinstance(fuse, dict) and fuse.get("targets") == []


def summarise(run: Run) -> dict[str, Cell]:
    """Summarise a run over the epochs of its compiled plan: medians, the interval, the total compile time.

    A run that never compiled (measure only, or a plan kept eager) shows no speedup; its step ms and GPU figures
    are medians over all its epochs (an eager baseline). ``fuse/compile_s`` is cumulative, so its total is the
    maximum over epochs. MFU is logged as a fraction and summarised in %. A metric not logged is ``None``.

    Example::

        >>> run = Run("a", Path("a"), {"speedup": {0: 1.1, 1: 1.5, 2: 1.3}, "compile_s": {0: 20.0, 1: 21.5}})
        >>> summary = summarise(run)
        >>> summary["epochs"], summary["speedup_text"], summary["compile_s"], summary["mfu_pct"]
        ('3', '1.30x', 21.5, None)
    """
    status = plan_status(run)
    if status.label in (MEASURE_ONLY, NEVER_COMPILED):
        pooled, speedup = tuple(run.epochs), None  # eager vs eager: no speedup to show
    else:  # compiled or dropped: the compiled epochs; unknown (no fuse/compiled, no summary yet): every epoch
        pooled = tuple(run.epochs) if status.label == UNKNOWN else status.pooled
        speedup = _median(run, "speedup", pooled)
    low, high = (_median(run, f"speedup_{bound}", pooled) for bound in ("low", "high"))
    mfu = _median(run, "mfu", pooled)
    compile_s = [value for _, value in run.series("compile_s")]
    epochs = len(run.epochs)
    return {
        "run": run.name,
        "status": status.label,
        "plan": "eager" if status.label in (MEASURE_ONLY, NEVER_COMPILED) else plan_name(run),
        "epochs": str(epochs) if len(pooled) in (0, epochs) else f"{len(pooled)}/{epochs}",
        "speedup": speedup,
        "speedup_text": None if speedup is None else format_speedup(speedup, low, high, words=False),
        "step_ms": _median(run, "step_ms", pooled),
        "gpu_util": _median(run, "gpu_util", pooled),
        "mfu_pct": None if mfu is None else 100 * mfu,
        "compile_s": max(compile_s) if compile_s else None,
    }


def plan_name(run: Run) -> str | None:
    """The plan the run ended with, from its ``fuse/summary`` (``FuseCallback plan: compile+graph (chosen by
    measurement); graph: captured, 191 replays``); ``None`` without a summary.

    Example::

        >>> plan_name(Run("a", Path("a"), {}, {"summary": "**FuseCallback** plan: regions+graph (chosen by ...)"}))
        'regions+graph'
    """
    match = _PLAN_TEXT.search("\n".join(run.texts.values()))
    return match.group(1) if match else None


def _median(run: Run, metric: str, epochs: Sequence[int]) -> float | None:
    values = [value for _, value in run.series(metric, epochs)]
    return median(values) if values else None


def format_table(rows: Sequence[dict[str, Cell]], fmt: str = "text") -> str:
    """Render ``summarise`` rows as aligned text or as a markdown table, ``-`` where a value is missing.

    The GPU util and MFU columns are left out when no row has a value (CPU runs).

    Args:
        rows: one dict per run, as ``summarise`` returns.
        fmt: ``"text"`` or ``"md"``.

    Raises:
        ValueError: If ``fmt`` is neither.

    Example::

        >>> print(format_table([{"run": "fuse=auto", "status": "compiled", "epochs": "3", "speedup_text": "1.30x"}],
        ...                    fmt="md"))
        | run       | status   | epochs | speedup | step ms | compile s |
        | :-------- | :------- | -----: | ------: | ------: | --------: |
        | fuse=auto | compiled |      3 |   1.30x |       - |         - |
    """
    if fmt not in ("text", "md"):
        raise ValueError(f"`fmt` can be 'text' or 'md', got {fmt!r}.")
    columns = [c for c in _COLUMNS if c[0] not in _OPTIONAL or any(row.get(c[0]) is not None for row in rows)]
    table = [[header for _, header, _ in columns]]
    table += [[_cell(row.get(key), spec) for key, _, spec in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    left = 2  # run and status are text, left-aligned; numbers right-aligned

    def line(cells: list[str]) -> list[str]:
        return [cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths))]

    if fmt == "md":
        rule = [":" + "-" * (w - 1) if i < left else "-" * (w - 1) + ":" for i, w in enumerate(widths)]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in [line(table[0]), rule, *map(line, table[1:])])
    rule = ["-" * width for width in widths]
    return "\n".join("  ".join(cells).rstrip() for cells in [line(table[0]), rule, *map(line, table[1:])])


def _cell(value: Cell, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def explain_flags(rows: Sequence[dict[str, Cell]]) -> list[str]:
    """One line for each kind of flagged status in ``rows``, saying what it means for the figures.

    Example::

        >>> explain_flags([{"status": "measure only"}, {"status": "compiled"}])  # doctest: +ELLIPSIS
        ['measure only: an eager run that times itself (fuse=measure_only); ...']
    """
    kinds = {"dropped" if str(row.get("status")).startswith("dropped") else row.get("status") for row in rows}
    return [text for kind, text in _EXPLAIN.items() if kind in kinds]


def plot_runs(runs: Sequence[Run], path: str | os.PathLike) -> None:
    """Save one PNG: the speedup per epoch of every run that compiled (its compiled epochs, with the interval
    where logged) and, only where some run has GPU data, GPU utilisation per epoch.

    Raises:
        ModuleNotFoundError: If ``matplotlib`` is not installed; the message says how to install it.

    Example::

        >>> plot_runs(load_runs(["outputs/2026-01-05"]), "fuse.png")  # doctest: +SKIP
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ModuleNotFoundError(f"--plot needs matplotlib: {INSTALL_HINT}") from err
    gpu = [run for run in runs if run.series("gpu_util")]
    figure = Figure(figsize=(12 if gpu else 6.5, 4.5), layout="constrained")
    FigureCanvasAgg(figure)  # render with Agg, whatever backend pyplot is set to
    axes = figure.subplots(1, 2 if gpu else 1, squeeze=False)[0]
    colors = {id(run): f"C{i % 10}" for i, run in enumerate(runs)}  # one colour per run in both panels
    _plot_speedup(axes[0], runs, colors)
    if gpu:
        _plot_gpu_util(axes[1], gpu, colors)
    figure.savefig(path, dpi=120)


def _plot_speedup(axes: Any, runs: Sequence[Run], colors: dict[int, str]) -> None:
    from matplotlib.ticker import MaxNLocator

    axes.set(title="Speedup over eager (compiled epochs)", xlabel="epoch", ylabel="speedup (x)")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)  # eager
    plotted = 0
    for run in runs:
        status = plan_status(run)
        pooled = tuple(run.epochs) if status.label == UNKNOWN else status.pooled
        points = run.series("speedup", pooled)
        if not points:
            continue
        label = run.name if status.label in (COMPILED, UNKNOWN) else f"{run.name} ({status.label})"
        epochs, values = zip(*points)
        axes.plot(epochs, values, marker="o", label=label, color=colors[id(run)])
        low, high = dict(run.series("speedup_low", pooled)), dict(run.series("speedup_high", pooled))
        band = [e for e in epochs if e in low and e in high]
        if band:
            axes.fill_between(band, [low[e] for e in band], [high[e] for e in band], color=colors[id(run)], alpha=0.2)
        plotted += 1
    if plotted:
        axes.legend(fontsize="small")
    else:
        axes.text(0.5, 0.5, "no run compiled", ha="center", va="center", color="grey", transform=axes.transAxes)


def _plot_gpu_util(axes: Any, runs: Sequence[Run], colors: dict[int, str]) -> None:
    from matplotlib.ticker import MaxNLocator

    axes.set(title="GPU utilisation", xlabel="epoch", ylabel="utilization.gpu (%)")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    for run in runs:
        epochs, values = zip(*run.series("gpu_util"))
        axes.plot(epochs, values, marker="o", label=run.name, color=colors[id(run)])
    axes.legend(fontsize="small")
    axes.set_ylim(0, 105)  # a percentage: keep the full scale so runs compare at a glance


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``report`` sub-command's arguments.

    Example::

        >>> parser = argparse.ArgumentParser()
        >>> add_arguments(parser)
        >>> parser.parse_args(["runs/", "--format", "md"]).logdirs
        ['runs/']
    """
    parser.add_argument(
        "logdirs", nargs="+", metavar="LOGDIR", help="a run's folder or a folder of runs, searched recursively"
    )
    parser.add_argument("--format", choices=("text", "md"), default="text", help="table format (default: text)")
    parser.add_argument("--plot", metavar="PNG", nargs="?", const="",
                        help="also save speedup (and GPU utilisation) per epoch to PNG (no PNG: fuse.png in the "
                        "first LOGDIR)")  # fmt: skip


def report(args: argparse.Namespace) -> int:
    """Run the ``report`` sub-command: print the table and the meaning of its flags, save the plot.

    Returns:
        0 on success, 1 if a LOGDIR holds no FuseCallback run, 2 if a path is missing, a package is missing or the
        plot cannot be written.

    Example::

        >>> report(argparse.Namespace(logdirs=["/nonexistent"], format="text", plot=None))
        2
    """
    try:
        runs = load_runs(args.logdirs)
    except (FileNotFoundError, ModuleNotFoundError) as err:
        print(f"lightning-fuse report: {err}", file=sys.stderr)
        return 2
    except NoRunsError as err:
        print(f"lightning-fuse report: {err}", file=sys.stderr)
        return 1
    rows = [summarise(run) for run in runs]
    shared = shared_overrides(runs)
    if shared:
        print(f"Overrides of every run: {' '.join(shared)}\n")
    print(format_table(rows, args.format))
    notes = explain_flags(rows)
    if notes:
        print("\n" + "\n".join(f"{'- ' if args.format == 'md' else ''}{note}" for note in notes))
    if args.plot is not None:
        path = Path(args.plot or Path(args.logdirs[0]) / "fuse.png")  # beside the runs, not wherever one stands
        try:
            plot_runs(runs, path)
        except (OSError, ModuleNotFoundError) as err:
            print(f"lightning-fuse report: cannot write the plot to {path}: {err}", file=sys.stderr)
            return 2
        print(f"plot saved to {path}", file=sys.stderr)
    return 0
