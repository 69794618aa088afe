"""Helpers for the reliability, resume, DDP, optimizer-graph, search and pattern tests: probes, a plan dropped on
cue, a real compile-cache artifact, TensorBoard reads, a network's and an optimizer's captures, a trial timer and a
failure of torch's cudagraph trees faked on CPU."""

from __future__ import annotations

import copy
import functools
import os
import shutil
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import lightning_fuse
from lightning_fuse import FuseCallback, compat
from lightning_fuse.graphs import GraphedModule
from lightning_fuse.optimizer_graph import OptimizerGraph
from lightning_fuse.optimizer_trial import EAGER, GRAPH
from tests.toy import RecordingTask, trainer

PACKAGE = Path(lightning_fuse.__file__).resolve().parent
BLOCKS = ["model.blocks.0", "model.blocks.1", "model.blocks.2"]


def raise_as_torchs_trees(message: str) -> None:
    """Raise from a function of torch's cudagraph trees' module, as a failed recording or replay of theirs does."""
    namespace = {"__name__": compat.cudagraph_trees_module()}
    exec("def record(message):\n    raise RuntimeError(message)\n", namespace)
    namespace["record"](message)


def raised_by_lightning_fuse(excinfo) -> bool:
    """Whether the exception was raised by our code (its innermost frame is in the package), not deep in torch."""
    return Path(str(excinfo.traceback[-1].path)).resolve().is_relative_to(PACKAGE)


class FuseProbe(Callback):
    """Put after a FuseCallback: records what it had compiled and compiled at each training batch and epoch end."""

    def __init__(self, fuse: FuseCallback) -> None:
        self.fuse = fuse
        self.compiled_per_step: list[list[str]] = []
        self.compiles_per_epoch: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.compiled_per_step.append(sorted(self.fuse.compiled_regions))

    def on_train_epoch_end(self, trainer, pl_module):
        self.compiles_per_epoch.append(self.fuse.tracker.total_compiles)


class DropAfterActivation(Callback):
    """Drops ``fuse``'s plan named ``plan`` at the end of the first batch it runs, as the running guard or an epoch's
    check would."""

    def __init__(self, fuse: FuseCallback, plan: str) -> None:
        self.fuse, self.plan = fuse, plan

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.fuse.plan is not None and self.fuse.plan.name == self.plan:
            self.fuse.fit.drop_plan("measured slower than eager")


def messages(record, text: str) -> list[str]:
    """The recorded warnings whose message contains ``text``."""
    return [str(w.message) for w in record if text in str(w.message)]


def artifacts_path(cache_root: Path, **fuse_kwargs) -> Path:
    """Where FuseCallback keeps the toy task's artifacts under ``cache_root``, found by a one-step fit."""
    fuse = FuseCallback(backend="aot_eager", cache_dir=cache_root, **fuse_kwargs)
    trainer([fuse], max_steps=1, limit_val_batches=0, num_sanity_val_steps=0).fit(RecordingTask())
    return fuse.cache.artifacts_path


@functools.cache
def valid_artifacts() -> bytes:
    """Real mega-cache bytes (``torch.compiler.save_cache_artifacts``) from one tiny inductor compile (~5 s, once)."""
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    scratch = tempfile.mkdtemp(prefix="lightning_fuse_tests_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = scratch  # an empty cache: the compile is cold and saves artifacts
    try:
        torch.compile(lambda x: (x * 3).cos() + 1)(torch.randn(4))
        result = torch.compiler.save_cache_artifacts()
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
        torch._dynamo.reset()
        shutil.rmtree(scratch, ignore_errors=True)
    assert result is not None, "inductor saved no cache artifacts"
    return result[0]


def scalar_steps(logdir: Path, tag: str) -> list[int]:
    """The steps at which ``tag`` was written to the TensorBoard event files under ``logdir`` (all of them)."""
    steps = []
    for events_file in sorted(logdir.rglob("events.out.tfevents.*")):
        events = EventAccumulator(str(events_file), size_guidance={"scalars": 0})
        events.Reload()
        if tag in events.Tags()["scalars"]:
            steps += [event.step for event in events.Scalars(tag)]
    return steps


def fake_capture(update):
    """An optimizer capture on CPU: the "replay" runs the update again, reading the graph's inputs."""
    return update


def default_adamw_under_graph() -> tuple[torch.nn.Module, torch.optim.Optimizer, OptimizerGraph,
                                          torch.nn.Module, torch.optim.Optimizer]:  # fmt: skip
    """A ``Linear(2, 3)`` whose ``AdamW`` leaves its implementation to torch, under an installed OptimizerGraph
    (capture faked), and its twin from the same start with a plain ``AdamW``: ``net, optimizer, graph, twin,
    twin_optimizer``."""
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 3)
    twin = copy.deepcopy(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=0.05, weight_decay=0.1)
    graph = OptimizerGraph(optimizer, capture=fake_capture)
    graph.install()
    return net, optimizer, graph, twin, twin_optimizer


