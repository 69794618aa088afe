"""The zoo: FuseCallback against the alternatives a Lightning user has, on the models of ``models.MODELS``, at a
small and a large batch.

Variants (``models.apply_variant``): ``eager``, ``compile`` (``torch.compile(net)``), ``reduce_overhead``
(``mode="reduce-overhead"``), ``regional`` (each repeated block ``.compile()``) and ``fuse`` (``FuseCallback()``),
inside the Lightning Trainer (``bf16-mixed`` on GPU, fused AdamW), random data on the device. Each compiling
variant runs twice, each time in a fresh process: cold (an empty compile cache: ``setup_s_cold``) and warm (the
same cache: ``setup_s_warm`` and everything else). Setup runs from the variant's own compile call to the first
timed step; ``compile_s_cold`` and ``compile_s_warm`` are the part of it FuseCallback counted as compiling (its
summary's "compile", the search's included; ``None`` for the one-liners), so that a warm setup splits into compiling
and the rest; ``train_start_s`` and ``batch_starts_s`` (the record's own fit, the warm one where there are two) say
when Lightning's training and each warmup batch started on the same clock (``harness.StepClock``), so that the rest
splits by step. ``step_ms`` is the median of the steps after ``--warmup`` (``step_ms_mean`` their mean: a median hides
steps that re-record CUDA graphs); for ``fuse`` it includes the callback's eager reference steps (at most 24 of
200), as a user's run would. On the GPU (about 1-2 minutes per variant):

    python benchmarks/zoo.py --models gpt2,resnet50 --batches small,large --budget-s 540
    python benchmarks/zoo.py --smoke --models gpt --variants eager,fuse   # CPU, the code path only

``--checks`` prints the issue's checks over a results file instead (:func:`checks`):

    python benchmarks/zoo.py --checks benchmarks/results/zoo.jsonl
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import harness
import models

from lightning_fuse.options import COMPILED_FROM_THE_START

FIELDS = ("model", "source", "batch_size", "variant", "step_ms", "step_ms_q1", "step_ms_q3", "step_ms_mean",
          "setup_s_cold", "setup_s_warm", "compile_s_cold", "compile_s_warm", "train_start_s", "batch_starts_s",
          "peak_gb", "plan", "ran", "search", "eager_step_ms_in_run", "error")  # fmt: skip
COMPILED_ONLY = "fuse_compiled_only"  # one of DERIVED: the checks name it where fuse crashed
DERIVED = {"fuse_eager_random": ("fuse", models.EAGER_RANDOM), COMPILED_ONLY: ("fuse", COMPILED_FROM_THE_START)}
"""Variants of the zoo's own, as ``multi_gpu.DERIVED``: (the variant they run, its FuseCallback arguments).
``fuse_eager_random`` (:data:`models.EAGER_RANDOM`): what drawing eager's dropout masks costs ``fuse``.
``fuse_compiled_only`` (:data:`~lightning_fuse.options.COMPILED_FROM_THE_START`): the settings FuseCallback's
warning names for a model that runs only compiled (HF SegFormer at 64 images of 512 px)."""
VARIANTS = (*models.VARIANTS, *DERIVED)
ONE_LINERS = ("compile", "reduce_overhead", "regional")
"""The variants a user gets with one line of ``torch.compile``: what ``fuse`` is held to."""
APART = "*"
"""Marks a ratio whose two rows come from different calls (their ``run_started`` differ): the machines drift by
5-20% between calls, so such a ratio is not side by side (HF Bloom's ``reduce_overhead`` cold setup read 33.9 s in
one H200 session and 38.2 s in the next)."""
MEAN_OFF = "‡"
"""Marks a best one-liner whose mean step (``step_ms_mean``) is slower than eager's median step: its median hides
steps that re-record CUDA graphs (HF Wav2Vec2 under ``reduce-overhead`` on an H200: median 23.4 ms, mean 141)."""


def measure(spec: dict) -> dict:
    """One fit of one variant (in a child process): its step time, setup time, peak memory and plan."""
    task, loader = models.build(spec["model"], spec["batch_size"], spec["smoke"], spec["steps"])
    started = time.perf_counter()  # the setup clock starts at the variant's own compile call
    variant, fuse_kw = DERIVED.get(spec["variant"], (spec["variant"], {}))
    callbacks = models.apply_variant(task, variant, spec["smoke"], spec["cache_dir"], **fuse_kw)
    result = harness.fit(task, loader, steps=spec["steps"], warmup=spec["warmup"], callbacks=callbacks,
                         started=started)  # fmt: skip
    info = models.fuse_info(callbacks)
    return {**result, **info, "eager_step_ms_in_run": models.logged_speedup(info["history"])["eager_step_ms_in_run"]}


def run_variant(runner: harness.Runner, spec: dict, env: dict) -> dict:
    """The cold process (compiling variants only, just past the warmup), then the warm one: one record. A compiling
    variant left out of ``--cold`` runs once, on the empty cache: its setup is the record's ``setup_s_cold``."""
    if spec["variant"] not in spec["cold"]:
        only = runner.launch("zoo.py", spec, env)
        which = "warm" if spec["variant"] == "eager" else "cold"
        return {**only, f"setup_s_{which}": only.get("setup_s"), f"compile_s_{which}": only.get("compile_s")}
    cold = runner.launch("zoo.py", {**spec, "steps": spec["warmup"] + 2}, env, kind="cold")
    if cold.get("error"):
        return cold
    warm = runner.launch("zoo.py", spec, env)
    return {**warm, "setup_s_cold": cold.get("setup_s"), "setup_s_warm": warm.get("setup_s"),
            "compile_s_cold": cold.get("compile_s"), "compile_s_warm": warm.get("compile_s")}


