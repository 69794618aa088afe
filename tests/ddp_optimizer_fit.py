"""A 2-process CPU DDP fit (gloo) with the optimizer's update "captured" (faked) under FuseCallback's plan; each rank
writes what became of its optimizer graph to ``OUT/rank<N>.json``.

Run by tests/test_ddp.py as ``python tests/ddp_optimizer_fit.py OUT``. The ranks' trials are made to measure apart:
rank zero's replay 0.8x of the eager update's whole step (alone, it keeps the graph), rank 1's 1.0x (alone, it would
drop it), so the test can check that rank zero's word decides both. The same fit without FuseCallback follows, so
the test can check that the replayed updates train as eager DDP. Lightning's DDP launcher starts rank 1 by running
this same command again, so everything a rank needs comes from the command line.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from lightning.pytorch.callbacks import Callback

from lightning_fuse import FuseCallback
from tests.faults import FakeOptimizerCapture, FakeTimer
from tests.toy import RecordingTask, end_ranks, max_param_diff, param_sum, trainer


class FusedAdamWTask(RecordingTask):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)


class TrialTimesByRank(Callback):
    """Put after FuseCallback: once its optimizer graph is installed, times its trial as rank zero or rank 1."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        fuse = next(cb for cb in trainer.callbacks if isinstance(cb, FuseCallback))
        for graph in filter(None, fuse.fit.optimizer_graphs):
            if not isinstance(graph._timer, FakeTimer):
                graph._timer = FakeTimer(graph_ms=4.0 if trainer.global_rank == 0 else 5.0, eager_ms=5.0)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    task = FusedAdamWTask(samples=560, batch_size=4)  # 70 batches a rank
    fuse = FuseCallback(mode="default", backend="aot_eager", cuda_graph=False, cache_dir=False, eager_steps=0,
                        gpu_sample_hz=0)  # fmt: skip
    t = trainer([fuse, FakeOptimizerCapture(), TrialTimesByRank()], strategy="ddp", devices=2, max_epochs=1,
                limit_val_batches=0, num_sanity_val_steps=0)  # fmt: skip
    t.fit(task)
    torch.manual_seed(0)
    eager = FusedAdamWTask(samples=560, batch_size=4)
    trainer([], strategy="ddp", devices=2, max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0).fit(eager)
    (graph,) = fuse.fit.optimizer_graphs
    (out / f"rank{t.global_rank}.json").write_text(json.dumps({
        "steps": len(task.losses),
        "measured": graph.trial.measured,
        "decided": graph.trial.decided,
        "keep": graph.trial.keep,
        "ratio": graph.trial.ratio,
        "replays": graph.replays,
        "what_ran": fuse.fit.what_ran(),
        "param_sum": param_sum(task),
        "losses": task.losses,
        "eager_losses": eager.losses,
        "max_diff_from_eager": max_param_diff(task, eager),
    }))  # fmt: skip
    end_ranks()
