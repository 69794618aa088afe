"""The optimizer's captured update (lightning_fuse/optimizer_graph.py), on CPU with the capture faked.

The fake capture returns the update itself, so each "replay" runs it again as the graph would: reading the graph's
learning-rate tensors and gradient buffers (swapped in around it), not the groups' floats or the ``.grad`` of the
moment. A learning rate not refilled, or a gradient not copied in, trains wrong here as it would on the GPU.
Fused AdamW and fused SGD run on CPU; foreach Adam with ``capturable=True`` needs a CUDA device.
"""

from __future__ import annotations

import copy
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback

from lightning_fuse import FuseCallback
from lightning_fuse.clipping import ClippingInUpdate
from lightning_fuse.optimizer_graph import OptimizerGraph, _fused_in_graph, settle_together
from lightning_fuse.optimizer_trial import BLOCK_STEPS, TRIAL_BLOCKS, Trial
from tests.faults import FakeOptimizerCapture, FakeTimer, default_adamw_under_graph, fake_capture
from tests.toy import ToyTask, trainer

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.1, fused=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True),
}


class ScheduledTask(ToyTask):
    """ToyTask with a fused optimizer and a warmup-then-decay ``LambdaLR`` stepping every step."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer = optimizer

    def configure_optimizers(self):
        optimizer = OPTIMIZERS[self.optimizer](self.parameters())
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 3) * 0.9**i)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class InstallGraph(Callback):
    """Installs a faked OptimizerGraph on the fit's optimizer when training starts (``clipping``: taking Lightning's
    gradient clipping into its update)."""

    def __init__(self, clipping: bool = False) -> None:
        self.graph: OptimizerGraph | None = None
        self.clipping = clipping

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        clipping = ClippingInUpdate(trainer.precision_plugin) if self.clipping else None
        self.graph = OptimizerGraph(trainer.optimizers[0], capture=fake_capture, clipping=clipping)
        self.graph.install()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.graph.uninstall()


def fit(task: pl.LightningModule, callbacks=(), **kwargs) -> pl.LightningModule:
    trainer(callbacks, max_epochs=3, limit_val_batches=0, **kwargs).fit(task)
    return task


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_the_replayed_update_trains_as_the_optimizers_own(optimizer, accumulate):
    """A scheduler stepping every step, gradient clipping and accumulation: the same parameters as without."""
    torch.manual_seed(0)
    task = ScheduledTask(optimizer)
    twin = copy.deepcopy(task)
    install = InstallGraph()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*|.*optimizer.step.*overridden.*")
        fit(task, [install], gradient_clip_val=0.1, accumulate_grad_batches=accumulate)
    fit(twin, gradient_clip_val=0.1, accumulate_grad_batches=accumulate)
    assert install.graph.replays >= 4
    for got, want in zip(task.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class LargestGradient(Callback):
    """The largest gradient entry the update left, at every step."""

    def __init__(self) -> None:
        self.largest: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        self.largest.append(max(float(p.grad.abs().max()) for p in pl_module.parameters() if p.grad is not None))


class SwitchingClip(ScheduledTask):
    """Clips by norm at 0.1 for its first 6 steps, then at 0.05 (its own ``configure_gradient_clipping``)."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, 0.1 if self.global_step < 6 else 0.05, "norm")


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_lightnings_clipping_runs_inside_the_replayed_update_and_trains_the_same(algorithm):
    """The replay clips its own gradient buffers: the parameters are those of a fit clipping in place, while the
    ``.grad`` a replayed update leaves is unclipped (an entry above the clip), and an eager one's clipped (the
    trial's eager blocks). Lightning clips through its precision plugin's ``clip_gradients``, which the graph takes
    while installed and gives back."""
    torch.manual_seed(0)
    task = ScheduledTask("adamw")
    twin = copy.deepcopy(task)
    install, largest = InstallGraph(clipping=True), LargestGradient()
    fit(task, [install, largest], gradient_clip_val=0.01, gradient_clip_algorithm=algorithm)
    fit(twin, gradient_clip_val=0.01, gradient_clip_algorithm=algorithm)
    assert install.graph.replays >= 4
    unclipped = sum(entry > 0.0101 for entry in largest.largest)
    assert unclipped == install.graph.replays, "each replayed step, and only those, clipped inside the update"
    assert "clip_gradients" not in vars(task.trainer.precision_plugin)  # uninstalled: the plugin's own method
    for got, want in zip(task.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_step_clipping_otherwise_than_the_capture_runs_the_optimizers_own_update_clipped():
    torch.manual_seed(0)
    task = SwitchingClip("sgd")
    twin = copy.deepcopy(task)
    install = InstallGraph(clipping=True)
    fit(task, [install])
    fit(twin)
    steps = task.trainer.global_step
    assert 2 <= install.graph.replays <= 5 < steps, "replays until the clipping changed at step 6, then none"
    for got, want in zip(task.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def linear_with_graph(lr: float = 1.0) -> tuple[torch.nn.Linear, torch.optim.Optimizer, OptimizerGraph]:
    net = torch.nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, fused=True)
    graph = OptimizerGraph(optimizer, capture=fake_capture)
    graph.install()
    return net, optimizer, graph


def step(net: torch.nn.Linear, optimizer: torch.optim.Optimizer, x: float = 1.0) -> torch.Tensor:
    before = net.weight.detach().clone()
    optimizer.zero_grad()
    net(torch.full((1, 2), x)).sum().backward()
    optimizer.step()
    return net.weight.detach() - before


def test_a_learning_rate_set_after_the_capture_reaches_the_replay():
    net, optimizer, graph = linear_with_graph()
    for _ in range(2):  # the first runs eagerly, the second captures
        step(net, optimizer)
    optimizer.param_groups[0]["lr"] = 0.0
    assert torch.equal(step(net, optimizer), torch.zeros(1, 2))
    optimizer.param_groups[0]["lr"] = 0.5
    torch.testing.assert_close(step(net, optimizer, x=2.0), torch.full((1, 2), -1.0))  # this step's grad, this lr
    assert graph.replays == 3 and isinstance(optimizer.param_groups[0]["lr"], float)


def test_a_step_with_another_set_of_gradients_runs_the_optimizers_own_update():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, fused=True)
    graph = OptimizerGraph(optimizer, capture=fake_capture)
    graph.install()
    for frozen in (False, False, True):
        net[0].requires_grad_(not frozen)
        optimizer.zero_grad()
        net(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    assert graph.replays == 1 and graph.disabled_reason is None  # the frozen step ran eagerly, the graph stays


def test_a_changed_hyperparameter_ends_the_graph_and_says_so(caplog):
    net, optimizer, graph = linear_with_graph()
    twin = copy.deepcopy(net)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=1.0, fused=True)
    for i in range(4):
        if i == 2:
            for opt in (optimizer, twin_optimizer):
                opt.param_groups[0]["weight_decay"] = 0.5
        step(net, optimizer)
        step(twin, twin_optimizer)
    assert graph.replays == 1 and "a hyperparameter other than the learning rate changed" in graph.disabled_reason
    torch.testing.assert_close(net.weight, twin.weight)


