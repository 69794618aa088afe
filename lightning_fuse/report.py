r"""``lightning-fuse report``: one table (and optionally one plot) of the ``fuse/`` scalars of FuseCallback runs.

Every directory under the LOGDIRs that holds TensorBoard event files with ``fuse/`` scalars is one run. The
callback logs those scalars once per epoch with ``step = epoch``; this module reads them back, summarises each run
over its epochs and prints the summary::

    $ lightning-fuse report outputs/2026-01-05/10-31-02/tb outputs/2026-01-05/11-02-40/tb --plot fuse.png
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median
from typing import Union

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from tensorboard.backend.event_processing import event_accumulator

PREFIX = "fuse/"
Cell = Union[str, int, float, None]

# Summary columns: key in ``summarise``'s dict, header, format of a value.
_COLUMNS = (
    ("run", "run", "{}"),
    ("epochs", "epochs", "{:d}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("step_ms", "step ms", "{:.2f}"),
    ("gpu_util", "GPU util %", "{:.0f}"),
    ("mfu_pct", "MFU %", "{:.1f}"),
    ("compile_s", "compile s", "{:.1f}"),
)
# Plot panels: metric, title, y label, what to say when no run logged it.
_PANELS = (
    ("speedup", "Speedup over eager", "speedup (x)", "no run logged fuse/speedup"),
    ("gpu_util", "GPU utilisation", "utilization.gpu (%)", "no run logged fuse/gpu_util\n(CPU runs, or no NVML)"),
)


class NoRunsError(LookupError):
    """A LOGDIR holds no event files with ``fuse/`` scalars.

    Example::

        >>> str(NoRunsError("logs"))  # doctest: +ELLIPSIS
        'no fuse/ scalars found under logs: point at the directory a FuseCallback run logged to, e.g. ...'
    """

    def __init__(self, logdir: str | os.PathLike) -> None:
        super().__init__(
            f"no fuse/ scalars found under {logdir}: point at the directory a FuseCallback run logged to,"
            " e.g. outputs/<date>/<time>/tb"
        )


@dataclass(frozen=True)
class Run:
    """The ``fuse/`` scalars of one run.

    Attributes:
        name: the run's directory relative to the LOGDIR given (the LOGDIR's own name if it is the run); the path
            as given where two runs would share a name.
        path: the run's directory.
        scalars: metric (tag without ``fuse/``) -> {epoch: value}.

    Example::

        >>> run = Run("tb", Path("tb"), {"speedup": {1: 1.4, 0: 1.2}})
        >>> run.series("speedup"), run.epochs
        ([(0, 1.2), (1, 1.4)], [0, 1])
    """

    name: str
    path: Path
    scalars: dict[str, dict[int, float]]

    @property
    def epochs(self) -> list[int]:
        """Every epoch for which any ``fuse/`` scalar was logged, sorted."""
        return sorted({step for values in self.scalars.values() for step in values})

    def series(self, metric: str) -> list[tuple[int, float]]:
        """(epoch, value) pairs of ``metric``, sorted by epoch; empty if the run never logged it."""
        return sorted(self.scalars.get(metric, {}).items())


def load_runs(paths: Sequence[str | os.PathLike]) -> list[Run]:
    """Find and read every run under the given LOGDIRs, searched recursively.

    Args:
        paths: LOGDIRs; each one may be a run itself or hold many.

    Returns:
        The runs, LOGDIR by LOGDIR in the order given, sorted by name within one.

    Raises:
        FileNotFoundError: If a path does not exist or is not a directory.
        NoRunsError: If a LOGDIR holds no ``fuse/`` scalars.

    Example::

        >>> runs = load_runs(["outputs/2026-01-05/10-31-02/tb"])  # doctest: +SKIP
        >>> [run.name for run in runs]  # doctest: +SKIP
        ['tb']
    """
    runs: list[Run] = []
    for given in paths:
        root = Path(given)
        if not root.is_dir():
            reason = "is not a directory" if root.exists() else "does not exist"
            raise FileNotFoundError(f"{given} {reason}: pass the folder the TensorBoard event files are in.")
        found = [_read_run(root, directory) for directory in _event_dirs(root)]
        found = sorted((run for run in found if run.scalars), key=lambda run: run.name)
        if not found:
            raise NoRunsError(given)
        runs.extend(found)
    shared = {name for name, count in Counter(run.name for run in runs).items() if count > 1}
    return [replace(run, name=str(run.path)) if run.name in shared else run for run in runs]


def _event_dirs(root: Path) -> list[Path]:
    """Directories under ``root`` (itself included) that hold TensorBoard event files."""
    return sorted({file.parent for file in root.rglob("*tfevents*") if file.is_file()})


def _read_run(root: Path, directory: Path) -> Run:
    """Read the ``fuse/`` scalars of the event files in ``directory`` (not its subdirectories)."""
    accumulator = event_accumulator.EventAccumulator(
        str(directory),
        size_guidance={event_accumulator.SCALARS: 0},  # 0 keeps every scalar event: no reservoir subsampling
    )
    accumulator.Reload()
    scalars: dict[str, dict[int, float]] = {}
    for tag in accumulator.Tags()["scalars"]:
        if tag.startswith(PREFIX):
            events = sorted(accumulator.Scalars(tag), key=lambda event: event.wall_time)
            scalars[tag[len(PREFIX) :]] = {event.step: event.value for event in events}  # a rerun epoch: last wins
    relative = directory.relative_to(root)
    name = relative.as_posix() if relative.parts else root.resolve().name
    return Run(name=name, path=root / relative, scalars=scalars)


def summarise(run: Run) -> dict[str, Cell]:
    """Summarise a run over its epochs: medians of the per-epoch metrics, the total compile time.

    ``fuse/compile_s`` is cumulative, so its total is the maximum over epochs. MFU is logged as a fraction and
    summarised in %. A metric the run never logged is ``None``.

    Example::

        >>> run = Run("a", Path("a"), {"speedup": {0: 1.1, 1: 1.5, 2: 1.3}, "compile_s": {0: 20.0, 1: 21.5}})
        >>> summary = summarise(run)
        >>> summary["epochs"], summary["speedup"], summary["compile_s"], summary["mfu_pct"]
        (3, 1.3, 21.5, None)
    """
    mfu = _median(run, "mfu")
    compile_s = [value for _, value in run.series("compile_s")]
    return {
        "run": run.name,
        "epochs": len(run.epochs),
        "speedup": _median(run, "speedup"),
        "step_ms": _median(run, "step_ms"),
        "gpu_util": _median(run, "gpu_util"),
        "mfu_pct": None if mfu is None else 100 * mfu,
        "compile_s": max(compile_s) if compile_s else None,
    }


def _median(run: Run, metric: str) -> float | None:
    values = [value for _, value in run.series(metric)]
    return median(values) if values else None


def format_table(rows: Sequence[dict[str, Cell]], fmt: str = "text") -> str:
    """Render ``summarise`` rows as aligned text or as a markdown table, ``-`` where a value is missing.

    Args:
        rows: one dict per run, as ``summarise`` returns.
        fmt: ``"text"`` or ``"md"``.

    Raises:
        ValueError: If ``fmt`` is neither.

    Example::

        >>> print(format_table([{"run": "a", "epochs": 3, "speedup": 1.3}], fmt="md"))
        | run | epochs | speedup | step ms | GPU util % | MFU % | compile s |
        | :-- | -----: | ------: | ------: | ---------: | ----: | --------: |
        | a   |      3 |   1.30x |       - |          - |     - |         - |
    """
    if fmt not in ("text", "md"):
        raise ValueError(f"`fmt` can be 'text' or 'md', got {fmt!r}.")
    table = [[header for _, header, _ in _COLUMNS]]
    table += [[_cell(row.get(key), spec) for key, _, spec in _COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]

    def line(cells: list[str]) -> list[str]:  # the run column left-aligned, numbers right-aligned
        return [cells[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:])]

    if fmt == "md":
        rule = [":" + "-" * (widths[0] - 1)] + ["-" * (width - 1) + ":" for width in widths[1:]]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in [line(table[0]), rule, *map(line, table[1:])])
    rule = ["-" * width for width in widths]
    return "\n".join("  ".join(cells).rstrip() for cells in [line(table[0]), rule, *map(line, table[1:])])


def _cell(value: Cell, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def plot_runs(runs: Sequence[Run], path: str | os.PathLike) -> None:
    """Save one PNG with two panels, speedup and GPU utilisation per epoch, one line per run.

    A panel whose metric no run logged says so instead of staying empty.

    Example::

        >>> plot_runs(load_runs(["outputs/2026-01-05"]), "fuse.png")  # doctest: +SKIP
    """
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(figure)  # render with Agg, whatever backend pyplot is set to
    for axes, (metric, title, ylabel, missing) in zip(figure.subplots(1, 2), _PANELS):
        axes.set(title=title, xlabel="epoch", ylabel=ylabel)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        plotted = [run for run in runs if run.series(metric)]
        for run in plotted:
            epochs, values = zip(*run.series(metric))
            axes.plot(epochs, values, marker="o", label=run.name)
        if plotted:
            axes.legend(fontsize="small")
        else:
            axes.text(0.5, 0.5, missing, ha="center", va="center", color="grey", transform=axes.transAxes)
            axes.set(xticks=[], yticks=[])
        if metric == "speedup":
            axes.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)  # eager baseline
        else:
            axes.set_ylim(0, 105)  # a percentage: keep the full scale so runs compare at a glance
    figure.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lightning-fuse`` console script.

    Returns:
        0 on success, 1 if a LOGDIR holds no FuseCallback run, 2 if a path is missing or the plot cannot be written.

    Example::

        >>> main(["report", "outputs/2026-01-05", "--format", "md"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(prog="lightning-fuse", description="Tools for lightning_fuse runs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report = commands.add_parser("report", help="summarise the fuse/ scalars of FuseCallback runs")
    report.add_argument("logdirs", nargs="+", metavar="LOGDIR", help="TensorBoard directory, searched recursively")
    report.add_argument("--format", choices=("text", "md"), default="text", help="table format (default: text)")
    report.add_argument("--plot", metavar="PNG", help="also save speedup and GPU utilisation per epoch to PNG")
    report.set_defaults(run=_report)
    args = parser.parse_args(argv)
    return args.run(args)


def _report(args: argparse.Namespace) -> int:
    try:
        runs = load_runs(args.logdirs)
    except FileNotFoundError as err:
        print(f"lightning-fuse report: {err}", file=sys.stderr)
        return 2
    except NoRunsError as err:
        print(f"lightning-fuse report: {err}", file=sys.stderr)
        return 1
    print(format_table([summarise(run) for run in runs], args.format))
    if args.plot:
        try:
            plot_runs(runs, args.plot)
        except OSError as err:
            print(f"lightning-fuse report: cannot write the plot to {args.plot}: {err}", file=sys.stderr)
            return 2
        print(f"plot saved to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