class FakeOptimizerCapture(Callback):
    """Lets FuseCallback capture optimizer updates on CPU (faked), as it does on CUDA."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fuse = next(cb for cb in trainer.callbacks if isinstance(cb, FuseCallback))
        fuse.fit.capture_optimizer = fake_capture


class FakeTimer:
    """Whole steps of ``graph_ms`` after a replayed update and ``eager_ms`` after an eager one."""

    def __init__(self, graph_ms: float, eager_ms: float) -> None:
        self.times = {GRAPH: graph_ms, EAGER: eager_ms}
        self.kinds: list[str] = []
        self.waits = 0  # wait_for_device calls

    def start(self) -> None:
        pass

    def wait_for_device(self) -> None:
        self.waits += 1

    def stop(self, kind: str) -> None:
        self.kinds.append(kind)

    def collect(self) -> dict[str, list[float]]:
        out = {kind: [self.times[kind]] * self.kinds.count(kind) for kind in self.times}
        self.kinds = []
        return out


def grad_buffer_capture(flat, tensors, num_warmup_iters):
    """As make_graphed_callables replays a backward: the parameters' gradients are written into the graph's own
    buffers and handed to autograd detached, so that a parameter without a gradient keeps the buffer itself. The
    forward scribbles over those buffers, as a forward's temporaries do where the two graphs' shared pool put a
    gradient buffer in their memory (seen on an H100). The inputs' gradients are handed back too, as a graph over
    a region inside the network (``regions+graphs``) hands them to the layers before it."""
    params = [p for p in flat.parameters() if p.requires_grad]
    buffers = [torch.zeros_like(p) for p in params]

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            ctx.inputs = inputs[: len(tensors)]
            for buffer in buffers:
                buffer.fill_(1e6)  # the forward's temporaries
            return tuple(out.detach() for out in flat(*ctx.inputs))

        @staticmethod
        def backward(ctx, *grad_outputs):
            inputs = [i.detach().requires_grad_(needs) for i, needs in zip(ctx.inputs, ctx.needs_input_grad)]
            wrt = [i for i in inputs if i.requires_grad]  # a region's input, the output of the layers before it
            with torch.enable_grad():
                outs = flat(*inputs)
                pairs = [(out, grad) for out, grad in zip(outs, grad_outputs) if out.requires_grad]
                grads = torch.autograd.grad([o for o, _ in pairs], wrt + params, [g for _, g in pairs],
                                            allow_unused=True)  # fmt: skip
            for buffer, grad in zip(buffers, grads[len(wrt):]):
                buffer.copy_(grad)
            input_grads = iter(grads[: len(wrt)])
            return tuple(next(input_grads) if i.requires_grad else None for i in inputs) + tuple(
                buffer.detach() for buffer in buffers
            )

    return lambda *inputs: Replay.apply(*inputs, *params)


def graphed_with_twin(net: torch.nn.Module, capture) -> tuple[torch.nn.Module, GraphedModule]:
    """``net`` routed through an installed GraphedModule whose capture is ``capture`` (faked on CPU), free to
    capture at its next call, and an eager twin from the same start: ``twin, graphed``."""
    twin = copy.deepcopy(net)
    graphed = GraphedModule("net", net, capture=capture, on_device=lambda t: True)
    graphed.install()
    graphed.capture_allowed = True
    return twin, graphed