def test_an_eager_reference_step_runs_the_optimizers_own_update():
    net, optimizer, graph = linear_with_graph()
    for enabled in (True, True, False, True):
        graph.enabled = enabled
        step(net, optimizer)
    assert graph.replays == 2


def test_uninstalling_leaves_the_optimizer_as_it_was():
    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(net.parameters(), fused=True)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    scheduler_step = optimizer.step
    graph = OptimizerGraph(optimizer, capture=fake_capture)
    graph.install()
    for _ in range(3):
        step(net, optimizer)
        schedule.step()
    assert optimizer.param_groups[0]["capturable"] is True
    graph.uninstall()
    assert optimizer.step is scheduler_step and optimizer.param_groups[0]["capturable"] is False
    assert graph.describe().startswith("optimizer step: 2 replays, in its trial")
    bare = torch.optim.SGD(net.parameters(), lr=0.1)
    graph = OptimizerGraph(bare)
    graph.install()
    graph.uninstall()
    assert "step" not in vars(bare)  # without a scheduler, the class's step again


def test_a_scheduler_made_after_the_install_wraps_the_replaced_step_and_the_graph_still_replays():
    """Lightning's StochasticWeightAveraging makes an SWALR at its first averaging epoch, mid-fit; torch's
    schedulers wrap the optimizer's ``step`` through its ``__func__``, which a plain function lacks: the fit
    crashed (on an H200, under FuseCallback's plan, at the SWA epoch)."""
    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(net.parameters(), fused=True)
    graph = OptimizerGraph(optimizer, capture=fake_capture)
    graph.install()
    step(net, optimizer)
    schedule = torch.optim.swa_utils.SWALR(optimizer, swa_lr=0.01, anneal_epochs=1)  # raised AttributeError
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*")  # torch's "before optimizer.step()"
        for _ in range(3):
            step(net, optimizer)
            schedule.step()
    assert graph.replays == 3 and graph.disabled_reason is None, "SWALR's own keys in the group change no setting"
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)


