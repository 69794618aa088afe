"""How close does the step get to its kernels? The step time against the GPU's kernel time, per step.

For the recipe GPT at batch 8, the recipe ResNet-18 at 16 and four zoo models at their small batch, each of
``reduce_overhead`` and ``fuse`` (``FuseCallback(eager_steps=0)``: every step compiled) trains 200 steps with an
LR scheduler stepping every step and ``gradient_clip_val=1.0``; then, in the same fit, FuseCallback's own profile
window (:class:`models.ProfiledSteps`) records 5 more steps: ``floor_ms`` is the GPU's own time a step (its
kernels, copies and memsets, overlaps counted once), ``busy_frac`` = floor / step.
``lightning_loop`` is the same fit around :class:`Idle`, a network that costs nothing: its ``step_ms`` is what
Lightning's loop, the optimizer, the clipping and the scheduler take on this host alone, a step no plan can go
under inside Lightning. ``eager_fp32`` is eager in full precision (``32-true``): how far full precision lands from
eager's ``bf16-mixed``, the tolerance the checks hold ``fuse`` to. ``fuse_emulated_casts`` is ``fuse`` with inductor
rounding as eager does, ``fuse_eager_random`` ``fuse`` with eager's dropout masks (:data:`DERIVED`).
An eager fit from the same seed in the same process gives ``eager_final_loss`` (the last 10 steps' mean) and
``param_gap``: how far apart the two fits' final parameters are, over how far eager's moved from the shared start
(0: the same parameters; near 1: as far apart as training moves them). A single run's losses are a weak check: these
short fits memorise random batches, and eager alone ends 10% apart between processes on the GPU.
On the GPU:

    python benchmarks/whole_step.py --budget-s 540
    python benchmarks/whole_step.py --smoke --models gpt --variants fuse   # CPU: no kernels, floor null
    python benchmarks/whole_step.py --checks benchmarks/results/whole_step.jsonl   # the issue's checks
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

import harness
import lightning.pytorch as pl
import models
import torch
from torch import nn

from lightning_fuse import FuseCallback

FIELDS = ("model", "batch_size", "variant", "step_ms", "floor_ms", "busy_frac", "final_loss", "eager_final_loss",
          "param_gap", "ran", "error")  # fmt: skip
DERIVED = {"fuse_emulated_casts": ("fuse", models.EMULATED_CASTS), "fuse_eager_random": ("fuse", models.EAGER_RANDOM),
           "fuse_eager_random_casts": ("fuse", {"options": {**models.EAGER_RANDOM["options"],
                                                            **models.EMULATED_CASTS["options"]}})}  # fmt: skip
"""Variants of this benchmark's own, as ``multi_gpu.DERIVED``: (the variant they run, its FuseCallback arguments).
Do fuse's parameters land within full precision's gap of eager's once inductor rounds as eager does
(``fuse_emulated_casts``, :data:`models.EMULATED_CASTS`), once dropout draws eager's masks (``fuse_eager_random``,
:data:`models.EAGER_RANDOM`), or with both (``fuse_eager_random_casts``)?"""
VARIANTS = ("reduce_overhead", "fuse", "lightning_loop", "eager_fp32", *DERIVED)
PROFILED = 5
TARGETS = {"over_one_line": 0.75, "over_floor": 1.6, "busy": 0.60}
"""The issue's speed targets: ``fuse`` at most 0.75x ``reduce_overhead``'s step and 1.6x its own floor, and busy at
least 60% of its step."""


class Idle(nn.Module):
    """A network that costs nothing whatever the batch: one 16-by-1 linear layer on a constant input.

    Example::

        >>> Idle()({"any": "batch"}).shape
        torch.Size([])
    """

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 1)
        self.register_buffer("ones", torch.ones(1, 16))

    def forward(self, batch: Any) -> torch.Tensor:
        return self.linear(self.ones).square().mean()


def measure(spec: dict) -> dict:
    """An eager fit, then the variant's fit with the profiled steps after the timed ones (one process);
    ``lightning_loop``: the fit around :class:`Idle` alone."""
    trainer_kw = {"gradient_clip_val": 1.0, "steps": spec["steps"] + PROFILED, "warmup": spec["warmup"]}
    # a foreach AdamW: Lightning refuses to clip a fused optimizer's gradients under mixed precision
    build = partial(models.build, spec["model"], spec["batch_size"], spec["smoke"], spec["steps"] + PROFILED,
                    scheduler=True, fused=False)  # fmt: skip
    task, loader = build()
    if spec["variant"] == "lightning_loop":
        task.model, task.loss_fn = Idle(), lambda model, batch: model(batch)
        return profiled_fit(task, loader, [], spec["steps"], trainer_kw)
    start = cpu_copy(task.model.parameters())
    eager = harness.fit(task, loader, **trainer_kw)
    eager_end = cpu_copy(task.model.parameters())
    task, loader = build()
    started = time.perf_counter()
    if spec["variant"] == "eager_fp32":
        callbacks, trainer_kw = [], {**trainer_kw, "precision": "32-true"}
    else:
        variant, fuse_kw = DERIVED.get(spec["variant"], (spec["variant"], {}))
        callbacks = models.apply_variant(task, variant, spec["smoke"], spec["cache_dir"], eager_steps=0, **fuse_kw)
    result = profiled_fit(task, loader, callbacks, spec["steps"], {**trainer_kw, "started": started})
    fuse = next((callback for callback in callbacks if isinstance(callback, FuseCallback)), None)
    return {**result, "eager_final_loss": eager["final_loss"], "error": result["error"] or eager["error"],
            "param_gap": parameter_gap(start, eager_end, cpu_copy(task.model.parameters())),
            "ran": fuse.fit.what_ran() if fuse is not None else None}  # fmt: skip


def profiled_fit(task: pl.LightningModule, loader: Any, callbacks: list, steps: int, fit_kw: dict) -> dict:
    """``harness.fit`` with :data:`PROFILED` profiled steps after its ``steps`` timed ones: their median
    ``step_ms`` (the profiled steps are not timed), ``floor_ms`` (the profile's ``gpu_ms_per_step``) and
    ``busy_frac``."""
    window = models.ProfiledSteps(first=steps, steps=PROFILED)
    result = harness.fit(task, loader, callbacks=[window, *callbacks], **fit_kw)
    timed = result["epoch_ms"].get(0, [])[: steps - fit_kw["warmup"]]
    step_ms = statistics.median(timed) if timed else None
    floor_ms = window.result.get("gpu_ms_per_step")
    busy = floor_ms / step_ms if floor_ms and step_ms else None
    return {**result, "step_ms": step_ms, "floor_ms": floor_ms, "busy_frac": busy}


def cpu_copy(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().to("cpu", torch.float32, copy=True) for p in params]


def parameter_gap(start: list[torch.Tensor], eager: list[torch.Tensor], other: list[torch.Tensor]) -> float | None:
    """The distance between two fits' final parameters over the distance eager's moved from their shared start.

    Example::

        >>> start, eager = [torch.zeros(2)], [torch.tensor([3.0, 4.0])]
        >>> parameter_gap(start, eager, [torch.tensor([3.0, 4.5])])
        0.1
    """
    moved = sum(float((e - s).pow(2).sum()) for s, e in zip(start, eager, strict=True)) ** 0.5
    apart = sum(float((o - e).pow(2).sum()) for e, o in zip(eager, other, strict=True)) ** 0.5
    return apart / moved if moved else None


def checks(records: list[dict]) -> str:
    """The whole-step issue's checks, as Markdown, over each case's newest rows (``harness.newest_rows``): ``fuse``
    over ``reduce_overhead`` (at most 0.75), over its own kernel floor (at most 1.6), its busy share (at least 0.60;
    :data:`TARGETS`), each ratio only where both rows ran on one device; and whether its parameters and final loss
    lie as close to eager's as full precision's do (``param_gap`` at most ``eager_fp32``'s; the final loss's relative
    gap at most ``eager_fp32``'s or bf16's own ``rtol``, ``harness.BF16_RTOL``, as in ``multi_gpu.py``; ``-`` without
    an ``eager_fp32`` row). Where a ``fuse_eager_random`` row exists (dropout drawing eager's masks), both are judged
    again with its gaps in fuse's place (in brackets; elsewhere fuse's own stand, as they do without dropout).
    ``lightning_loop``'s step, where measured, is the floor Lightning's own loop sets.

    Example::

        >>> row = {"model": "m", "batch_size": 8, "device": "H100", "eager_final_loss": 1.0}
        >>> rows = [{**row, "variant": "fuse", "step_ms": 3.0, "floor_ms": 2.5, "busy_frac": 0.83, "param_gap": 0.1,
        ...          "final_loss": 1.015}, {**row, "variant": "reduce_overhead", "step_ms": 5.0},
        ...         {**row, "variant": "eager_fp32", "step_ms": 9.0, "param_gap": 0.2, "final_loss": 0.999}]
        >>> print(checks(rows).splitlines()[2])  # the loss within bf16's rtol, wider than full precision's gap here
        | m | 8 | 3.00 | 5.00 | 2.50 | - | 0.60 | 1.20 | 0.83 | 0.100 / 0.200 | 0.015 / 0.001 | H100 |
        >>> print(checks(rows).splitlines()[-1])  # doctest: +NORMALIZE_WHITESPACE
        1 cases, 0 crashed fits; fuse <= 0.75x reduce_overhead in 1 of 1; <= 1.6x its floor in 1 of 1;
        busy >= 0.60 in 1 of 1; parameters within full precision's gap in 1 of 1, final loss in 1 of 1; with eager's
        dropout masks (fuse_eager_random in fuse's place where measured), 1 of 1 and 1 of 1.
        >>> masks = {"variant": "fuse_eager_random", "step_ms": 3.1, "param_gap": 0.05, "final_loss": 1.001}
        >>> rows.append({**row, **masks})
        >>> print(checks(rows).splitlines()[2])  # doctest: +NORMALIZE_WHITESPACE
        | m | 8 | 3.00 | 5.00 | 2.50 | - | 0.60 | 1.20 | 0.83 | 0.100 [0.050] / 0.200 | 0.015 [0.001] / 0.001 | H100 |
    """
    cases, crashes = harness.measured_cases(harness.newest_rows(records), ("model", "batch_size"))
    judged = [_case_checks(case, variants) for case, variants in sorted(cases.items(), key=str) if "fuse" in variants]
    found = harness.judged_values(judged, ("over_one_line", "over_floor", "busy", "params", "loss", "params_masks",
                                           "loss_masks"))  # fmt: skip
    verdicts = (f"fuse <= {TARGETS['over_one_line']}x reduce_overhead in "
                f"{harness.passing(found['over_one_line'], TARGETS['over_one_line'])}; <= {TARGETS['over_floor']}x "
                f"its floor in {harness.passing(found['over_floor'], TARGETS['over_floor'])}; busy >= "
                f"{TARGETS['busy']:.2f} in {harness.passing([busy >= TARGETS['busy'] for busy in found['busy']])}; "
                f"parameters within full precision's gap in {harness.passing(found['params'])}, final loss in "
                f"{harness.passing(found['loss'])}; with eager's dropout masks (fuse_eager_random in fuse's place "
                f"where measured), {harness.passing(found['params_masks'])} and "
                f"{harness.passing(found['loss_masks'])}.")
    header = ("| model | batch | fuse ms | reduce_overhead ms | floor ms | Lightning's loop ms | over one line | "
              "over floor | busy | param_gap: fuse / full precision | final loss's gap: fuse / full precision | "
              "device |")
    separator = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"
    return harness.checks_report(header, separator, judged, crashes, verdicts)


def _case_checks(case: tuple, variants: dict[str, dict]) -> dict:
    """One case's checks (``None`` where a side is missing or ran on another device than ``fuse``), and its line."""
    fuse = variants["fuse"]
    same = {name: row for name, row in variants.items() if row.get("device") == fuse.get("device")}
    one_line, loop, fp32 = (same.get(name) for name in ("reduce_overhead", "lightning_loop", "eager_fp32"))
    over_one_line = fuse["step_ms"] / one_line["step_ms"] if one_line else None
    over_floor = fuse["step_ms"] / fuse["floor_ms"] if fuse.get("floor_ms") else None
    fp32, masks = fp32 or {}, same.get("fuse_eager_random") or fuse
    plain, masked = _within(fuse, fp32), _within(masks, fp32)
    shown = (fuse,) if masks is fuse else (fuse, masks)
    figure = harness.figure
    cells = [*case, *(figure(row and row["step_ms"]) for row in (fuse, one_line)), figure(fuse.get("floor_ms")),
             figure(loop and loop["step_ms"]), figure(over_one_line), figure(over_floor), figure(fuse.get("busy_frac")),
             _gaps_cell([row.get("param_gap") for row in shown], fp32.get("param_gap")),
             _gaps_cell([_loss_gap(row) for row in shown], _loss_gap(fp32)), fuse.get("device") or "-"]  # fmt: skip
    return {"over_one_line": over_one_line, "over_floor": over_floor, "busy": fuse.get("busy_frac"),
            "params": plain[0], "loss": plain[1], "params_masks": masked[0], "loss_masks": masked[1],
            "line": "| " + " | ".join(map(str, cells)) + " |"}  # fmt: skip


def _gaps_cell(gaps: list[float | None], fp32_gap: float | None) -> str:
    """A gap cell: fuse's, with eager's dropout masks' in brackets where measured, then full precision's."""
    own, *masked = (harness.figure(gap, 3) for gap in gaps)
    return f"{own}{''.join(f' [{gap}]' for gap in masked)} / {harness.figure(fp32_gap, 3)}"


def _within(row: dict, fp32: dict) -> tuple[bool | None, bool | None]:
    """Whether a fit's parameters and final loss lie as close to eager's as full precision's do (``None``: a side
    is missing)."""
    param_gaps, loss_gaps = (row.get("param_gap"), fp32.get("param_gap")), (_loss_gap(row), _loss_gap(fp32))
    params = param_gaps[0] <= param_gaps[1] if None not in param_gaps else None
    loss = loss_gaps[0] <= max(loss_gaps[1], harness.BF16_RTOL) if None not in loss_gaps else None
    return params, loss


def _loss_gap(row: dict) -> float | None:
    """How far a fit's final loss lies from its eager fit's, relative to eager's."""
    final, eager = row.get("final_loss"), row.get("eager_final_loss")
    return abs(final / eager - 1) if final is not None and eager else None


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "whole_step.jsonl", models="gpt,resnet18,gpt2,resnet50,mobilenet_v3_small,t5",
                       batches="small", variants=VARIANTS, steps=200, warmup=30)  # fmt: skip
    p.add_argument("--checks", type=Path, help="print the issue's checks over these records, and stop")
    args = p.parse_args(argv)
    if args.checks:
        print(checks(harness.read_records(args.checks)))
        return 0
    steps, warmup = (6, 2) if args.smoke else (args.steps, args.warmup)
    groups = [[{"model": model, "batch_size": batch, "variant": variant, "steps": steps, "warmup": warmup,
                "smoke": args.smoke} for variant in harness.split(args.variants, VARIANTS)]
              for model, batch in models.regimes(args)]
    return harness.run(args, "whole_step.py", measure, FIELDS, groups)


if __name__ == "__main__":
    sys.exit(main())
