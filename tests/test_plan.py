"""The plans (lightning_fuse.plan) and the whole-network graph's bookkeeping (lightning_fuse.graphs), on a CPU.

The capture itself needs a GPU; here it is faked: a fake ``make_graphed_callables`` runs the flattened call
eagerly (so kwargs, pytree outputs and the rebuild are exercised), or disturbs the process and raises.
"""

import copy
import gc
import warnings
import weakref
from dataclasses import dataclass, replace
from functools import partial

import pytest
import torch
from torch import nn

from lightning_fuse import compat
from lightning_fuse import plan as plan_module
from lightning_fuse.compiler import CompileOptions
from lightning_fuse.fit import FitState
from lightning_fuse.graphs import (
    SET_REPLACEMENTS,
    TRAINABLE_SETS,
    GraphedModule,
    call_signature,
    graph_target,
)
from lightning_fuse.host_syncs import host_syncs_raise
from lightning_fuse.module_state import StateWatch
from lightning_fuse.plan import (
    Plan,
    RegionGraphs,
    Regions,
    Setting,
    UserCompiled,
    UserCompiledGraph,
    Whole,
    candidates,
)
from lightning_fuse.regions import Region, resolve_regions
from lightning_fuse.replay import release_capture_graph
from lightning_fuse.start import forced_plan, user_compiled, user_compiled_candidates
from tests.faults import default_adamw_under_graph, grad_buffer_capture
from tests.toy import ToyTask
from tests.user_models import BlockNet

CUDA = torch.device("cuda", 0)


def setting_for(task, device=torch.device("cpu"), world_size=1, ddp=False):
    return Setting(resolve_regions(task, "auto", ()), graph_target(task), CompileOptions(backend="eager"), device,
                   world_size=world_size, ddp=ddp)  # fmt: skip


def test_candidates_per_device_and_process_count():
    task = ToyTask()
    assert [p.name for p in candidates(setting_for(task))] == ["eager", "regions", "compile"]
    cuda = [p.name for p in candidates(setting_for(task, CUDA))]
    assert cuda == ["eager", "regions+graph", "compile+graph", "reduce-overhead", "graph", "regions+graphs",
                    "regions+trees", "regions", "compile"]
    several = {p.name: p for p in candidates(setting_for(task, CUDA, world_size=2))}  # FSDP, say
    assert list(several) == ["eager", "regions", "compile"]
    # alone, regions faster than eager spare compiling the whole network; with several processes both are measured
    assert "regions" in candidates(setting_for(task))[-1].dominated_by
    assert several["compile"].dominated_by == ()
    # under DDP the reducer all-reduces what autograd accumulates from a graph's backward: the graph plans compete
    ddp = {p.name: p for p in candidates(setting_for(task, CUDA, world_size=2, ddp=True))}
    assert list(ddp) == cuda and ddp["compile"].dominated_by == ()
    assert [p.name for p in candidates(setting_for(task, world_size=2, ddp=True))] == ["eager", "regions", "compile"]


def test_cuda_graph_false_leaves_out_every_plan_that_captures_graphs_but_keeps_the_search():
    task = ToyTask()
    off = replace(setting_for(task, CUDA), graphs_off=True)
    assert [p.name for p in candidates(off)] == ["eager", "regions", "compile"]
    assert not any(p.records_graphs or p.cudagraph_trees for p in candidates(off))
    net = graph_target(task)[1]
    net.compile(backend="eager")
    assert [p.name for p in user_compiled_candidates(off, [net])] == ["user-compiled"]  # their compile, no graph


def test_a_network_the_user_compiled_gets_a_graph_over_their_compile_where_graphs_run():
    task = ToyTask()
    net = graph_target(task)[1]
    net.compile(backend="eager")
    names = lambda setting, modules: [p.name for p in user_compiled_candidates(setting, modules)]
    assert user_compiled(task) == [net]
    assert names(setting_for(task, CUDA), [net]) == ["user-compiled", "user-compiled+graph"]
    assert names(setting_for(task), [net]) == ["user-compiled"]
    assert names(setting_for(task, CUDA, world_size=2), [net]) == ["user-compiled"]
    assert names(setting_for(task, CUDA, world_size=2, ddp=True), [net]) == ["user-compiled", "user-compiled+graph"]
    # the LightningModule compiled: its compiled call would trace through the graph's dispatch on the network
    assert names(setting_for(task, CUDA), [task]) == ["user-compiled"]