def test_the_graph_updates_with_torchs_fused_kernel_where_the_user_left_the_choice_to_torch(monkeypatch):
    """An AdamW whose implementation the user left to torch: the warm-up and the replays run torch's fused kernel
    (one launch per chunk of tensors), training as the optimizer's own update; the group keeps the user's choice."""
    fused_calls = []
    fused_adamw = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: fused_calls.append(1) or fused_adamw(*a, **k))
    net, optimizer, graph, twin, twin_optimizer = default_adamw_under_graph()
    for i in range(BLOCK_STEPS):  # the warm-up, then the capture and the replays of the trial's first block
        step(net, optimizer, x=1.0 + i)
    assert graph.replays == BLOCK_STEPS - 1 and "(torch's fused kernel)" in graph.describe()
    assert len(fused_calls) == BLOCK_STEPS  # the warm-up and the replays
    assert optimizer.param_groups[0]["fused"] is None and optimizer.param_groups[0]["foreach"] is None
    for i in range(BLOCK_STEPS):
        step(twin, twin_optimizer, x=1.0 + i)
    assert len(fused_calls) == BLOCK_STEPS  # torch's own choice on the CPU: not fused
    for got, want in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("make", "fused_in_graph"),
    [
        (lambda p: torch.optim.AdamW(p), True),
        (lambda p: torch.optim.Adam(p, amsgrad=True), True),
        (lambda p: torch.optim.AdamW(p, foreach=True), False),
        (lambda p: torch.optim.AdamW(p, fused=False), False),
        (lambda p: torch.optim.AdamW(p, fused=True), False),  # fused already: nothing to switch
        (lambda p: torch.optim.SGD(p, lr=0.1, fused=True), False),
    ],
)
def test_only_an_adam_whose_implementation_the_user_left_to_torch_is_switched(make, fused_in_graph):
    optimizer = make(torch.nn.Linear(2, 1).parameters())
    assert _fused_in_graph(optimizer, optimizer.param_groups[0]) is fused_in_graph


@pytest.mark.parametrize(
    ("make", "scaler", "why"),
    [
        (lambda p: torch.optim.LBFGS(p), None, "LBFGS is not one of"),
        (lambda p: torch.optim.SGD(p, lr=0.1), None, "unless fused=True"),
        (lambda p: torch.optim.AdamW(p), torch.amp.GradScaler("cpu"), "GradScaler"),
        (lambda p: torch.optim.AdamW(p, lr=torch.tensor(0.1)), None, "a tensor already"),
    ],
)
def test_what_is_not_captured_says_why(make, scaler, why):
    optimizer = make(torch.nn.Linear(2, 1).parameters())
    assert why in OptimizerGraph.refusal(optimizer, scaler, on_cuda=True)


