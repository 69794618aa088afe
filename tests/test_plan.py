import pytest
import torch

from lightning_fuse.graphs import GraphedModule, graph_target, release_capture_graph
from lightning_fuse.plan import choose_plan
from tests.toy import ToyTask

CUDA = torch.device("cuda", 0)


def test_cpu_never_graphs():
    plan = choose_plan("auto", "auto", torch.device("cpu"))
    assert not plan.cuda_graph and plan.compile_mode is None and plan.dynamic is None
    assert not choose_plan("auto", True, torch.device("cpu")).cuda_graph


def test_cuda_defaults_to_a_graph_over_static_compiled_regions():
    plan = choose_plan("auto", "auto", CUDA)
    assert plan.cuda_graph and plan.dynamic is False and plan.compile_mode is None
    assert "graph: on" in plan.describe()


def test_explicit_settings_win():
    assert not choose_plan("auto", False, CUDA).cuda_graph
    assert choose_plan("auto", True, CUDA, dynamic=True).dynamic is True
    plan = choose_plan("reduce-overhead", "auto", CUDA)
    assert plan.compile_mode == "reduce-overhead" and not plan.cuda_graph


def test_multi_process_runs_do_not_graph_and_refuse_an_explicit_graph():
    assert not choose_plan("auto", "auto", CUDA, world_size=2).cuda_graph
    with pytest.raises(ValueError, match="cuda_graph=True runs in a single process"):
        choose_plan("auto", True, CUDA, world_size=2)


def test_graph_target_is_the_largest_child_and_cpu_calls_pass_through():
    task = ToyTask()
    name, module = graph_target(task)
    assert name == "model" and module is task.model
    graphed = GraphedModule(name, module)
    graphed.install()
    graphed.capture_allowed = True
    x = torch.randn(3, 8)
    torch.testing.assert_close(task.model(x), type(task.model).forward(task.model, x))
    assert graphed.replays == 0 and graphed._graphed is None  # CPU tensors are never captured
    graphed.uninstall()
    assert "forward" not in task.model.__dict__


def test_graph_target_needs_a_child_network():
    with pytest.raises(ValueError, match="cuda_graph needs the LightningModule to hold its network"):
        graph_target(torch.nn.ReLU())


def test_graph_dispatch_sits_outside_a_compiled_whole_network(monkeypatch):
    """The graph target may itself be a compiled region ("full"): capture and replay must still happen."""
    from lightning_fuse.compiler import CompileOptions, compile_regions, uncompile_regions
    from lightning_fuse.regions import resolve_regions

    captured, replayed = [], []

    def fake_make_graphed_callables(module, args, num_warmup_iters):
        module(*args)  # warmup calls go through the module: they must reach the compiled region, not recurse
        captured.append(torch.compiler.is_compiling())

        def graphed(*a):
            replayed.append(1)
            return type(module).forward(module, *a)

        module.forward = graphed
        return module

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake_make_graphed_callables)
    monkeypatch.setattr(GraphedModule, "_eligible", lambda self, args: self.module.training and
                        torch.is_grad_enabled() and not torch.compiler.is_compiling() and
                        torch._dynamo.eval_frame._stance.stance != "force_eager")
    task = ToyTask()
    runners = compile_regions(resolve_regions(task, "full"), CompileOptions(backend="eager"))
    graphed = GraphedModule(*graph_target(task))
    graphed.install()
    x = torch.randn(4, 8)
    task.model(x)  # before capture is allowed: the compiled region runs
    graphed.capture_allowed = True
    task.model(x)
    assert captured == [False] and graphed.captured_during_last_call
    task.model(x)
    assert graphed.replays == 2 and len(replayed) == 2
    with torch.compiler.set_stance("force_eager"):
        task.model(x)
    task.model(torch.randn(3, 8))  # another shape: the compiled region, not the graph
    task.model.eval()
    task.model(x)
    assert graphed.replays == 2
    graphed.uninstall()
    assert task.model._compiled_call_impl is runners[0] and "forward" not in task.model.__dict__
    uncompile_regions(runners)
    assert task.model._compiled_call_impl is None


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
