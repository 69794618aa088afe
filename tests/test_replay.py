"""The replay that writes the parameters' gradients itself (lightning_fuse/replay.py), on CPU: its "graphs" are
closures that recompute into the same static buffers a captured graph would write, scribbling over the gradient
buffers in the forward as a shared memory pool may."""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext

import pytest
import torch
from torch import nn

from lightning_fuse import replay
from lightning_fuse.optimizer_graph import cuda_capture
from lightning_fuse.replay import Replay, accumulate, writes_gradients_itself
from tests.faults import graphed_with_twin, raise_as_torchs_trees


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.unused = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.second(self.first(x).relu()), ids * 2


def closure_capture(module: nn.Module, sample_args: tuple[torch.Tensor, ...], num_warmup_iters: int = 3) -> Replay:
    """A :class:`Replay` of ``module`` whose forward and backward "graphs" recompute from the static buffers."""
    params = [p for p in module.parameters() if p.requires_grad]
    inputs = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in sample_args)
    first = module(*inputs)
    outputs = [torch.empty_like(o) for o in first]
    grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in first]
    surface = [t for t in inputs if t.requires_grad] + params
    grads = [torch.zeros_like(t) for t in surface]
    live: list[torch.Tensor] = []

    def forward() -> None:
        for buffer in grads:
            buffer.fill_(1e6)  # the forward's temporaries, where the pool put a gradient buffer
        with torch.enable_grad():
            live[:] = module(*inputs)
        for static, out in zip(outputs, live):
            static.copy_(out.detach())

    def backward() -> None:
        pairs = [(out, g) for out, g in zip(live, grad_outputs) if g is not None]
        with torch.enable_grad():
            new = torch.autograd.grad([o for o, _ in pairs], surface, [g for _, g in pairs], allow_unused=True)
        for buffer, grad in zip(grads, new):
            buffer.copy_(grad) if grad is not None else buffer.zero_()

    unused = {id(p) for p in module.unused.parameters()} if hasattr(module, "unused") else set()
    buffers = [None if id(t) in unused else g for t, g in zip(surface, grads)]
    return Replay(forward, backward, inputs, outputs, grad_outputs, buffers, params)


def test_training_through_the_replay_gives_eager_outputs_and_gradients():
    """Zeroed to ``None`` between steps, as Lightning does: a gradient held across replays (accumulated, zeroed in
    place) lives in the graph's buffer, which GraphedModule copies out first (the last test)."""
    torch.manual_seed(0)
    net = Net()
    twin = copy.deepcopy(net)
    x, ids = torch.randn(3, 4, requires_grad=True), torch.arange(3)
    graphed = closure_capture(net, (x, ids))
    for step in range(3):
        for model in (net, twin):
            model.zero_grad(set_to_none=True)
        batch = torch.randn(3, 4)
        out, doubled = graphed(batch, ids + step)
        want, want_doubled = twin(batch, ids + step)
        torch.testing.assert_close(out, want)
        assert torch.equal(doubled, want_doubled) and not doubled.requires_grad
        out.square().sum().backward()
        want.square().sum().backward()
        for got, expected in zip(net.parameters(), twin.parameters()):
            if expected.grad is None:
                assert got.grad is None, "an unused parameter gets no gradient, as in eager"
            else:
                torch.testing.assert_close(got.grad, expected.grad)


def test_an_input_that_requires_a_gradient_gets_it_through_autograd():
    torch.manual_seed(0)
    net = Net()
    x, ids = torch.randn(3, 4, requires_grad=True), torch.arange(3)
    graphed = closure_capture(net, (x, ids))
    leaf = torch.randn(3, 4, requires_grad=True)
    graphed(leaf * 1.0, ids)[0].sum().backward()
    twin_leaf = leaf.detach().clone().requires_grad_()
    net(twin_leaf, ids)[0].sum().backward()
    torch.testing.assert_close(leaf.grad, twin_leaf.grad)


def test_a_new_gradient_takes_the_parameters_own_layout_where_the_buffers_differs():
    param = nn.Parameter(torch.zeros(2, 3).t())  # strides (1, 3)
    new = torch.arange(6.0).reshape(3, 2)  # strides (2, 1)
    accumulate([(param, new)])
    assert param.grad.stride() == param.stride() and torch.equal(param.grad, new) and param.grad is not new


def test_with_a_hook_or_several_processes_the_capture_is_torchs_own(monkeypatch):
    net, events = nn.Linear(2, 2), []
    monkeypatch.setattr(replay.compat, "clear_cublas_workspaces", lambda: events.append("clear"))
    monkeypatch.setattr(torch.cuda, "make_graphed_callables",
                        lambda module, args, num_warmup_iters: events.append("torch's") or "torch's")  # fmt: skip
    net.weight.register_hook(lambda grad: grad)
    assert not writes_gradients_itself(list(net.parameters()))
    assert replay.capture(net, (torch.ones(1, 2),)) == "torch's"
    assert events == ["clear", "torch's", "clear"]  # its captures get cuBLAS workspaces of their own too
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert not writes_gradients_itself([nn.Parameter(torch.ones(1))])


class FakeGraph:
    def replay(self) -> None:
        pass


def fake_cuda(monkeypatch, graph, **more) -> None:
    """``torch.cuda`` as a capture uses it, on a CPU: no-op syncs, streams, graphs and pool; ``graph`` stands for
    ``torch.cuda.graph`` (the capture's context), ``more`` for further functions."""
    fakes = {"synchronize": lambda: None, "Stream": object, "stream": lambda stream: nullcontext(),
             "CUDAGraph": FakeGraph, "graph_pool_handle": lambda: (0, 1), "graph": graph, **more}  # fmt: skip
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)