def test_an_optimizer_with_step_hooks_is_not_captured():
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 1).parameters())
    optimizer.register_step_pre_hook(lambda *args: None)
    assert "step hooks" in OptimizerGraph.refusal(optimizer, None, on_cuda=True)


def timed_graph(timer: FakeTimer) -> tuple[torch.nn.Linear, torch.optim.Optimizer, OptimizerGraph]:
    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, fused=True)
    graph = OptimizerGraph(optimizer, capture=fake_capture, timer=timer)
    graph.install()
    return net, optimizer, graph


@pytest.mark.parametrize(("graph_ms", "kept"), [(4.0, True), (5.0, False)])
def test_the_trial_keeps_the_graph_only_where_whole_steps_measure_faster(graph_ms, kept):
    net, optimizer, graph = timed_graph(FakeTimer(graph_ms, eager_ms=5.0))
    for _ in range(1 + 2 * TRIAL_BLOCKS * BLOCK_STEPS + 10):  # the eager warm-up, the trial, 10 steps after it
        step(net, optimizer)
    assert graph.trial.decided and graph.trial.keep is kept
    replays_in_trial = TRIAL_BLOCKS * BLOCK_STEPS
    assert graph.replays == (replays_in_trial + 10 if kept else replays_in_trial)
    assert ("kept at 0.80x" in graph.describe()) if kept else ("dropped at 1.00x" in graph.describe())


def test_each_eager_block_of_the_trial_starts_on_a_device_with_nothing_queued():
    timer = FakeTimer(4.0, eager_ms=5.0)
    net, optimizer, graph = timed_graph(timer)
    for _ in range(1 + 2 * TRIAL_BLOCKS * BLOCK_STEPS + 10):  # the eager warm-up, the trial, 10 steps after it
        step(net, optimizer)
    assert graph.trial.decided and timer.waits == TRIAL_BLOCKS  # one wait where each replayed block gives way


def test_steps_that_compiled_or_recorded_a_graph_are_left_out_of_the_trial():
    """Every other step records (the fit says so at its end): only the others are timed."""
    net, optimizer, graph = timed_graph(FakeTimer(4.0, eager_ms=5.0))
    for i in range(1 + 2 * TRIAL_BLOCKS * BLOCK_STEPS):
        step(net, optimizer)
        if i % 2:
            graph.leave_step_untimed()
    assert graph.trial.measured is None and not graph.trial.decided, "half the steps timed: not enough yet"
    for _ in range(2 * TRIAL_BLOCKS * BLOCK_STEPS):
        step(net, optimizer)
    assert graph.trial.decided and graph.trial.keep


def test_the_trial_waits_for_enough_timed_steps():
    trial = Trial()
    trial.measure([4.0] * 3, [5.0] * 30)
    assert trial.measured is None and trial.wants_graph()
    trial.measure([4.0] * 10, [])
    assert trial.measured == 0.8 and not trial.decided  # measuring is not deciding: settle decides
    trial.settle(trial.measured)
    assert trial.decided and trial.keep


def shared_graph(graph_ms: float) -> tuple[torch.nn.Linear, torch.optim.Optimizer, OptimizerGraph]:
    """An optimizer graph of one of several processes, whose trial measures ``graph_ms`` against 5 ms eager."""
    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, fused=True)
    graph = OptimizerGraph(optimizer, capture=fake_capture, timer=FakeTimer(graph_ms, eager_ms=5.0),
                           decides_alone=False)  # fmt: skip
    graph.install()
    return net, optimizer, graph