def test_the_graph_over_the_users_compile_runs_their_code_and_steps_aside_for_eager_and_at_teardown():
    calls = []

    def counting_backend(gm, example_inputs):
        return lambda *args: calls.append(1) or gm.forward(*args)

    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    net.compile(backend=counting_backend)
    users = compat.compiled_call_impl(net)
    plan = UserCompiledGraph(Setting([], ("net", net), CompileOptions(), CUDA), UserCompiled([net]))
    assert plan.modules() == [net]  # the network once, though the user's compile and the graph both sit on it
    plan.install()
    assert compat.compiled_call_impl(net) is plan.graph
    net(torch.ones(2, 3)).sum().backward()  # CPU tensors: no capture, the user's compiled code runs
    assert calls and plan.graph.replays == 0
    ran = len(calls)
    with plan.bypassed():  # an eager reference step: neither the graph nor the user's compile
        net(torch.ones(2, 3)).sum().backward()
    assert len(calls) == ran
    plan.uninstall()
    assert compat.compiled_call_impl(net) is users


def test_whole_network_candidate_is_not_repeated_when_the_regions_are_the_whole_network():
    task = ToyTask()
    setting = Setting(resolve_regions(task, "full", ()), graph_target(task), CompileOptions(backend="eager"),
                      torch.device("cpu"))  # fmt: skip
    assert [p.name for p in candidates(setting)] == ["eager", "regions"]
    on_cuda = {p.name: p for p in candidates(replace(setting, device=CUDA))}
    assert list(on_cuda) == ["eager", "regions+graph", "reduce-overhead", "graph", "regions"]
    # regions+graph is then one graph over the whole network compiled: reduce-overhead's kernels under one graph
    assert "regions+graph" in on_cuda["reduce-overhead"].same_kernels_as


def test_explicit_settings_force_one_plan_and_refuse_a_graph_with_several_processes_but_ddps():
    task = ToyTask()
    assert forced_plan(setting_for(task, CUDA), "default", "auto").name == "regions+graph"
    assert forced_plan(setting_for(task, CUDA), "reduce-overhead", "auto").name == "regions"
    assert forced_plan(setting_for(task), "auto", True).name == "regions"  # no CUDA device: no graph
    with pytest.raises(ValueError, match="cuda_graph=True runs in one process or under DDP"):
        forced_plan(setting_for(task, CUDA, world_size=2), "auto", True)
    assert forced_plan(setting_for(task, CUDA, world_size=2, ddp=True), "auto", True).name == "regions+graph"
    assert forced_plan(setting_for(task, CUDA, world_size=2), "default", "auto").name == "regions"


def test_the_plans_that_run_torchs_cudagraph_trees_are_those_in_a_graphing_mode_on_cuda():
    task = ToyTask()
    on_cuda = {p.name: p.cudagraph_trees for p in candidates(setting_for(task, CUDA))}
    assert [name for name, trees in on_cuda.items() if trees] == ["reduce-overhead", "regions+trees"]
    assert forced_plan(setting_for(task, CUDA), "max-autotune", "auto").cudagraph_trees
    assert not Whole(setting_for(task), "reduce-overhead").cudagraph_trees  # on CPU inductor records no graphs


def test_every_candidate_compiles_with_the_users_inductor_options_those_with_a_mode_too():
    task = ToyTask()
    setting = replace(setting_for(task, CUDA), options=CompileOptions(options={"fallback_random": True}))
    plans = {plan.name: plan for plan in candidates(setting) if plan.name != "eager"}
    assert {name: plan.setting.options.options for name, plan in plans.items()} == dict.fromkeys(
        plans, {"fallback_random": True})  # fmt: skip
    for name in ("reduce-overhead", "regions+trees"):  # torch.compile takes the mode as its options
        assert plans[name].setting.options.kwargs()["options"] == {"triton.cudagraphs": True, "fallback_random": True}
    forced = forced_plan(setting, "max-autotune", "auto").setting.options.kwargs()  # the user's mode and options
    assert forced["options"]["max_autotune"] is True and forced["options"]["fallback_random"] is True


def test_a_plan_installs_and_uninstalls_itself_in_place():
    task = ToyTask()
    plan = Whole(setting_for(task), None)
    plan.install()
    assert task.model._compiled_call_impl is plan.runners[0] and plan.modules() == [task.model]
    x = torch.randn(3, 8)
    torch.testing.assert_close(task.model(x), type(task.model).forward(task.model, x))
    plan.uninstall()
    assert task.model._compiled_call_impl is None and plan.compiled_regions == []


def test_graph_target_is_the_largest_child_and_needs_one():
    task = ToyTask()
    assert graph_target(task) == ("model", task.model)
    with pytest.raises(ValueError, match="cuda_graph needs the LightningModule to hold its network"):
        graph_target(nn.ReLU())


# ---------------------------------------------------------------------------------------------------------------
# The graph's bookkeeping: kwargs in, any pytree out.