def test_the_capture_gets_cublas_workspaces_of_its_own_not_the_warmups(monkeypatch):
    """cuBLAS keeps a workspace per stream. The one the warmup allocated on the capture's stream is ordinary memory,
    which torch's cudagraph trees free under the graph when they record (the H100 fault: "unspecified launch
    failure" at the next replay); dropped between the warmup and the capture, it is allocated in the graph's pool."""
    net, events = nn.Linear(2, 2), []
    net.register_forward_hook(lambda *_: events.append("forward"))

    @contextmanager
    def graph(cuda_graph: FakeGraph, stream: object = None, pool: object = None):
        events.append("capture")
        yield

    monkeypatch.setattr(replay.compat, "clear_cublas_workspaces", lambda: events.append("clear"))
    fake_cuda(monkeypatch, graph)
    replay.capture(net, (torch.ones(1, 2),), num_warmup_iters=2)
    assert events == ["forward", "forward", "clear", "capture", "forward", "capture", "clear"]


FAILED_CAPTURE = "CUDA error: operation failed due to a previous error during capture"


@contextmanager
def failing_graph(cuda_graph: FakeGraph, stream: object = None, pool: object = None):
    yield
    raise RuntimeError(FAILED_CAPTURE)  # torch.cuda.graph's exit: capture_end raises


def fail_torchs_capture(module: nn.Module, args: tuple, num_warmup_iters: int) -> None:
    raise RuntimeError(FAILED_CAPTURE)


@pytest.mark.parametrize("path", ["own capture", "torch's capture", "optimizer update"])
def test_a_capture_that_fails_undoes_what_it_left_before_its_error_goes_on(monkeypatch, path):
    """A capture that fails at its end leaves two things behind. torch's CUDA generators count it as under way, so
    every later random op outside a graph raises (on an H100: ViT's next candidate failed to compile on "Offset
    increment outside graph capture encountered unexpectedly"). And ``torch.cuda.graph`` leaves its capture stream
    current, so every later step runs there (on an H200: DeiT's steps timed 4.0 ms on the loop's stream against
    15.8 ms of work). Each capture FuseCallback runs hands both back when it fails: the stream last, since the
    generators' release is a capture of its own."""
    net, undone = nn.Linear(2, 2), []
    monkeypatch.setattr(replay, "release_generators", lambda: undone.append("generators"))
    monkeypatch.setattr(replay.compat, "clear_cublas_workspaces", lambda: None)
    fake_cuda(monkeypatch, failing_graph, make_graphed_callables=fail_torchs_capture, is_initialized=lambda: True,
              current_stream=lambda: "the loop's stream", set_stream=undone.append)  # fmt: skip
    if path == "torch's capture":
        net.weight.register_hook(lambda grad: grad)
    with pytest.raises(RuntimeError, match="previous error during capture"):
        if path == "optimizer update":
            cuda_capture(lambda: None)
        else:
            replay.capture(net, (torch.ones(1, 2),), num_warmup_iters=1)
    assert undone == ["generators", "the loop's stream"]


def test_the_generators_are_released_by_a_capture_that_succeeds_and_never_inside_another(monkeypatch):
    captures = []

    @contextmanager
    def graph(cuda_graph: FakeGraph):
        captures.append(cuda_graph)
        yield

    fake_cuda(monkeypatch, graph, is_initialized=lambda: True, is_current_stream_capturing=lambda: True)
    monkeypatch.setattr(torch, "zeros", lambda *shape, device: None)
    replay.release_generators()
    assert captures == []  # the capture under way ends them itself; a second one would fail it
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    replay.release_generators()
    assert len(captures) == 1 and isinstance(captures[0], FakeGraph)


@pytest.mark.parametrize("zero", ["accumulate", "in_place", "after_forward"])
def test_through_graphed_module_kept_gradients_are_never_overwritten_by_the_next_replay(zero):
    """GraphedModule copies held gradients out of the graph's buffers before a replay (held_gradients.py); with the
    replay writing the gradients itself, they still train as eager."""
    torch.manual_seed(0)
    net = Net()
    twin, graphed = graphed_with_twin(net, closure_capture)
    ids = torch.arange(3)
    for i in range(4):
        graphed.grads_zeroed_after_forward = zero == "after_forward" and graphed.captured
        batch = torch.randn(3, 4)
        if zero == "in_place" or (zero == "accumulate" and i % 2 == 0):
            for model in (net, twin):
                model.zero_grad(set_to_none=zero == "accumulate")
        out = net(batch, ids)[0]
        if zero == "after_forward":
            for model in (net, twin):
                model.zero_grad(set_to_none=i % 2 == 0)
        out.square().sum().backward()
        type(twin).forward(twin, batch, ids)[0].square().sum().backward()
        for got, want in zip(net.parameters(), twin.parameters()):
            if want.grad is not None:
                torch.testing.assert_close(got.grad, want.grad)
    assert graphed.replays == 4  # the first call captures, then replays
    graphed.uninstall()


def test_an_error_is_told_to_come_from_torchs_trees_by_their_frames_also_when_wrapped():
    with pytest.raises(RuntimeError) as trees:
        raise_as_torchs_trees("CUDA error: operation not permitted when stream is capturing")
    assert replay.raised_in_cudagraph_trees(trees.value)
    with pytest.raises(ValueError) as wrapped:
        try:
            raise_as_torchs_trees("graph recording observed an input tensor deallocate")
        except RuntimeError as err:
            raise ValueError("a backend's wrapper") from err
    assert replay.raised_in_cudagraph_trees(wrapped.value)
    with pytest.raises(RuntimeError) as compiled:
        raise RuntimeError("LoweringException: an input inductor cannot lower")
    assert not replay.raised_in_cudagraph_trees(compiled.value)
    assert not replay.raised_in_cudagraph_trees(RuntimeError("never raised"))
