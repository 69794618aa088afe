"""Training patterns users bring, fitted with FuseCallback and without it: the same losses and parameters.

Each test fits a small model twice on CPU (2 epochs of 12 steps), once plain and once with
``FuseCallback(mode="auto", backend="aot_eager", cache_dir=False)``, and compares every step's loss and the final
parameters at float32 tolerance (bf16 for bf16 precision). On CPU eager usually measures fastest, which would make
the comparison trivial, so :func:`~tests.user_models.pin_search` makes the search choose a compiled plan
(``regions`` unless said otherwise) and keep it: every candidate still runs on the fit's own inputs.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy

import lightning_fuse.callback as fuse_callback
import lightning_fuse.plan as plan_module
import lightning_fuse.start as start_module
from lightning_fuse.graphs import GraphedModule
from lightning_fuse.plan import Plan, RegionGraphs, Regions
from tests.faults import DropAfterActivation, FakeOptimizerCapture, grad_buffer_capture
from tests.user_models import (
    BF16,
    FP32,
    STEPS,
    BlockNet,
    ClassifierTask,
    FrozenBackboneTask,
    GanTask,
    HFTask,
    moe_net,
    ShardedTask,
    UserCompiledTask,
    VariableLengthTask,
    assert_plan_ran,
    assert_same_training,
    features,
    fit,
    fuse,
    fused_and_eager,
    lora_gpt2,
    one_thread,  # noqa: F401 - an autouse fixture: one intra-op thread in this module
    pin_search,
    tiny_gpt2,
)

CUDA = torch.device("cuda", 0)

# ---------------------------------------------------------------------------------------------- activation checkpointing
@pytest.mark.parametrize(
    ("use_reentrant", "winner"),
    [
        pytest.param(False, "regions", id="non-reentrant-regions"),
        pytest.param(False, "compile", id="non-reentrant-compile"),
        pytest.param(True, "regions", id="reentrant-regions"),
    ],
)  # fmt: skip
def test_activation_checkpointing_in_user_blocks(monkeypatch, use_reentrant, winner):
    pin_search(monkeypatch, winner)
    make = lambda: ClassifierTask(BlockNet(use_reentrant=use_reentrant))
    fused, eager, cb = fused_and_eager(make)
    assert_plan_ran(cb, winner)
    assert_same_training(fused, eager)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_hf_gradient_checkpointing(monkeypatch, use_reentrant):
    pytest.importorskip("transformers")
    pin_search(monkeypatch)
    make = lambda: HFTask(tiny_gpt2(), gradient_checkpointing=use_reentrant)
    eager = fit(make)
    assert eager.task.model.is_gradient_checkpointing
    cb = fuse()
    fused = fit(make, [cb])
    assert_plan_ran(cb, "regions")
    assert cb.plan.runners and all(r.name.startswith("model.transformer.h.") for r in cb.plan.runners)
    assert_same_training(fused, eager)


# ---------------------------------------------------------------------------------------------- layer drop
def test_blocks_skipped_at_random_train_under_a_graph_each_as_eagerly(monkeypatch):
    """On a CPU, the search a GPU makes for a network that skips blocks at random in training (HF Wav2Vec2's
    ``layerdrop``, a host sync each): the graph over the regions fails on the sync between them, and
    ``regions+graphs``, a graph per block (captures faked: the replay writes the gradients into buffers of its own),
    trains as eager does, whichever blocks each step skipped."""
    on_a_gpu = lambda setting: replace(setting, device=CUDA)
    monkeypatch.setattr(start_module, "candidates", lambda setting: [
        Plan(), Regions(on_a_gpu(setting), graph=True), RegionGraphs(on_a_gpu(setting))])  # fmt: skip
    monkeypatch.setattr(plan_module, "syncs_between_regions", lambda *args, **kwargs: "called a synchronizing op")
    monkeypatch.setattr(plan_module, "GraphedModule", partial(GraphedModule, capture=grad_buffer_capture,
                                                              on_device=lambda tensor: True))  # fmt: skip
    pin_search(monkeypatch, winner="regions+graphs")
    fused, eager, cb = fused_and_eager(lambda: ClassifierTask(BlockNet(layer_drop=0.3)))
    assert_plan_ran(cb, "regions+graphs")
    assert cb.decision.trials[1].outcome.startswith("failed: it syncs with the host outside its regions")
    assert "graphs: 3 of 3 regions captured" in cb.fit.what_ran()
    assert all(row["fuse/graph_replays"] > 0 for row in cb.history)
    assert_same_training(fused, eager)


# ---------------------------------------------------------------------------------------------- frozen parameters
def test_frozen_backbone(monkeypatch):
    pin_search(monkeypatch)
    fused, eager, cb = fused_and_eager(FrozenBackboneTask)
    assert_plan_ran(cb, "regions")
    assert_same_training(fused, eager)
    L.seed_everything(0, verbose=False)  # as fit() does before building the task
    initial = FrozenBackboneTask().state_dict()
    for name, value in fused.task.state_dict().items():
        moved = not torch.equal(value, initial[name])
        assert moved == name.startswith(("model.blocks.2.", "model.blocks.3.", "model.head.")), name


def test_peft_lora_adapter(monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    pin_search(monkeypatch)
    make = lambda: HFTask(lora_gpt2())
    fused, eager, cb = fused_and_eager(make)
    assert_plan_ran(cb, "regions")
    assert_same_training(fused, eager)
    trainable = {n for n, p in fused.task.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


# ---------------------------------------------------------------------------------------------- optimization loops
def test_manual_optimization_with_two_optimizers(monkeypatch):
    pin_search(monkeypatch)
    eager = fit(GanTask)
    cb = fuse()
    fused = fit(GanTask, [cb])
    assert_plan_ran(cb, "regions")
    assert sorted(r.name for r in cb.plan.runners) == [
        "discriminator.blocks.0", "discriminator.blocks.1", "generator.blocks.0", "generator.blocks.1",
    ]  # fmt: skip
    assert_same_training(fused, eager)


def test_gradient_accumulation_with_clipping(monkeypatch):
    pin_search(monkeypatch)
    make = lambda: ClassifierTask(BlockNet(), lr=0.3)  # large enough that clipping bites
    kwargs = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
    eager = fit(make, **kwargs)
    unclipped = fit(make, accumulate_grad_batches=2)
    assert unclipped.losses[-1] != pytest.approx(eager.losses[-1], rel=1e-4)  # clipping changed the training
    cb = fuse()
    fused = fit(make, [cb], **kwargs)
    assert_plan_ran(cb, "regions")
    assert_same_training(fused, eager)
    assert fused.trainer.global_step == eager.trainer.global_step == STEPS  # 2 epochs of 12 batches, 2 per step


# ---------------------------------------------------------------------------------------------- sharded parameters
REPLAYED_ADAM_BF16 = {"rtol": 1e-3, "atol": 1e-4}
"""A replayed Adam update computes its bias corrections from step counters on the device (float32) where the user's
computes them on the host (float64): the last bits differ, and a bf16 network's casts carry them on. Over this fit
the parameters then differ from eager's by up to 5e-5 (0.1%), or not at all, by what ran before in the process (run
alone, this fit trained otherwise than after another module had set and reset the intra-op thread count, and missed
fp32's tolerance); without the replay they are equal."""