@dataclass
class Output:  # a ModelOutput-like dataclass, registered with pytree as transformers registers its outputs
    loss: torch.Tensor
    logits: torch.Tensor
    hidden: tuple | None = None


torch.utils._pytree.register_dataclass(Output)


class KwargsNet(nn.Module):
    """Called as ``net(input_ids=..., scale=..., mask=None)``; returns whatever ``kind`` asks for."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, input_ids, scale=1.0, mask=None):
        logits = self.head(self.embed(input_ids)) * scale
        loss = logits.float().pow(2).mean()
        if self.kind == "dataclass":
            return Output(loss, logits, None)
        if self.kind == "dict":
            return {"loss": loss, "logits": logits, "n": 3}
        if self.kind == "tuple":
            return (loss, None, logits)
        return {"loss": loss, "cache": object()}  # a non-tensor leaf, like HF's DynamicCache


def fake_capture(log):
    def capture(flat, tensors, num_warmup_iters):
        log.append(len(tensors))
        return lambda *args: flat(*args)  # "replay" = the flattened call, run eagerly

    return capture


def assert_same_output(got, want):
    assert type(got) is type(want)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(a, b) if isinstance(b, torch.Tensor) else None


@pytest.mark.parametrize("kind", ["dataclass", "dict", "tuple"])
def test_kwargs_and_pytree_outputs_go_through_the_graph_and_come_back_whole(kind):
    torch.manual_seed(0)
    net, log = KwargsNet(kind), []
    graphed = GraphedModule("net", net, capture=fake_capture(log), on_device=lambda t: True)
    graphed.install()
    graphed.capture_allowed = True
    ids = torch.randint(0, 10, (2, 5))
    want = type(net).forward(net, ids, scale=2.0)
    for step in range(2):
        graphed.begin_step(grads_zeroed_after_forward=False)
        assert_same_output(net(input_ids=ids, scale=2.0), want)  # nothing of it outlives the step (graph_slots)
    assert graphed.captured and graphed.replays == 2 and log == [1]
    net(input_ids=ids, scale=3.0)  # another plain input: not the captured call
    assert graphed.replays == 2
    graphed.uninstall()
    assert net._compiled_call_impl is None


def test_a_release_collects_garbage_only_where_it_dropped_graphs(monkeypatch):
    """A warm start releases every losing candidate's graph, most never captured: a collection each cost 0.3 s."""
    from lightning_fuse import graphs

    collections = []
    monkeypatch.setattr(graphs.gc, "collect", lambda: collections.append(1))
    net = KwargsNet("dict")
    graphed = GraphedModule("net", net, capture=fake_capture([]), on_device=lambda t: True)
    graphed.release()
    assert collections == [], "nothing captured: nothing to collect"
    graphed.install()
    graphed.capture_allowed = True
    net(input_ids=torch.randint(0, 10, (2, 5)), scale=2.0)
    assert graphed.captured
    graphed.release()
    assert collections == [1] and not graphed.captured, "the dropped graph's memory pool goes"
    graphed.uninstall()