def test_with_several_processes_a_trial_measures_but_rank_zeros_word_decides():
    net, optimizer, graph = shared_graph(graph_ms=4.0)  # alone, this rank would keep the graph
    assert graph.proposal() is None
    for _ in range(1 + 2 * TRIAL_BLOCKS * BLOCK_STEPS + 8):
        step(net, optimizer)
    assert graph.proposal() == 0.8 and not graph.trial.decided  # still alternating, until rank zero's word
    assert settle_together([graph], broadcast=lambda words: [1.0]) is True  # rank zero measured 1.0x
    assert graph.trial.decided and not graph.trial.keep and graph.disabled_reason is not None
    replays = graph.replays
    step(net, optimizer)
    assert graph.replays == replays and "dropped at 1.00x" in graph.describe()


def test_rank_zeros_word_keeps_a_graph_this_rank_would_have_dropped():
    net, optimizer, graph = shared_graph(graph_ms=5.0)
    for _ in range(2 + 2 * TRIAL_BLOCKS * BLOCK_STEPS):  # the eager warm-up, the capture, the trial
        step(net, optimizer)
    assert graph.proposal() == 1.0
    settle_together([graph], broadcast=lambda words: [0.8])
    replays = graph.replays
    for _ in range(4):
        step(net, optimizer)
    assert graph.trial.keep and graph.replays == replays + 4 and "kept at 0.80x" in graph.describe()


def test_until_rank_zero_has_a_word_nothing_is_settled():
    *_, graph = shared_graph(graph_ms=4.0)
    assert settle_together([graph, None], broadcast=lambda words: [None, None]) is False
    assert not graph.trial.decided and graph.disabled_reason is None


def test_a_graph_gone_on_rank_zero_sends_every_rank_to_the_eager_update():
    net, optimizer, graph = shared_graph(graph_ms=4.0)
    gone = OptimizerGraph(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1, fused=True))
    assert gone.proposal() == math.inf  # never installed (or uninstalled with its plan): it has no update to offer
    assert settle_together([graph], broadcast=lambda words: [math.inf]) is True
    assert "rank zero" in graph.disabled_reason
    step(net, optimizer)
    step(net, optimizer)
    assert graph.replays == 0


def test_fuse_callback_replays_the_update_under_its_plan_and_reports_it():
    torch.manual_seed(0)
    task = ScheduledTask("adamw")
    twin = copy.deepcopy(task)
    fuse = FuseCallback(mode="default", backend="aot_eager", cuda_graph=False, cache_dir=False, eager_steps=2,
                        gpu_sample_hz=0)  # fmt: skip
    fit(task, [fuse, FakeOptimizerCapture()], gradient_clip_val=0.1)
    fit(twin, gradient_clip_val=0.1)
    (graph,) = fuse.fit.optimizer_graphs
    assert "optimizer step: " in fuse.fit.what_ran() and " replays, " in fuse.fit.what_ran()
    assert graph.replays >= 4
    assert task.trainer.optimizers[0].param_groups[0]["capturable"] is False  # put back
    for got, want in zip(task.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_graph_uninstalled_by_its_own_steps_closure_still_updates_with_the_optimizers_own_step():
    """Found on an H200: a backward under torch's cudagraph trees failed inside Lightning's closure, FuseCallback
    dropped its plan (uninstalling this graph), and the step went on to call the replaced ``step``, gone: the run
    ended with "'NoneType' object is not callable"."""
    net, optimizer, graph = linear_with_graph(lr=0.5)
    twin = copy.deepcopy(net)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.5)

    def closure(model, uninstall):
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        if uninstall:
            graph.uninstall()
        return loss

    for dropped in (False, False, True):
        optimizer.zero_grad(), twin_optimizer.zero_grad()
        optimizer.step(lambda: closure(net, dropped))
        twin_optimizer.step(lambda: closure(twin, False))
    torch.testing.assert_close(net.weight, twin.weight)
    assert "step" not in vars(optimizer)
