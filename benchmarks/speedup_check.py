"""Check the speedup FuseCallback logs against a separate eager-only run of the same recipe.

For each pair (a ``fuse=auto`` run, a ``fuse=measure_only`` run of the same model and batch), compares the
median over epochs of the logged ``fuse/speedup`` with ``eager-only step ms / fuse step ms``, and writes a
markdown table. Used by ``benchmarks/recipes.sh``::

    python benchmarks/speedup_check.py small=RUNS/small_fuse/tb:RUNS/small_eager/tb large=...
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_fuse.report import load_runs  # noqa: E402

TOLERANCE = 0.05


def median(run, metric: str) -> float | None:
    values = [v for _, v in run.series(metric)]
    return statistics.median(values) if values else None


def check(label: str, fuse_dir: str, eager_dir: str) -> tuple[str, bool]:
    (fuse,), (eager,) = load_runs([fuse_dir]), load_runs([eager_dir])
    logged = median(fuse, "speedup")
    separate = median(eager, "step_ms") / median(fuse, "step_ms")
    gap = abs(logged / separate - 1)
    ok = gap <= TOLERANCE
    row = (
        f"| {label} | {median(fuse, 'step_ms'):.2f} | {median(fuse, 'eager_step_ms'):.2f} | "
        f"{median(eager, 'step_ms'):.2f} | {logged:.2f}x | {separate:.2f}x | {gap:.1%} | "
        f"{'PASS' if ok else 'FAIL'} |"
    )
    return row, ok


def main(pairs: list[str]) -> int:
    print("| regime | fuse step ms | in-run eager ms | eager-only run step ms | logged speedup | "
          "separate-run speedup | gap | within 5% |")
    print("|---|---|---|---|---|---|---|---|")
    results = [check(label, *dirs.split(":")) for label, dirs in (pair.split("=", 1) for pair in pairs)]
    for row, _ in results:
        print(row)
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