class HeldInACycle(nn.Module):
    """Each output is kept alive by a reference cycle (only a garbage collection frees it); ``outputs`` holds weak
    references to them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.outputs: list[weakref.ref] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        cycle: list = [out]
        cycle.append(cycle)
        self.outputs.append(weakref.ref(out))
        return out


def test_an_output_of_the_probe_that_outlives_its_call_is_freed_before_the_capture():
    """On an H200, HF Whisper's warm fits lost their graph: an earlier output, with its autograd graph (whose
    AccumulateGrad nodes were made on another stream), was still alive at the capture."""
    net, alive_at_capture = HeldInACycle(), []

    def capture(flat, tensors, num_warmup_iters):
        alive_at_capture.append(sum(ref() is not None for ref in net.outputs))
        return lambda *args: flat(*args)

    graphed = GraphedModule("net", net, capture=capture, on_device=lambda t: True)
    graphed.install()
    graphed.capture_allowed = True
    gc.disable()  # no automatic collection between the probe and the capture
    try:
        net(torch.ones(1, 2))
    finally:
        gc.enable()
    assert graphed.captured and len(net.outputs) == 3, "two probe calls, then the captured call"
    assert alive_at_capture == [0], "what only a collection frees went before the capture"
    graphed.uninstall()


def static_buffer_capture(flat, tensors, num_warmup_iters):
    """As make_graphed_callables does: the sample inputs are the graph's input buffers, each replay copies its
    inputs into them (unless it is handed those very buffers) and computes from them."""

    def replay(*inputs):
        for static, given in zip(tensors, inputs):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        return flat(*tensors)

    return replay


def test_replays_never_write_into_the_batches_a_user_keeps_on_the_device():
    net = KwargsNet("dict")
    graphed = GraphedModule("net", net, capture=static_buffer_capture, on_device=lambda t: True)
    graphed.install()
    graphed.capture_allowed = True
    data = torch.randint(0, 10, (2, 2, 5))  # two batches held in memory, slices of one tensor, as a GPU dataset
    kept = data.clone()
    for i in range(4):
        graphed.begin_step(grads_zeroed_after_forward=False)
        loss = net(input_ids=data[i % 2])["loss"]
        torch.testing.assert_close(loss, type(net).forward(net, data[i % 2])["loss"])
        del loss  # a step's outputs do not outlive it (graph_slots)
    assert graphed.captured and graphed.replays == 4
    assert torch.equal(data, kept)  # the capture batch was copied, not made the graph's buffer
    graphed.uninstall()


@pytest.mark.parametrize("zero", ["accumulate", "in_place"])
def test_gradients_kept_across_replays_are_never_overwritten_by_the_next_one(zero):
    torch.manual_seed(0)
    net = KwargsNet("dict")
    twin = copy.deepcopy(net)  # the same steps without any graph
    graphed = GraphedModule("net", net, capture=grad_buffer_capture, on_device=lambda t: True)
    graphed.install()
    graphed.capture_allowed = True
    batches = [torch.randint(0, 10, (2, 5)) for _ in range(4)]
    for i, ids in enumerate(batches):  # two steps of two micro-batches, or four steps zeroed in place
        if zero == "in_place" or i % 2 == 0:
            for model in (net, twin):
                model.zero_grad(set_to_none=zero == "accumulate")
        net(input_ids=ids)["loss"].backward()
        type(twin).forward(twin, ids)["loss"].backward()
    assert graphed.replays == 4
    for got, want in zip(net.parameters(), twin.parameters()):
        torch.testing.assert_close(got.grad, want.grad)
    graphed.uninstall()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_zeroed_after_the_forward_are_copied_at_the_backward_only_where_still_held(set_to_none):
    """Lightning's automatic optimization zeroes between the forward and the backward: nothing is copied at the
    forward, and a gradient zeroed in place (the forward may have scribbled on it) still trains right."""
    torch.manual_seed(0)
    net = KwargsNet("dict")
    twin = copy.deepcopy(net)
    graphed = GraphedModule("net", net, capture=grad_buffer_capture, on_device=lambda t: True)
    graphed.install()
    graphed.capture_allowed = True
    for ids in [torch.randint(0, 10, (2, 5)) for _ in range(3)]:
        graphed.grads_zeroed_after_forward = graphed.captured
        held = [p.grad for p in net.parameters()]
        out = net(input_ids=ids)
        if graphed.replays:
            assert all(p.grad is grad for p, grad in zip(net.parameters(), held)), "nothing copied at the forward"
        for model in (net, twin):
            model.zero_grad(set_to_none=set_to_none)
        out["loss"].backward()
        type(twin).forward(twin, ids)["loss"].backward()
        for got, want in zip(net.parameters(), twin.parameters()):
            torch.testing.assert_close(got.grad, want.grad)
    assert graphed.replays == 3
    graphed.uninstall()


def train_in_twins(net: nn.Module, trainable_sets: list[tuple[str, ...]]) -> GraphedModule:
    """For each set of trainable children (the others frozen) a forward+backward on ``net`` graphed and on a twin
    without any graph: their gradients agree after every step."""
    torch.manual_seed(0)
    twin = copy.deepcopy(net)
    graphed = GraphedModule("net", net, capture=grad_buffer_capture, on_device=lambda t: True)
    graphed.install()
    graphed.capture_allowed = True
    ids = torch.randint(0, 10, (2, 5))
    for trainable in trainable_sets:
        for model in (net, twin):
            for name, child in model.named_children():
                child.requires_grad_(name in trainable)
            model.zero_grad()
        net(input_ids=ids)["loss"].backward()
        type(twin).forward(twin, ids)["loss"].backward()
        for got, want in zip(net.parameters(), twin.parameters()):
            torch.testing.assert_close(got.grad, want.grad)
    graphed.uninstall()
    return graphed


def test_a_layer_unfrozen_after_the_capture_gets_a_graph_of_its_own():
    graphed = train_in_twins(KwargsNet("dict"), [("head",), ("embed", "head")] * 2)  # as BackboneFinetuning does
    assert graphed.graphs == 2 and graphed.replays == 4


def test_two_optimizers_toggling_each_others_parameters_replay_a_graph_each():
    graphed = train_in_twins(KwargsNet("dict"), [("embed",), ("head",)] * 3)  # Lightning's toggle_optimizer
    assert graphed.graphs == 2 and graphed.replays == 6


def test_the_set_used_least_recently_makes_way_for_a_new_one():
    # the plan search calls the network with every parameter trainable, the training steps toggle two halves
    graphed = train_in_twins(KwargsNet("dict"), [("embed", "head"), *[("embed",), ("head",)] * 3])
    assert graphed.graphs == 2 and graphed.replays == 7


def test_sets_that_keep_changing_run_without_a_graph_and_say_so_once(caplog):
    sets = [("head",), ("embed",), ("embed", "head")] * 4  # three sets in turn: graphs could never keep up
    graphed = train_in_twins(KwargsNet("dict"), sets)
    assert caplog.text.count("captured a CUDA graph") == TRAINABLE_SETS + SET_REPLACEMENTS, "then no more captures"
    assert graphed.graphs == 2 and graphed.replays == 10, "the two sets kept replay their graphs"
    assert caplog.text.count("the parameters that train in 'net' changed") == 1, "said once"


def test_an_output_holding_a_non_tensor_object_is_left_uncaptured_with_its_reason():
    net, log = KwargsNet("cache"), []
    graphed = GraphedModule("net", net, capture=fake_capture(log), on_device=lambda t: True)
    graphed.install()
    graphed.capture_allowed = True
    with pytest.warns(UserWarning, match="holds a object, which a graph replay cannot rebuild"):
        out = net(input_ids=torch.randint(0, 10, (2, 5)))
    assert "loss" in out and not graphed.captured and log == []  # refused before any capture
    graphed.uninstall()


def test_a_capture_that_raises_leaves_rng_forward_grads_and_buffers_as_they_were():
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    x = torch.randn(8, 4)
    net(x).sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    twin = copy.deepcopy(net)  # what the step does without any graph

    def broken_capture(flat, tensors, num_warmup_iters):
        flat(*tensors)  # a warmup: updates batch-norm statistics and draws random numbers
        for p in net.parameters():
            p.grad = torch.full_like(p, 7.0)
        flat.forward = lambda *a: None  # patches forward, as make_graphed_callables does
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    graphed = GraphedModule("net", net, capture=broken_capture, on_device=lambda t: True)
    graphed.install()
    graphed.capture_allowed = True
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match="the capture failed"):
        out = net(x)  # the fit goes on: this step runs as before, eagerly
    rng = torch.get_rng_state()
    torch.manual_seed(3)
    want = twin(x)
    assert "previous error during capture" in graphed.disabled_reason and not graphed.captured
    torch.testing.assert_close(out, want)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(twin.buffers(), net.buffers()))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, net.parameters()))
    assert "forward" not in vars(net)
    graphed.uninstall()


def test_the_probe_refuses_regions_that_compile_again_at_every_call():
    net = nn.Linear(2, 2)
    count = iter(range(100))
    graphed = GraphedModule("net", net, capture=fake_capture([]), on_device=lambda t: True,
                            compiles=lambda: next(count))  # fmt: skip
    graphed.install()
    graphed.capture_allowed = True
    with pytest.warns(UserWarning, match="compile again at every call"):
        net(torch.randn(3, 2))
    assert not graphed.captured
    graphed.uninstall()


def test_a_capture_failed_by_a_region_compiling_inside_it_says_so():
    """transformers' ViT builds an attention mask only while a CUDA stream captures, so its compiled layers met a new
    input inside the capture and compiled there, which failed it (an H100, TORCH_LOGS=recompiles)."""
    net, compiles = nn.Linear(2, 2), [0]

    def capture_that_compiles(flat, tensors, num_warmup_iters):
        compiles[0] += 1  # the glue took its capturing path: a region compiles for it
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    graphed = GraphedModule("net", net, capture=capture_that_compiles, on_device=lambda t: True,
                            compiles=lambda: compiles[0])  # fmt: skip
    graphed.install()
    graphed.capture_allowed = True
    with pytest.warns(UserWarning, match="compiled again inside the capture"):
        net(torch.randn(3, 2))
    assert "previous error during capture" in graphed.disabled_reason and not graphed.captured
    graphed.uninstall()


def test_call_signature_tells_shapes_and_plain_values_apart():
    a = call_signature((torch.ones(2, 3),), {"flag": True})
    assert a == call_signature((torch.zeros(2, 3),), {"flag": True})
    assert a != call_signature((torch.zeros(3, 3),), {"flag": True})
    assert a != call_signature((torch.zeros(2, 3),), {"flag": False})


def test_release_capture_graph_detaches_the_outputs_a_graphed_forward_closes_over():
    weight = torch.nn.Parameter(torch.ones(3))

    def make_graphed():  # the shape of torch.cuda.make_graphed_callables: closures around an autograd Function
        static_outputs = (weight * 2, (weight * 3)[:2])  # the second is a view: cannot be detached in place

        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                return tuple(o.detach() for o in static_outputs)

        def functionalized(*args):
            return Graphed.apply(*args, weight)

        def new_fwd(*args):
            return functionalized(*args)

        return new_fwd, static_outputs

    graphed, outputs = make_graphed()
    assert release_capture_graph(graphed) == 1
    assert outputs[0].grad_fn is None and outputs[1].grad_fn is not None
    assert weight.grad_fn is None and weight.requires_grad  # parameters are left alone


class FakeSyncDebug:
    """``torch.cuda``'s sync-debug mode on a CPU machine: :meth:`sync` raises as a CUDA sync would in "error"."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mode = "default"
        monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: self.mode)
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: setattr(self, "mode", mode))

    def sync(self) -> None:
        if self.mode == "error":
            raise RuntimeError("called a synchronizing CUDA operation")