@pytest.mark.skipif(not torch.distributed.is_available(), reason="FSDP2 needs torch.distributed")
@pytest.mark.parametrize(("winner", "mixed"), [("regions", False), ("compile", True)], ids=["regions", "compile-bf16"])
def test_fsdp2_fully_shard_in_configure_model(monkeypatch, recwarn, winner, mixed):
    """Lightning's ``ModelParallelStrategy`` (one process): the search checks each candidate against eager on FSDP2's
    sharded parameters and gradients (the checks once failed every candidate there, and the network's own under a
    mixed-precision policy, whose hooks cast its inputs), and the plan trains as eager, its optimizer's update
    replayed (capture faked) on the gradients' shards (copying the sharded gradients whole once crashed the fit).
    Its progress-bar speedup is reduced over the process group, so Lightning does not warn that it is not."""
    pin_search(monkeypatch, winner)
    make = lambda: ShardedTask(mixed)
    try:
        eager = fit(make, strategy=ModelParallelStrategy())
        cb = fuse()
        fused = fit(make, [cb, FakeOptimizerCapture()], strategy=ModelParallelStrategy())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    measured = [trial.name for trial in cb.decision.trials if trial.ms is not None]
    assert measured == ["eager", "regions", *(["compile"] if winner == "compile" else [])], cb.decision.lines()
    assert_plan_ran(cb, winner)
    assert cb.fit.optimizer_graphs[0].replays > 0
    assert not [w for w in recwarn if "fuse/speedup" in str(w.message)]
    assert_same_training(fused, eager, **(REPLAYED_ADAM_BF16 if mixed else FP32))


