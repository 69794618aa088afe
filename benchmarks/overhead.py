"""FuseCallback's own cost per training step: the host time inside its per-step hooks.

The callback's per-step hooks are wrapped with ``time.perf_counter`` during a fit of an eager model (``targets=[]``,
no CUDA graph: nothing compiles, so only the hooks' own work is measured); with and without the NVML sampler
thread, each in its own process. ``mean_us`` divided by a step time is the callback's overhead on that step; the
hooks queue CUDA events and never synchronise, so their host time is their whole cost. On the GPU:

    python benchmarks/overhead.py --steps 600
    python benchmarks/overhead.py --smoke   # CPU, 40 steps
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import harness
import models

from lightning_fuse import FuseCallback

FIELDS = ("variant", "steps", "mean_us", "median_us", "p99_us", "error")
HOOKS = ("on_train_batch_start", "on_train_batch_end")
VARIANTS = ("nvml", "no_nvml")
SETTLE = 10
"""The first steps set up state (events, the schedule); they are left out."""


def measure(spec: dict) -> dict:
    fuse = FuseCallback(targets=[], cuda_graph=False, cache_dir=False,
                        gpu_sample_hz=10.0 if spec["variant"] == "nvml" else 0)  # fmt: skip
    spent: dict[str, list[float]] = {hook: [] for hook in HOOKS}
    for hook in HOOKS:
        original = getattr(fuse, hook)

        def timed(*args: Any, _original: Any = original, _hook: str = hook, **kwargs: Any) -> None:
            start = time.perf_counter()
            _original(*args, **kwargs)
            spent[_hook].append(time.perf_counter() - start)

        setattr(fuse, hook, timed)
    task, loader = models.build("gpt", 8, True, spec["steps"])  # a tiny GPT: the hooks' work does not depend on it
    result = harness.fit(task, loader, steps=spec["steps"], warmup=0, callbacks=[fuse])
    per_step = [1e6 * (a + b) for a, b in zip(*spent.values())][SETTLE:]
    if not per_step:
        return {"error": result["error"] or "no step was timed"}
    return {"steps": len(per_step), "mean_us": statistics.mean(per_step), "median_us": statistics.median(per_step),
            "p99_us": sorted(per_step)[int(0.99 * len(per_step))], "error": result["error"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = harness.parser(__doc__, "overhead.jsonl", variants=VARIANTS, steps=600).parse_args(argv)
    group = [{"variant": variant, "steps": 40 if args.smoke else args.steps}
             for variant in harness.split(args.variants, VARIANTS)]  # fmt: skip
    return harness.run(args, "overhead.py", measure, FIELDS, [group])


if __name__ == "__main__":
    sys.exit(main())
