"""A training step's outputs kept past it, under torch's cudagraph trees: the next step's start frees them.

Found on an H200: manual optimization a chunk at a time, keeping each chunk's logits for an epoch-end metric, chose
``reduce-overhead`` by measurement, and the epoch's end failed reading them ("accessing tensor output of CUDAGraphs
that has been overwritten by a subsequent run"). On CPU inductor records no graphs: :func:`compile_watched_as_trees`
gives the ``compile`` plan the watch a plan under torch's trees has, and the tests check what FuseCallback does with
what it sees.
"""

from __future__ import annotations

import gc
import logging

import torch
from torch.nn import functional as F

from lightning_fuse import FuseCallback
from lightning_fuse import plan as plan_module
from lightning_fuse.held_outputs import OutputWatch
from tests.test_running_guard import PlanPerStep, regions_win_on_a_fake_clock
from tests.toy import ToyTask, trainer


class KeptLogits(ToyTask):
    """Keeps its steps' logits (detached, as Lightning's docs keep ``training_step_outputs``) from step
    ``keep_from`` on, for an epoch-end metric; ``keep_from=None``: keeps none."""

    def __init__(self, keep_from: int | None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.keep_from, self.kept, self.metric = keep_from, [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        if self.keep_from is not None and self.global_step >= self.keep_from:
            self.kept.append(logits.detach())
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        if self.kept:
            self.metric.append(float(torch.cat(self.kept).std()))
        self.kept.clear()


def compile_watched_as_trees(monkeypatch, name: str = "compile") -> None:
    """The plan ``name`` (the whole network compiled) watches its outputs as a plan under torch's trees does."""
    plain = plan_module.Whole.__init__

    def watched(self, *args, **kwargs) -> None:
        plain(self, *args, **kwargs)
        if self.name == name:
            self.watch = OutputWatch()
            for runner in self.runners:
                runner.on_return = self.watch

    monkeypatch.setattr(plan_module.Whole, "__init__", watched)


def fit(monkeypatch, task: KeptLogits, successors: tuple[str, ...] = ("regions",), **options):
    regions_win_on_a_fake_clock(monkeypatch, winner="compile")
    compile_watched_as_trees(monkeypatch)
    monkeypatch.setitem(plan_module.WITHOUT_GRAPHS, "compile", successors)
    fuse = FuseCallback(backend="aot_eager", cache_dir=False, eager_steps=0, **options)
    probe = PlanPerStep(fuse)
    trainer([fuse, probe], max_epochs=2, limit_val_batches=0, num_sanity_val_steps=0).fit(task)
    return fuse, probe


def test_outputs_kept_past_their_step_hand_the_plan_over_before_the_next_step_frees_them(monkeypatch, caplog):
    task = KeptLogits(keep_from=12, samples=16 * 20)
    with caplog.at_level(logging.INFO):
        fuse, probe = fit(monkeypatch, task)
    handed = probe.plans.index("regions")
    assert handed == 13, "at the start of the step after the first that kept its outputs (step 12)"
    assert set(probe.plans[fuse.fit.activation_step:handed]) == {"compile"}
    assert set(probe.plans[handed:]) == {"regions"}
    kept_past = "its steps' outputs were kept past the step"
    assert fuse.plan.reason == f"handed over from 'compile' at step {handed}: {kept_past}"
    assert caplog.text.count("free a step's outputs when the next step begins") == 1
    assert "Keep copies (`.detach().clone()`) to keep the graphs." in caplog.text
    assert fuse.fit.dropped is None and len(task.metric) == 2, "the epochs' ends read what they kept"


def test_outputs_that_nothing_keeps_past_their_step_keep_the_plan(monkeypatch):
    """Lightning holds nothing of a step's outputs into the next (the loss it logs is a copy), and neither does
    the watch: the plan runs to the fit's end."""
    fuse, probe = fit(monkeypatch, KeptLogits(keep_from=None, samples=16 * 20))
    assert set(probe.plans[fuse.fit.activation_step:]) == {"compile"} and fuse.fit.dropped is None
    assert fuse.plan.reason is None or "handed over" not in fuse.plan.reason


def test_outputs_kept_under_a_plan_whose_trees_stopped_keep_the_plan(monkeypatch):
    """A plan whose trees stopped (past their cap of sizes) runs its compiled code alone, whose outputs no next step
    frees: outputs kept past their step hand nothing over, and its calls' outputs are no longer watched."""
    plain_install = plan_module.Whole.install

    def install_stopped(self) -> None:
        plain_install(self)
        self.stop_trees()

    monkeypatch.setattr(plan_module.Whole, "install", install_stopped)
    task = KeptLogits(keep_from=12, samples=16 * 20)
    fuse, probe = fit(monkeypatch, task)
    assert set(probe.plans[fuse.fit.activation_step:]) == {"compile"} and fuse.fit.dropped is None
    assert len(task.metric) == 2
    assert all(runner.on_return is None for runner in fuse.fit.plan.runners), "outputs handed back unwrapped"


def test_with_no_candidate_without_the_trees_the_plan_is_dropped_and_says_what_keeps_it(monkeypatch):
    task = KeptLogits(keep_from=12, samples=16 * 20)
    fuse, probe = fit(monkeypatch, task, successors=())
    assert probe.plans[12] == "compile" and set(probe.plans[13:]) == {"eager"}, "dropped before step 13 began"
    assert "keeps its steps' outputs" in fuse.fit.dropped and "mode='default'" in fuse.fit.dropped
    assert len(task.metric) == 2


def test_output_tensors_the_graphs_keep_themselves_are_held_only_while_the_caller_holds_what_it_was_given():
    """torch's trees hand back, replay after replay, output tensors they keep (their cached outputs): counted as
    they are, every replay's outputs read as held at the next step (on an H200 every plan under the trees handed
    over at its first step, nothing kept). The watch hands the caller views of its own, and counts those."""
    cached = torch.ones(2, 3, requires_grad=True) * 2  # the graphs' own output tensor, kept across replays
    watch = OutputWatch()
    out = watch((cached,))[0]
    assert out is not cached and out.data_ptr() == cached.data_ptr() and out.grad_fn is not None
    del out
    assert not watch.held()
    kept = watch((cached,))[0].detach()
    assert watch.held()
    del kept
    assert not watch.held()


def test_an_output_only_a_reference_cycle_reaches_is_not_held_the_first_time():
    """A cycle keeps what it reaches until the collector's next pass: counted before it, the output reads as held,
    and the plan would hand over to a compile without graphs for nothing."""

    class Node:
        pass

    watch = OutputWatch()
    gc.disable()  # the collector passes when the test says, not at a moment of its own
    try:
        node = Node()
        node.loop, node.logits = node, watch((torch.ones(2, 3) * 2,))[0]
        del node
        assert not watch.held(), "the cycle was collected before the count"
        kept = watch((torch.ones(2, 3) * 3,))[0].detach()
        assert watch.held(), "a tensor the step keeps is held, collector or not"
        del kept
        watch.clear()
        again = Node()
        again.loop, again.logits = again, watch((torch.ones(2, 3) * 4,))[0]
        del again
        assert watch.held(), "the collector ran once a watch: a cycle met later reads as held"
    finally:
        gc.enable()