def checks(records: list[dict]) -> str:
    """The any-model issue's checks, as Markdown, over each model and batch's newest rows (``harness.newest_rows``):
    ``fuse`` over ``eager`` (at most 1.03), over the fastest one-liner measured (:data:`ONE_LINERS`; at most 1.05,
    and 0.85 as the geometric mean), its cold setup over ``reduce_overhead``'s (at most 1.5) and its warm setup
    over its cold one (at most 0.25; ``reduce_overhead``'s own in brackets), and the fits that crashed (an error
    that is not a skip, named). A ratio whose two sides were not both measured is left out. A best one-liner whose
    mean step is slower than eager's is marked :data:`MEAN_OFF` and named with its mean (the check still holds fuse
    to its median). A ratio whose two rows come from different calls is marked :data:`APART`.

    Example::

        >>> rows = [{"model": "m", "batch_size": 8, "variant": "eager", "step_ms": 30.0},
        ...         {"model": "m", "batch_size": 8, "variant": "reduce_overhead", "step_ms": 10.0,
        ...          "setup_s_cold": 40.0, "setup_s_warm": 10.0},
        ...         {"model": "m", "batch_size": 8, "variant": "fuse", "step_ms": 9.0, "setup_s_cold": 50.0,
        ...          "setup_s_warm": 10.0, "plan": "compile+graph"}]
        >>> print(checks(rows).splitlines()[2])
        | m | 8 | 30.00 | 10.00 (reduce_overhead) | 9.00 | compile+graph | 0.30 | 0.90 | 1.25 | 0.20 (0.25) |
        >>> print(checks(rows).splitlines()[-1])
        1 cases, 0 crashed fits; fuse <= 1.03x eager in 1 of 1; <= 1.05x the best one-liner in 1 of 1, geometric \
mean 0.90; cold setup <= 1.5x reduce-overhead's in 1 of 1; warm <= 0.25x cold in 1 of 1.
    """
    cases, crashes = harness.measured_cases(harness.newest_rows(records), ("model", "batch_size"))
    judged = [_case_checks(model, batch, variants) for (model, batch), variants in sorted(cases.items())]
    judged = [case for case in judged if case is not None]
    ratios = harness.judged_values(judged, ("over_eager", "over_best", "cold", "warm"))
    best = ratios["over_best"]
    verdicts = (f"fuse <= 1.03x eager in {harness.passing(ratios['over_eager'], 1.03)}; <= 1.05x the best one-liner "
                f"in {harness.passing(best, 1.05)}, geometric mean "
                f"{statistics.geometric_mean(best) if best else float('nan'):.2f}; cold setup <= 1.5x "
                f"reduce-overhead's in {harness.passing(ratios['cold'], 1.5)}; warm <= 0.25x cold in "
                f"{harness.passing(ratios['warm'], 0.25)}.")  # fmt: skip
    off = [case["mean_off"] for case in judged if case["mean_off"]]
    verdicts += f" {MEAN_OFF} The best one-liner's mean step is slower than eager's: {', '.join(off)}." if off else ""
    apart = sum(case["apart"] for case in judged)
    verdicts += f" {APART} {apart} ratios pair rows of different calls, not side by side." if apart else ""
    rescued = _compiled_only(cases, crashes)
    verdicts += f" Where fuse crashed, the settings its warning names ({COMPILED_ONLY}): {rescued}." if rescued else ""
    header = ("| model | batch | eager ms | best one-liner ms | fuse ms | plan | over eager | over best | cold over "
              "reduce-overhead's | warm over cold |")  # fmt: skip
    return harness.checks_report(header, "|---|---:|---:|---|---:|---|---:|---:|---:|---:|", judged, crashes, verdicts)