# ---------------------------------------------------------------------------------------------- precision
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_precision(monkeypatch, precision):
    pin_search(monkeypatch)
    make = lambda: ClassifierTask(BlockNet())
    eager = fit(make, precision=precision)
    cb = fuse()
    fused = fit(make, [cb], precision=precision)
    assert_plan_ran(cb, "regions")
    dtype = {p.dtype for p in fused.task.parameters()}
    assert dtype == ({torch.bfloat16} if precision == "bf16-true" else {torch.float32})
    assert_same_training(fused, eager, **BF16)


# ---------------------------------------------------------------------------------------------- the user's own compile
def test_model_compiled_by_the_user_before_the_fit(monkeypatch):
    monkeypatch.setattr(fuse_callback, "SLOWER_THAN_EAGER", 0.0)  # CPU timing noise must not drop it here
    monkeypatch.setattr(fuse_callback, "CLEARLY_SLOWER", 0.0)
    eager = fit(lambda: UserCompiledTask(compile_it=False))
    cb = fuse()
    fused = fit(lambda: UserCompiledTask(compile_it=True), [cb])
    assert cb.plan.name == "user-compiled"
    assert cb.decision is None  # nothing measured: FuseCallback compiles nothing of its own
    assert cb.fit.dropped is None
    assert fused.task.model._compiled_call_impl is not None  # the user's compile is left as the user made it
    fused.task.model._compiled_call_impl = None  # for assert_same_training's check that ours is gone
    assert_same_training(fused, eager)


def graph_over_the_users_compile_measured(monkeypatch):
    """On a CPU, the candidates a user-compiled network gets on one GPU: the graph plan runs, uncaptured (CPU
    tensors), through the user's compiled code, its check for host syncs (a GPU's) finding none; the search is
    pinned to it."""
    own_candidates = start_module.user_compiled_candidates
    as_on_a_gpu = lambda setting, modules: own_candidates(replace(setting, device=CUDA), modules)
    monkeypatch.setattr(start_module, "user_compiled_candidates", as_on_a_gpu)
    monkeypatch.setattr(plan_module, "syncs_between_regions", lambda *args, **kwargs: None)
    pin_search(monkeypatch, winner="user-compiled+graph")


def test_a_cuda_graph_over_the_users_compile_is_measured_against_their_compile_alone(monkeypatch, caplog):
    graph_over_the_users_compile_measured(monkeypatch)
    eager = fit(lambda: UserCompiledTask(compile_it=False))
    cb = fuse()
    with caplog.at_level("INFO"):
        fused = fit(lambda: UserCompiledTask(compile_it=True), [cb])
    [line] = [r.getMessage() for r in caplog.records if "no compile of its own" in r.getMessage()]
    assert line.endswith("the user's compile is measured against: user-compiled+graph")
    assert [t.name for t in cb.decision.trials] == ["user-compiled", "user-compiled+graph"]
    assert cb.plan.name == "user-compiled+graph" and cb.fit.dropped is None and cb.compiled_regions == []
    users = fused.task.model._compiled_call_impl
    assert users is not None and not isinstance(users, GraphedModule)  # the user's compile, as they made it
    fused.task.model._compiled_call_impl = None  # for assert_same_training's check that ours is gone
    assert_same_training(fused, eager)


