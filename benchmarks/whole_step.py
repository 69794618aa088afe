"""How close does the step get to its kernels? The step time against the GPU's kernel time, per step.

For the recipe GPT at batch 8, the recipe ResNet-18 at 16 and four zoo models at their small batch, each of
``reduce_overhead`` and ``fuse`` (``FuseCallback(eager_steps=0)``: every step compiled) trains 200 steps with an
LR scheduler stepping every step and ``gradient_clip_val=1.0``; then, in the same fit, ``torch.profiler`` records
5 more steps: ``floor_ms`` is the sum of the CUDA kernels' durations per step, ``busy_frac`` = floor / step.
``lightning_loop`` is the same fit around :class:`Idle`, a network that costs nothing: its ``step_ms`` is what
Lightning's loop, the optimizer, the clipping and the scheduler take on this host alone, a step no plan can go
under inside Lightning.
An eager fit from the same seed in the same process gives ``eager_final_loss`` (the last 10 steps' mean) and
``param_gap``: how far apart the two fits' final parameters are, over how far eager's moved from the shared start
(0: the same parameters; near 1: as far apart as training moves them). A single run's losses are a weak check: these
short fits memorise random batches, and eager alone ends 10% apart between processes on the GPU. Each
child's log (``--logs``) holds the profiled steps' 20 operations that took the most host time, and the 20 that took
the most kernel time.
On the GPU:

    python benchmarks/whole_step.py --budget-s 540
    python benchmarks/whole_step.py --smoke --models gpt --variants fuse   # CPU: no kernels, floor null
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Iterable
from functools import partial
from typing import Any

import harness
import lightning.pytorch as pl
import models
import torch
from torch import nn

from lightning_fuse import FuseCallback
from lightning_fuse.profiling import device_work

FIELDS = ("model", "batch_size", "variant", "step_ms", "floor_ms", "busy_frac", "final_loss", "eager_final_loss",
          "param_gap", "ran", "error")  # fmt: skip
VARIANTS = ("reduce_overhead", "fuse", "lightning_loop")
PROFILED = 5


class KernelWindow(pl.Callback):
    """Profiles batches ``[start, start + count)``; ``floor_ms`` is their CUDA kernels' time per step."""

    def __init__(self, start: int, count: int) -> None:
        self.start, self.count, self.batches = start, count, 0
        self.profiler: torch.profiler.profile | None = None
        self.floor_ms: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self.batches == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # no earlier step's kernels in the window
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        self.batches += 1

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:  # fmt: skip
        if self.batches == self.start + self.count:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            kernels = device_work(self.profiler.events())
            us = sum(e.time_range.end - e.time_range.start for e in kernels)
            self.floor_ms = us / 1e3 / self.count if kernels else None
            # for the child's log (--logs): where the host time goes (what keeps the GPU idle), and the kernel time
            averages = self.profiler.key_averages()
            print(averages.table(sort_by="self_cpu_time_total", row_limit=20))
            print(averages.table(sort_by="self_device_time_total", row_limit=20))


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
    callbacks = models.apply_variant(task, spec["variant"], spec["smoke"], spec["cache_dir"], eager_steps=0)
    result = profiled_fit(task, loader, callbacks, spec["steps"], {**trainer_kw, "started": started})
    fuse = next((callback for callback in callbacks if isinstance(callback, FuseCallback)), None)
    return {**result, "eager_final_loss": eager["final_loss"], "error": result["error"] or eager["error"],
            "param_gap": parameter_gap(start, eager_end, cpu_copy(task.model.parameters())),
            "ran": fuse.fit.what_ran() if fuse is not None else None}  # fmt: skip


def profiled_fit(task: pl.LightningModule, loader: Any, callbacks: list, steps: int, fit_kw: dict) -> dict:
    """``harness.fit`` with :class:`KernelWindow` after its ``steps`` timed steps: their median ``step_ms`` (the
    profiled steps are not timed), ``floor_ms`` and ``busy_frac``."""
    window = KernelWindow(steps, PROFILED)
    result = harness.fit(task, loader, callbacks=[window, *callbacks], **fit_kw)
    timed = result["epoch_ms"].get(0, [])[: steps - fit_kw["warmup"]]
    step_ms = statistics.median(timed) if timed else None
    busy = window.floor_ms / step_ms if window.floor_ms and step_ms else None
    return {**result, "step_ms": step_ms, "floor_ms": window.floor_ms, "busy_frac": busy}


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


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "whole_step.jsonl", models="gpt,resnet18,gpt2,resnet50,mobilenet_v3_small,t5",
                       batches="small", variants=VARIANTS, steps=200, warmup=30)  # fmt: skip
    args = p.parse_args(argv)
    steps, warmup = (6, 2) if args.smoke else (args.steps, args.warmup)
    groups = [[{"model": model, "batch_size": batch, "variant": variant, "steps": steps, "warmup": warmup,
                "smoke": args.smoke} for variant in harness.split(args.variants, VARIANTS)]
              for model, batch in models.regimes(args)]
    return harness.run(args, "whole_step.py", measure, FIELDS, groups)


if __name__ == "__main__":
    sys.exit(main())