def test_turning_host_sync_checks_on_keeps_torchs_prototype_warning_from_the_user(monkeypatch):
    # every GPU fit's log carried it: "Synchronization debug mode is a prototype feature and does not yet detect all
    # synchronizing operations", for a check the user never turned on
    def torch_set(mode):
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
                      "operations (Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp:1003.)")  # fmt: skip

    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", torch_set)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with host_syncs_raise(True):
            pass
    assert caught == []


class Glue(nn.Module):
    """A block between two syncs: one in the eager code around it (``glue``), one inside it (``inside``)."""

    def __init__(self, sync: FakeSyncDebug, glue: bool, inside: bool) -> None:
        super().__init__()
        self.block, self.sync, self.glue, self.inside = nn.Linear(4, 4), sync, glue, inside
        self.block.register_forward_pre_hook(lambda *_: self.sync.sync() if self.inside else None)

    def forward(self, x):
        if self.glue:
            self.sync.sync()  # an HF model's `if mask.all():`
        return self.block(x)


@pytest.mark.parametrize(("glue", "inside"), [(True, False), (False, True), (False, False)])
def test_a_graph_plan_is_refused_before_compiling_when_the_code_between_regions_syncs(monkeypatch, glue, inside):
    sync = FakeSyncDebug(monkeypatch)
    net = Glue(sync, glue, inside)
    setting = Setting([Region("block", net.block)], ("net", net), CompileOptions(backend="eager"), CUDA)
    plan = Regions(setting, graph=True)
    reason = plan.unfit(lambda: net(torch.randn(2, 4)).sum().backward())
    if glue:  # the glue runs eagerly inside every capture: no graph over this network can be captured
        assert reason == ("it syncs with the host outside its regions, which no capture survives "
                          "(RuntimeError: called a synchronizing CUDA operation)")  # fmt: skip
    else:  # a sync inside a region may be traced away by its compile: the capture decides
        assert reason is None
    assert sync.mode == "default" and not net.block._forward_hooks  # nothing left behind
    assert Regions(setting, graph=False).unfit(lambda: sync.sync()) is None  # no graph, nothing to refuse