def _case_checks(model: str, batch: int, variants: dict[str, dict]) -> dict | None:
    """One model and batch's ratios (``None`` where a side is missing) and its table line; ``None`` without fuse."""
    fuse, eager, ro = variants.get("fuse"), variants.get("eager"), variants.get("reduce_overhead")
    if fuse is None:
        return None
    best = _best_one_liner(variants)

    def ratio(top: float | None, bottom: float | None) -> float | None:
        return top / bottom if top is not None and bottom else None

    ro_warm = ratio(ro.get("setup_s_warm"), ro.get("setup_s_cold")) if ro else None
    found = {"over_eager": ratio(fuse["step_ms"], eager and eager["step_ms"]),
             "over_best": ratio(fuse["step_ms"], best and best["step_ms"]),
             "cold": ratio(fuse.get("setup_s_cold"), ro and ro.get("setup_s_cold")),
             "warm": ratio(fuse.get("setup_s_warm"), fuse.get("setup_s_cold"))}  # fmt: skip
    sides = {"over_eager": eager, "over_best": best, "cold": ro}
    apart = {name: _apart(fuse, sides[name]) and found[name] is not None for name in sides}
    figure = harness.figure
    mean = best and best.get("step_ms_mean")
    mean_off = mean is not None and eager is not None and mean > eager["step_ms"]
    cells = [model, batch, figure(eager and eager["step_ms"]),
             f"{figure(best['step_ms'])}{MEAN_OFF if mean_off else ''} ({best['variant']})" if best else "-",
             figure(fuse["step_ms"]),
             fuse.get("plan") or "-", *(figure(found[name]) + (APART if apart[name] else "") for name in sides),
             figure(found["warm"]) + (f" ({ro_warm:.2f})" if ro_warm is not None else "")]  # fmt: skip
    off = f"{model} at {batch}, {best['variant']} {mean:.1f} ms against {eager['step_ms']:.1f}" if mean_off else None
    return {**found, "mean_off": off, "apart": sum(apart.values()), "line": "| " + " | ".join(map(str, cells)) + " |"}


def _best_one_liner(variants: dict[str, dict]) -> dict | None:
    """The row of the fastest one-liner measured (:data:`ONE_LINERS`), ``None`` without one."""
    liners = [variants[name] for name in ONE_LINERS if name in variants]
    return min(liners, key=lambda row: row["step_ms"]) if liners else None


def _compiled_only(cases: dict[tuple, dict[str, dict]], crashes: list[str]) -> str:
    """Each case whose ``fuse`` fit crashed and whose ``fuse_compiled_only`` fit ran: its step, over the fastest
    one-liner's (:data:`APART` where the two come from different calls), as one phrase (empty: none).

    Example::

        >>> cases = {("m", 64): {"fuse_compiled_only": {"variant": "fuse_compiled_only", "step_ms": 136.0},
        ...                      "reduce_overhead": {"variant": "reduce_overhead", "step_ms": 135.0}}}
        >>> _compiled_only(cases, ["m 64 eager", "m 64 fuse"])
        'm at 64 136.00 ms, 1.01x reduce_overhead'
    """
    found = []
    for (model, batch), variants in sorted(cases.items()):
        row = variants.get(COMPILED_ONLY)
        if row is None or f"{model} {batch} fuse" not in crashes:
            continue
        best = _best_one_liner(variants)
        versus = (f", {row['step_ms'] / best['step_ms']:.2f}x{APART if _apart(row, best) else ''} {best['variant']}"
                  if best else "")  # fmt: skip
        found.append(f"{model} at {batch} {harness.figure(row['step_ms'])} ms{versus}")
    return "; ".join(found)


def _apart(row: dict, other: dict | None) -> bool:
    """Whether two rows come from different calls (``run_started``; rows without one are taken as one call's)."""
    return other is not None and row.get("run_started", "") != other.get("run_started", "")


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "zoo.jsonl", models="all", batches="small,large", variants=VARIANTS,
                       steps=200, warmup=30)  # fmt: skip
    p.add_argument("--cold", default=",".join(models.VARIANTS[1:]),
                   help="variants also run cold (an empty compile cache) for setup_s_cold, a comma list")
    p.add_argument("--checks", type=Path, help="print the issue's checks over these records (checks), and stop")
    args = p.parse_args(argv)
    if args.checks is not None:
        print(checks(harness.read_records(args.checks)))
        return 0
    steps, warmup = (6, 4) if args.smoke else (args.steps, args.warmup)
    cold = harness.split(args.cold, VARIANTS)
    groups = [[{"model": model, "source": models.MODELS[model][0], "batch_size": batch, "variant": variant,
                "steps": steps, "warmup": warmup, "smoke": args.smoke, "cold": cold}
               for variant in harness.split(args.variants, VARIANTS)] for model, batch in models.regimes(args)]
    return harness.run(args, "zoo.py", measure, FIELDS, groups, run_variant)


if __name__ == "__main__":
    sys.exit(main())
