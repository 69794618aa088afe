import pytest
import torch

from lightning_fuse.graphs import GraphedModule, graph_target
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