SYNCS: list[FakeSyncDebug] = []  # the fake sync mode the op below consults, set by each test that uses it


@torch.library.custom_op("fuse_tests::syncing_op", mutates_args=())
def syncing_op(x: torch.Tensor) -> torch.Tensor:
    """An op that syncs with the host when it runs (as a CUDA tensor built from a Python value does under the
    ``eager`` backend), traced into dynamo's graph."""
    SYNCS[-1].sync()
    return x.clone()


@syncing_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Syncing(nn.Module):
    """A network whose forward syncs once: inside dynamo's graph (``traced``), or in eager code at a graph break."""

    def __init__(self, sync: FakeSyncDebug, traced: bool) -> None:
        super().__init__()
        self.block, self.sync, self.traced = nn.Linear(4, 4), sync, traced

    def forward(self, x):
        if self.traced:
            return self.block(syncing_op(x))
        torch.compiler.disable(self.sync.sync)()  # a helper dynamo does not trace (DeBERTa's TorchScript)
        return self.block(x)


@pytest.mark.parametrize("traced", [False, True])
def test_compile_and_graph_is_refused_before_its_compile_for_a_sync_at_a_graph_break_or_inside_the_graph(
    monkeypatch, traced
):
    """Left to their compile, both cost it for nothing on an H200: HF DeBERTa-v2's sync inside its traced graph
    hid one in a TorchScript helper behind it, which failed the capture after 59 s of compile; and HF Bloom's
    network, whose only sync was inside its traced graph, still failed FuseCallback's capture after 30 s."""
    torch._dynamo.reset()
    SYNCS.append(FakeSyncDebug(monkeypatch))
    try:
        net = Syncing(SYNCS[-1], traced)
        plan = Whole(Setting([], ("net", net), CompileOptions(backend="eager"), CUDA), None, graph=True)
        reason = plan.unfit(lambda: net(torch.randn(2, 4)).sum().backward())
    finally:
        SYNCS.pop()
        torch._dynamo.reset()
    assert reason == ("it syncs with the host even compiled, which no capture survives "
                      "(RuntimeError: called a synchronizing CUDA operation)")  # fmt: skip
    assert "_compiled_call_impl" not in vars(net) or net._compiled_call_impl is None, "the check's compile is gone"


