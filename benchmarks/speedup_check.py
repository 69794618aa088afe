"""Check the speedup FuseCallback logs against separate eager-only runs of the same recipe.

For each regime, given the ``fuse=auto`` runs and the ``fuse=measure_only`` (eager) runs of the same model and
batch, compares the median over all their epochs of the logged ``fuse/speedup`` with ``eager-only step ms / fuse
step ms`` (medians over the epochs of the eager runs and of the fuse runs), and writes a markdown table. Used by
``benchmarks/recipes.sh``; several runs per side are comma-separated::

    python benchmarks/speedup_check.py small=RUNS/fuse1/tb,RUNS/fuse2/tb:RUNS/eager1/tb,RUNS/eager2/tb large=...
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_fuse.report import load_runs  # noqa: E402

TOLERANCE = 0.05


def median(runs: list, metric: str) -> float:
    """Median of ``fuse/<metric>`` over every epoch of ``runs``."""
    values = [v for run in runs for _, v in run.series(metric)]
    if not values:
        raise SystemExit(f"no fuse/{metric} in {[run.name for run in runs]}")
    return statistics.median(values)


def check(label: str, fuse_dirs: str, eager_dirs: str) -> tuple[str, bool]:
    fuse, eager = load_runs(fuse_dirs.split(",")), load_runs(eager_dirs.split(","))
    logged = median(fuse, "speedup")
    separate = median(eager, "step_ms") / median(fuse, "step_ms")
    gap = abs(logged / separate - 1)
    ok = gap <= TOLERANCE
    row = (
        f"| {label} | {len(fuse)} + {len(eager)} | {median(fuse, 'step_ms'):.2f} | "
        f"{median(fuse, 'eager_step_ms'):.2f} | {median(eager, 'step_ms'):.2f} | {logged:.2f}x | {separate:.2f}x | "
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
