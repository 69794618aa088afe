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


def check(label: str, fuse_dirs: str, eager_dirs: str) -> tuple[str, bool]:
    fuse, eager = load_runs(fuse_dirs.split(",")), load_runs(eager_dirs.split(","))
    logged = pooled(fuse, "speedup")
    separate = pooled(eager, "step_ms") / pooled(fuse, "step_ms")
    gap = abs(logged / separate - 1)
    ok = gap <= TOLERANCE
    row = (
        f"| {label} | {len(fuse)} + {len(eager)} | {pooled(fuse, 'step_ms'):.2f} | "
        f"{pooled(fuse, 'eager_step_ms'):.2f} | {pooled(eager, 'step_ms'):.2f} | {logged:.2f}x | {separate:.2f}x | "
        f"{gap:.1%} | {'PASS' if ok else 'FAIL'} |"
    )
    return row, ok


def main(pairs: list[str]) -> int:
    print("| regime | fuse + eager runs | fuse step ms | in-run eager ms | eager-only runs step ms | logged speedup | "
          "separate-run speedup | gap | within 5% |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = [check(label, *dirs.split(":")) for label, dirs in (pair.split("=", 1) for pair in pairs)]
    for row, _ in results:
        print(row)
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