class HalfRun(nn.Module):
    """A network whose forward syncs half way, after its first layer built part of the autograd graph."""

    def __init__(self, sync: FakeSyncDebug) -> None:
        super().__init__()
        self.first, self.second, self.sync = nn.Linear(4, 4), nn.Linear(4, 4), sync

    def forward(self, x):
        h = self.first(x)
        self.sync.sync()
        return self.second(h)


@pytest.mark.parametrize("plan", ["regions+graph", "compile+graph"])
def test_a_host_sync_check_that_raised_half_way_leaves_no_autograd_graph_alive(monkeypatch, plan):
    """Where the check returned the sync's error rather than its description (5c35912 to 435c0c9), the error's
    reference cycle kept the half-built graph until Python's next collection, holding autograd nodes of the
    parameters made on the default stream, which a later capture on its own stream may meet (torch warned of "an
    AccumulateGrad node created prior to the current iteration being kept alive" when HF Bloom's capture failed
    after this check on an H200)."""
    torch._dynamo.reset()
    sync = FakeSyncDebug(monkeypatch)
    net = HalfRun(sync)
    setting = Setting([Region("second", net.second)], ("net", net), CompileOptions(backend="eager"), CUDA)
    candidate = Regions(setting, graph=True) if plan == "regions+graph" else Whole(setting, None, graph=True)
    gc.disable()  # only references count: what a collection would free later is what the capture meets
    try:
        reason = candidate.unfit(lambda: net(torch.randn(2, 4)).sum().backward())
        alive = [o for o in gc.get_objects() if type(o) is torch.Tensor and o.grad_fn is not None]
    finally:
        gc.enable()
        torch._dynamo.reset()
    assert reason is not None and "synchronizing" in reason
    assert alive == []


def test_each_region_replays_its_own_graph_whatever_ran_before_it(monkeypatch):
    """``regions+graphs``: a graph per region, captured at its first call and replayed at each later one, whichever
    of the other regions ran; the gradients are eager's at every step (captures faked: the replay computes as the
    graph would, writing the parameters' gradients into its own buffers)."""
    graphed = partial(GraphedModule, capture=grad_buffer_capture, on_device=lambda tensor: True)
    monkeypatch.setattr(plan_module, "GraphedModule", graphed)
    torch.manual_seed(0)
    net = BlockNet(layer_drop=0.4)  # a block's output is the next one's input
    twin = copy.deepcopy(net)  # the same steps without any plan
    regions = [Region(f"blocks.{i}", block) for i, block in enumerate(net.blocks)]
    plan = RegionGraphs(Setting(regions, ("net", net), CompileOptions(backend="eager"), CUDA))
    plan.install()
    ran = 0
    for step in range(8):
        for graph in plan.graphs():
            graph.begin_step(grads_zeroed_after_forward=False)
        x = torch.randn(5, 8)
        for model in (net, twin):
            model.zero_grad()
            torch.manual_seed(step)  # the same blocks skipped in both
            model(x).square().mean().backward()
        ran += sum(block.norm.weight.grad is not None for block in twin.blocks)
        for got, want in zip(net.parameters(), twin.parameters()):
            torch.testing.assert_close(got.grad, want.grad)
    assert ran < 3 * 8, "some steps skipped a block"
    graphs = plan.graphs()
    assert [graph.name for graph in graphs] == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(graph.captured for graph in graphs) and sum(graph.replays for graph in graphs) == ran
    assert plan.failure is None and plan.graphs_line() == f"graphs: 3 of 3 regions captured, {ran} replays"
    plan.uninstall()
    assert all(compat.compiled_call_impl(block) is None for block in net.blocks)


