"""A 2-process CPU DDP fit (gloo) whose network replays through a :class:`GraphedModule`, then the same fit
eagerly; each rank writes what it saw to ``OUT/rank<N>.json``.

The capture is faked as ``make_graphed_callables`` replays (the capture DDP gets): one autograd node that hands
every parameter's gradient back from buffers of its own, which DDP's reducer must all-reduce as it does eager
gradients. Run by tests/test_ddp.py as ``python tests/ddp_graph_fit.py OUT``; Lightning's DDP launcher starts rank 1
by running this same command again.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl
import torch

from lightning_fuse.graphs import GraphedModule
from tests.faults import grad_buffer_capture
from tests.toy import RecordingTask, end_ranks, max_param_diff, param_sum, trainer


class FakedGraph(pl.Callback):
    """The network routed through a GraphedModule, its capture faked on CPU, from the fit's start to its end."""

    def __init__(self) -> None:
        self.graphed: GraphedModule | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.graphed = GraphedModule("model", pl_module.model, capture=grad_buffer_capture, on_device=lambda t: True)
        self.graphed.install()
        self.graphed.capture_allowed = True

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.graphed.uninstall()


def fit(callbacks: list[pl.Callback]) -> tuple[pl.Trainer, RecordingTask]:
    torch.manual_seed(0)
    task = RecordingTask()
    t = trainer(callbacks, strategy="ddp", devices=2, max_epochs=2, num_sanity_val_steps=0)
    t.fit(task)
    return t, task


if __name__ == "__main__":
    out = Path(sys.argv[1])
    faked = FakedGraph()
    t, graphed = fit([faked])
    _, eager = fit([])
    (out / f"rank{t.global_rank}.json").write_text(json.dumps({
        "replays": faked.graphed.replays,
        "losses": graphed.losses,
        "eager_losses": eager.losses,
        "param_sum": param_sum(graphed),
        "max_diff_from_eager": max_param_diff(graphed, eager),
    }))  # fmt: skip
    end_ranks()