def test_a_dropped_graph_over_the_users_compile_leaves_their_compile_running(monkeypatch):
    graph_over_the_users_compile_measured(monkeypatch)
    cb = fuse()
    with pytest.warns(UserWarning, match="dropped, the rest of the fit runs the model as the user compiled it"):
        fused = fit(lambda: UserCompiledTask(compile_it=True), [cb, DropAfterActivation(cb, "user-compiled+graph")])
    assert cb.fit.dropped is not None and cb.plan.name == "user-compiled"
    assert "the rest ran user-compiled" in cb.verdict
    users = fused.task.model._compiled_call_impl
    assert users is not None and not isinstance(users, GraphedModule)


# ---------------------------------------------------------------------------------------------- shapes that change
def test_sequence_length_varies_per_batch(monkeypatch, caplog):
    pin_search(monkeypatch)
    lengths = VariableLengthTask().sequence_lengths()
    assert len(set(lengths)) >= 3 and min(lengths) >= 5 and max(lengths) == 16
    eager = fit(VariableLengthTask)
    cb = fuse()  # FuseCallback's defaults: mode="auto", the plan chosen by the search
    with caplog.at_level("INFO"):
        fused = fit(VariableLengthTask, [cb])
    assert cb.options.mode == "auto" and cb.fit.searching
    assert_plan_ran(cb, "regions")
    regions = [r.name for r in cb.plan.runners]
    assert regions == ["model.blocks.0", "model.blocks.1"]
    # the search saw the first steps' lengths vary: the length dim compiles as dynamic, buckets are suggested
    assert cb.fit.hooks.shapes.calls == 3 and cb.fit.varying_dims == {1}
    [note] = [r.getMessage() for r in caplog.records if "input shapes vary" in r.getMessage()]
    assert "dim 1 is compiled as dynamic" in note and "FuseCallback(pad_buckets=[" in note
    reasons = {name: stats.recompile_reasons for name, stats in cb.tracker.regions.items()}
    assert cb.tracker.total_recompiles <= 2 * len(regions), reasons
    for name in regions:
        assert cb.tracker.stats(name).recompiles <= 2, reasons
    assert_same_training(fused, eager)


def test_mixture_of_experts_with_data_dependent_routing(monkeypatch):
    pin_search(monkeypatch)
    make = lambda: ClassifierTask(moe_net(), dataset=features(tokens=6))
    eager = fit(make)
    cb = fuse()
    fused = fit(make, [cb])
    assert cb.plan is not None
    assert cb.history and cb.history[-1]["plan"] == cb.plan.name
    assert_plan_ran(cb, "regions")
    assert_same_training(fused, eager)


def test_a_user_compiled_model_is_never_dropped_nor_compiled_again(monkeypatch):
    monkeypatch.setattr(fuse_callback, "SLOWER_THAN_EAGER", 100.0)  # every epoch measures "slower than eager"
    calls = []

    def counting_backend(gm, example_inputs):
        def run(*args):
            calls.append(1)
            return gm.forward(*args)

        return run

    class Counted(Callback):
        def __init__(self):
            self.at_epoch_end = []

        def on_train_epoch_end(self, trainer, pl_module):
            self.at_epoch_end.append(len(calls))

    def make():
        task = ClassifierTask(BlockNet())
        task.model.compile(backend=counting_backend)
        return task

    cb, counted = fuse(), Counted()
    fit(make, [cb, counted])
    assert cb.fit.dropped is None and cb.plan.name == "user-compiled"  # not ours to drop, however it measures
    assert counted.at_epoch_end[0] > 0  # the user's compiled code ran in epoch 0 ...
    assert counted.at_epoch_end[1] > counted.at_epoch_end[0]  # ... and in epoch 1
    assert cb.decision is None and cb.compiled_regions == []  # no search, nothing of FuseCallback's own compiled