def test_a_region_whose_capture_failed_spares_the_regions_of_its_class_their_attempts(monkeypatch):
    """The regions of one class run the same code: where the first one's capture fails, the others' would fail
    alike (each attempt a probe and a cleanup), so they run without a graph unattempted; a region of another class
    still tries its own."""
    tried: list[int] = []

    def failing_capture(flat, tensors, num_warmup_iters):
        tried.append(len(tensors))
        raise RuntimeError("operation not permitted when stream is capturing")

    graphed = partial(GraphedModule, capture=failing_capture, on_device=lambda tensor: True)
    monkeypatch.setattr(plan_module, "GraphedModule", graphed)
    net = BlockNet()  # no block skipped: blocks.0 is the first tried
    regions = [Region(f"blocks.{i}", block) for i, block in enumerate(net.blocks)] + [Region("head", net.head)]
    plan = RegionGraphs(Setting(regions, ("net", net), CompileOptions(backend="eager"), CUDA))
    plan.install()
    with pytest.warns(UserWarning, match="no CUDA graph over") as warned:
        for _ in range(2):
            net(torch.randn(5, 8)).square().mean().backward()
    assert len(tried) == 2, "blocks.0, then head; not blocks.1 nor blocks.2"
    assert len(warned) == 2
    assert "a region of its class" in plan.graphs()[1].disabled_reason
    assert plan.failure.startswith("no graph: the capture failed")
    plan.uninstall()


def test_graphs_over_a_model_whose_parameters_got_new_storage_between_epochs_are_captured_again(caplog):
    """Lightning's ModelPruning renames each pruned ``weight`` (``weight_orig`` and a mask buffer) and, with its
    lottery-ticket reset, gives the parameters new storage (``param.data = ...``) at an epoch's end; a graph
    captured before replays the old storage, and on an H200 such a fit's losses went to NaN. At the next epoch's
    first step the plan's graph and the optimizer's are dropped, to be captured again; said once."""
    net, optimizer, optimizer_graph, _, _ = default_adamw_under_graph()
    log: list[int] = []
    graphed = GraphedModule("net", net, capture=fake_capture(log), on_device=lambda t: True)
    graphed.install()
    graphed.capture_allowed = True
    fit = FitState(plan=Plan(), optimizer_graphs=[optimizer_graph])
    fit.plan.graph, fit.hooks.state = graphed, StateWatch(net)

    def step() -> None:
        optimizer.zero_grad()
        net(torch.ones(4, 2)).sum().backward()
        optimizer.step()

    for _ in range(3):
        step()
    assert graphed.captured and optimizer_graph.captured and log == [1]
    fit.renew_graphs_if_model_changed()  # nothing changed: the graphs stay
    assert graphed.captured and optimizer_graph.captured
    net.weight.data = net.weight.data.clone()  # the lottery-ticket reset's new storage
    with caplog.at_level("INFO"):
        caplog.clear()
        fit.renew_graphs_if_model_changed()
        fit.renew_graphs_if_model_changed()
    assert not graphed.captured and not optimizer_graph.captured and fit.renewed_graphs == 1
    said = [r.message for r in caplog.records if "given new storage" in r.message]
    assert len(said) == 1 and "captured again" in said[0]
    for _ in range(3):
        step()
    assert graphed.captured and optimizer_graph.captured and log == [1, 1], "captured over the new storage"
    assert optimizer_graph.disabled_reason is None
    graphed.disable("the capture failed (RuntimeError: called a synchronizing CUDA operation)")  # as under SWA's BN
    assert f"graph: {graphed.replays} replays, then none (the capture failed" in fit.what_ran()


@pytest.mark.parametrize(("cached", "replays", "forgotten"), [(True, 0, True), (True, 5, False), (False, 0, False)])
def test_a_cached_plan_whose_graph_was_refused_before_its_first_replay_is_measured_again(tmp_path, cached, replays,
                                                                                         forgotten):  # fmt: skip
    """On an H200, HF Whisper's warm fits lost the graph their cold fit's search had captured, and ran 3.6x slower
    than that trial timed: the next run measures again. A graph that replayed, or a decision this fit measured,
    stays."""
    from lightning_fuse.choice import forget_a_cached_plan_without_its_graph
    from lightning_fuse.decision import Decision, DecisionFile, Trial

    stored = DecisionFile(tmp_path, "key")
    stored.store(Decision("regions+graph", [Trial("regions+graph", 8.1, "chosen")]))
    fit = FitState()
    fit.decision, fit.decision_file = stored.load(["regions+graph"]), stored
    fit.decision.cached = cached
    fit.plan = plan_module.Plan()
    fit.plan.graph = GraphedModule("model", nn.Linear(2, 2))
    fit.plan.graph.replays = replays
    fit.plan.graph.disable("the capture failed (AcceleratorError: CUDA error)", warn=False)
    forget_a_cached_plan_without_its_graph(fit)
    assert stored.path.exists() is not forgotten
