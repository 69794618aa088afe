"""A callback that writes every training step's time to a JSON file: how step times settle after a fit starts.

A diagnostic for the eager reference (session 3 timed it over the first steps of the fit; it now runs in chunks
in every epoch). Add it to a recipe::

    python recipes/train.py model=gpt trainer=gpu fuse=measure_only \
        +callbacks.steps._target_=benchmarks.step_log.StepLog +callbacks.steps.path=$OUT/steps.json

Each step is timed from its start to the next step's start with FuseCallback's own timer
(:class:`lightning_fuse.timing.StepTimer`), read once at fit end.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl

from lightning_fuse.timing import StepTimer

STEP = "step"


class StepLog(pl.Callback):
    """Marks each training step's start; at fit end writes ``{"step_ms": [...]}`` to ``path``.

    Args:
        path: Where the JSON goes.

    Example::

        >>> log = StepLog("/tmp/steps.json")
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.timer: StepTimer | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.timer = StepTimer(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.timer.start()
        self.timer.stop(STEP)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"step_ms": self.timer.collect().get(STEP, [])}))
