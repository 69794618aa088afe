"""The zoo: FuseCallback against the alternatives a Lightning user has, on 11 models, at a small and a large batch.

Variants (``models.apply_variant``): ``eager``, ``compile`` (``torch.compile(net)``), ``reduce_overhead``
(``mode="reduce-overhead"``), ``regional`` (each repeated block ``.compile()``) and ``fuse`` (``FuseCallback()``),
inside the Lightning Trainer (``bf16-mixed`` on GPU, fused AdamW), random data on the device. Each compiling
variant runs twice, each time in a fresh process: cold (an empty compile cache: ``setup_s_cold``) and warm (the
same cache: ``setup_s_warm`` and everything else). Setup runs from the variant's own compile call to the first
timed step. ``step_ms`` is the median of the steps after ``--warmup``; for ``fuse`` it includes the callback's
eager reference steps (at most 24 of 200), as a user's run would. On the GPU (about 1-2 minutes per variant):

    python benchmarks/zoo.py --models gpt2,resnet50 --batches small,large --budget-s 540
    python benchmarks/zoo.py --smoke --models gpt --variants eager,fuse   # CPU, the code path only
"""

from __future__ import annotations

import sys
import time

import harness
import models

FIELDS = ("model", "source", "batch_size", "variant", "step_ms", "step_ms_q1", "step_ms_q3", "setup_s_cold",
          "setup_s_warm", "peak_gb", "plan", "ran", "search", "eager_step_ms_in_run", "error")  # fmt: skip


def measure(spec: dict) -> dict:
    """One fit of one variant (in a child process): its step time, setup time, peak memory and plan."""
    task, loader = models.build(spec["model"], spec["batch_size"], spec["smoke"], spec["steps"])
    started = time.perf_counter()  # the setup clock starts at the variant's own compile call
    callbacks = models.apply_variant(task, spec["variant"], spec["smoke"], spec["cache_dir"])
    result = harness.fit(task, loader, steps=spec["steps"], warmup=spec["warmup"], callbacks=callbacks,
                         started=started)  # fmt: skip
    info = models.fuse_info(callbacks)
    in_run = [row["fuse/eager_step_ms"] for row in info["history"] if row.get("fuse/eager_step_ms") is not None]
    return {**result, **info, "eager_step_ms_in_run": in_run[-1] if in_run else None}


def run_variant(runner: harness.Runner, spec: dict, env: dict) -> dict:
    """The cold process (compiling variants only, just past the warmup), then the warm one: one record. A compiling
    variant left out of ``--cold`` runs once, on the empty cache: its setup is the record's ``setup_s_cold``."""
    if spec["variant"] not in spec["cold"]:
        only = runner.launch("zoo.py", spec, env)
        return {**only, "setup_s_cold" if spec["variant"] != "eager" else "setup_s_warm": only.get("setup_s")}
    cold = runner.launch("zoo.py", {**spec, "steps": spec["warmup"] + 2}, env, kind="cold")
    if cold.get("error"):
        return cold
    warm = runner.launch("zoo.py", spec, env)
    return {**warm, "setup_s_cold": cold.get("setup_s"), "setup_s_warm": warm.get("setup_s")}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "zoo.jsonl", models="all", batches="small,large", variants=models.VARIANTS,
                       steps=200, warmup=30)  # fmt: skip
    p.add_argument("--cold", default=",".join(models.VARIANTS[1:]),
                   help="variants also run cold (an empty compile cache) for setup_s_cold, a comma list")
    args = p.parse_args(argv)
    steps, warmup = (6, 4) if args.smoke else (args.steps, args.warmup)
    cold = harness.split(args.cold, models.VARIANTS)
    groups = [[{"model": model, "source": models.MODELS[model][0], "batch_size": batch, "variant": variant,
                "steps": steps, "warmup": warmup, "smoke": args.smoke, "cold": cold}
               for variant in harness.split(args.variants, models.VARIANTS)] for model, batch in models.regimes(args)]
    return harness.run(args, "zoo.py", measure, FIELDS, groups, run_variant)


if __name__ == "__main__":
    sys.exit(main())
