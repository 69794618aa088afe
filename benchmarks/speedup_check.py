"""Check the speedup FuseCallback logs against separate eager-only runs of the same recipe.

For each regime, given the ``fuse=auto`` runs and the ``fuse=measure_only`` (eager) runs of the same model and
batch, compares the logged ``fuse/speedup`` with ``eager-only step ms / fuse step ms``, and writes a markdown
table. Each run counts once: a metric is its median over the run's epochs, and several runs are pooled with the
geometric mean (runs on the lent machines differ by 10-25%, epochs within a run much less, so a median over the
pooled epochs would just pick one run). Used by ``benchmarks/recipes.sh``; runs per side are comma-separated::

    python benchmarks/speedup_check.py small=RUNS/fuse1/tb,RUNS/fuse2/tb:RUNS/eager1/tb,RUNS/eager2/tb large=...
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_fuse.report import load_runs  # noqa: E402

TOLERANCE = 0.05


def pooled(runs: list, metric: str) -> float:
    """Geometric mean over ``runs`` of each run's median ``fuse/<metric>`` over its epochs."""
    medians = [statistics.median(v for _, v in run.series(metric)) for run in runs if run.series(metric)]
    if len(medians) < len(runs):
        raise SystemExit(f"no fuse/{metric} in some of {[run.name for run in runs]}")
    return statistics.geometric_mean(medians)


def load_sides(pair: str) -> tuple[str, list, list]:
    """``label=FUSE_DIRS:EAGER_DIRS`` (comma-separated run folders) -> the label, the fuse runs, the eager runs."""
    label, dirs = pair.split("=", 1)
    fuse_dirs, eager_dirs = dirs.split(":")
    return label, load_runs(fuse_dirs.split(",")), load_runs(eager_dirs.split(","))


def check(label: str, fuse: list, eager: list) -> tuple[str, bool]:
    fuse_ms, eager_ms = pooled(fuse, "step_ms"), pooled(eager, "step_ms")
    logged = pooled(fuse, "speedup")
    separate = eager_ms / fuse_ms
    gap = abs(logged / separate - 1)
    ok = gap <= TOLERANCE
    row = (
        f"| {label} | {len(fuse)} + {len(eager)} | {fuse_ms:.2f} | {pooled(fuse, 'eager_step_ms'):.2f} | "
        f"{eager_ms:.2f} | {logged:.2f}x | {separate:.2f}x | {gap:.1%} | {'PASS' if ok else 'FAIL'} |"
    )
    return row, ok


def per_run(label: str, fuse: list, eager: list) -> list[str]:
    """One row per run: its medians over its epochs, so the spread between runs shows beside the pooled values."""
    rows = []
    for side, runs in (("fuse", fuse), ("eager-only", eager)):
        for run in runs:
            series = [[v for _, v in run.series(m)] for m in ("step_ms", "eager_step_ms", "speedup")]
            cells = [f"{statistics.median(values):.2f}" if values else "-" for values in series]
            rows.append(f"| {label} | {side} | {run.name} | " + " | ".join(cells) + " |")
    return rows


def main(pairs: list[str]) -> int:
    print("| regime | fuse + eager runs | fuse step ms | in-run eager ms | eager-only runs step ms | logged speedup | "
          "separate-run speedup | gap | within 5% |")
    print("|---|---|---|---|---|---|---|---|---|")
    regimes = [load_sides(pair) for pair in pairs]  # each run's event files are read once
    results = [check(*regime) for regime in regimes]
    for row, _ in results:
        print(row)
    print("\nPer run (medians over its epochs):\n")
    print("| regime | side | run | step ms | in-run eager ms | logged speedup |")
    print("|---|---|---|---|---|---|")
    for regime in regimes:
        print("\n".join(per_run(*regime)))
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
