"""A callback that writes every training step's time to a JSON file: how step times settle after a fit starts.

A diagnostic for the eager reference (FuseCallback times it over the first steps of the fit). Add it to a recipe::

    python recipes/train.py model=gpt trainer=gpu fuse=measure_only \
        +callbacks.steps._target_=benchmarks.step_log.StepLog +callbacks.steps.path=$OUT/steps.json

Each step is timed from its start to the next step's start with CUDA events (``perf_counter`` on CPU), read once
at fit end, like FuseCallback's own timer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning.pytorch as pl
import torch


class StepLog(pl.Callback):
    """Records a mark at each training step start; at fit end writes ``{"step_ms": [...]}`` to ``path``.

    Args:
        path: Where the JSON goes.

    Example::

        >>> log = StepLog("/tmp/steps.json")
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.marks: list[object] = []
        self.cuda = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.cuda = pl_module.device.type == "cuda"
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            ms = [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        else:
            ms = [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"step_ms": ms}))
