"""Checkpoints written during a FuseCallback fit, and resuming from them: plain weights, same curve, own state."""

from __future__ import annotations

import statistics

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fuse import FuseCallback
from tests.faults import BLOCKS, FuseProbe
from tests.toy import RecordingTask, trainer

LR = 0.3  # large enough that 10 steps take the toy's loss from ~1.6 to well under 1


def fused(**kwargs) -> FuseCallback:
    return FuseCallback(**{"backend": "aot_eager", "mode": "default", "cache_dir": False, "eager_steps": 2, **kwargs})


def run(epochs: int, callbacks=(), seed: int = 0, ckpt_path=None, **kwargs) -> tuple[RecordingTask, list]:
    """Fit a fresh task (weights from ``seed``) for ``epochs`` epochs in total; returns the task and callbacks."""
    torch.manual_seed(seed)
    task = RecordingTask(lr=LR)
    callbacks = list(callbacks)
    saves = any(isinstance(c, ModelCheckpoint) for c in callbacks)  # never Lightning's default one, into the cwd
    trainer(callbacks, max_epochs=epochs, enable_checkpointing=saves, **kwargs).fit(task, ckpt_path=ckpt_path)
    return task, callbacks


def test_a_checkpoint_written_mid_fit_loads_strict_into_a_plain_model(tmp_path):
    saving = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    fuse = fused()
    probe = FuseProbe(fuse)
    task, _ = run(2, [fuse, probe, saving])
    assert probe.compiled_per_step[-1] == BLOCKS  # the checkpoints were written while the blocks ran compiled
    paths = sorted(tmp_path.glob("*.ckpt"))
    assert [p.name for p in paths] == ["epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt"]
    for path in paths:
        state = torch.load(path, weights_only=False)["state_dict"]
        assert not [key for key in state if "_orig_mod" in key or "_compiled" in key]
        plain = RecordingTask()
        assert list(state) == list(plain.state_dict())
        plain.load_state_dict(state, strict=True)
    # the last checkpoint holds the trained weights: the plain model computes what the fused one does
    x, _ = next(iter(task.train_dataloader()))
    torch.testing.assert_close(plain.model(x), task.model(x))
    reloaded = RecordingTask.load_from_checkpoint(paths[-1], strict=True)
    torch.testing.assert_close(reloaded.model(x), task.model(x))


def test_resuming_compiles_again_restores_the_history_and_continues_the_loss_curve(tmp_path):
    straight, _ = run(4, [fused()])  # the curve to continue: 4 epochs without a break

    saving = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    first_fuse = fused()
    first, _ = run(2, [first_fuse, saving])
    checkpoint = tmp_path / "epoch=1-step=10.ckpt"
    saved = torch.load(checkpoint, weights_only=False)["callbacks"][first_fuse.state_key]
    assert [row["epoch"] for row in saved["history"]] == [0.0, 1.0]
    assert saved["plan"] == first_fuse.plan.describe()

    torch._dynamo.reset()  # as in a new process: nothing compiled yet
    fuse = fused()
    probe = FuseProbe(fuse)
    resumed, _ = run(4, [fuse, probe], seed=123, ckpt_path=checkpoint)  # other initial weights: all must come back

    # compiled again, from scratch
    assert probe.compiled_per_step[-1] == BLOCKS
    assert fuse.tracker.stats("model.blocks.0").compiles >= 1
    # the callback's own state: the first run's rows, then the new epochs
    assert [row["epoch"] for row in fuse.history] == [0.0, 1.0, 2.0, 3.0]
    assert fuse.history[:2] == first_fuse.history
    assert fuse.resumed_plan == first_fuse.plan.describe()
    # the loss curve goes on where it stopped: the same steps as the run without a break
    assert len(first.losses) == len(resumed.losses) == 10
    torch.testing.assert_close(first.losses, straight.losses[:10], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(resumed.losses, straight.losses[10:], rtol=1e-5, atol=1e-6)
    assert statistics.mean(resumed.losses[:5]) < statistics.mean(first.losses[:5]) - 0.3, "not back at the start"


def test_resuming_under_another_plan_warns_that_the_measurements_do_not_compare(tmp_path):
    saving = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    first_fuse = fused()
    run(1, [first_fuse, saving], limit_val_batches=0)
    checkpoint = tmp_path / "epoch=0-step=5.ckpt"
    content = torch.load(checkpoint, weights_only=False)
    other = "regions: torch.compile(mode=max-autotune); CUDA graph: off (mode=max-autotune uses torch's CUDA graphs)"
    content["callbacks"][first_fuse.state_key]["plan"] = other  # as if trained on a GPU with another mode
    torch.save(content, checkpoint)

    fuse = fused()
    with pytest.warns(UserWarning, match="checkpoint") as record:
        run(2, [fuse], ckpt_path=checkpoint, limit_val_batches=0)
    warned = [str(w.message) for w in record if other in str(w.message)]
    assert len(warned) == 1 and fuse.plan.describe() in warned[0], warned
    assert [row["epoch"] for row in fuse.history] == [0.0, 1.0]
