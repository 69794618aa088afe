"""A module's graph replayed as a CUDA graph replays: what one replay writes, the next overwrites.

:func:`one_memory_capture` fakes a capture on CPU through the real :class:`~lightning_fuse.replay.Replay`: every
replay writes the same output buffers, and the backward reads the activations of the last forward. Found on an
H200: a FixMatch-style step (two training calls of the network, one backward) trained on the second call's
activations twice, and its loss rose where eager's fell.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_fuse import graph_slots
from lightning_fuse.graphs import HELD
from lightning_fuse.replay import Replay
from tests.faults import graphed_with_twin


def one_memory_capture(flat, tensors, num_warmup_iters):
    """A CPU stand-in for :func:`~lightning_fuse.replay.capture`: one memory for the outputs, one for the
    activations, both rewritten by every replay."""
    params = list(flat.trained)
    activations = {}
    with torch.no_grad():
        outputs = [out.clone() for out in flat(*tensors)]
    grad_outputs = [torch.zeros_like(out) for out in outputs]
    grads = [torch.zeros_like(p) for p in params]

    def forward():
        with torch.enable_grad():
            activations["outputs"] = flat(*tensors)
        for buffer, out in zip(outputs, activations["outputs"]):
            buffer.copy_(out.detach())

    def backward():
        computed = torch.autograd.grad(activations["outputs"], params, grad_outputs, allow_unused=True)
        for buffer, grad in zip(grads, computed):
            buffer.copy_(grad)

    return Replay(forward, backward, tensors, outputs, grad_outputs, grads, params)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.body(x)


def graphed_twins():
    """A network whose calls replay through a graph of :func:`one_memory_capture`, and its eager twin."""
    torch.manual_seed(0)
    net = Net()
    return net, *graphed_with_twin(net, one_memory_capture)


def views_step(model, x, views: int) -> torch.Tensor:
    """A consistency loss over ``views`` noisy views of a batch: each view is a training call, one backward."""
    model.zero_grad(set_to_none=True)
    outs = [model(x + 0.1 * i) for i in range(views)]
    loss = sum(F.mse_loss(out, outs[0].detach() * 0.5) + out.pow(2).mean() for out in outs)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("views", [2, 3])
def test_calls_made_again_before_the_backward_each_keep_their_own_outputs_and_gradients(views, caplog):
    net, twin, graphed = graphed_twins()
    for step in range(3):
        x = torch.randn(4, 6)
        graphed.begin_step(grads_zeroed_after_forward=False)
        loss, want = views_step(net, x, views), views_step(twin, x, views)
        torch.testing.assert_close(loss, want)
        for got, expected in zip(net.parameters(), twin.parameters()):
            torch.testing.assert_close(got.grad, expected.grad)
    assert graphed.graphs == graph_slots.SLOTS  # a third view runs without a graph: each slot awaits its backward
    assert graphed.replays == 3 * graph_slots.SLOTS
    assert "parameters that train" not in caplog.text  # a third view is not a change of the trainable set


def test_a_call_whose_backward_never_came_frees_its_slot_at_the_next_step():
    net, _, graphed = graphed_twins()
    for _ in range(3):
        graphed.begin_step(grads_zeroed_after_forward=False)
        net(torch.randn(4, 6))  # a forward under grad whose output no loss uses
    assert graphed.graphs == 1 and graphed.replays == 3


def train_step(model, x, keep: list) -> torch.Tensor:
    """One step of a training loop; ``keep`` gets what the step keeps of its output."""
    model.zero_grad(set_to_none=True)
    out = model(x)
    keep.append(out.detach())
    loss = out.pow(2).mean()
    loss.backward()
    return loss.detach().clone()  # what Lightning keeps of a step: a copy of its loss


def test_outputs_kept_past_their_step_end_the_graph_before_a_replay_overwrites_them(recwarn):
    net, twin, graphed = graphed_twins()
    kept, want = [], []
    for step in range(3):
        x = torch.randn(4, 6)
        graphed.begin_step(grads_zeroed_after_forward=False)
        train_step(net, x, kept)  # as Lightning's docs keep a step's predictions for the epoch's end
        train_step(twin, x, want)
    for got, expected in zip(kept, want):
        torch.testing.assert_close(got, expected)
    assert graphed.replays == 1 and not graphed.captured
    assert graphed.describe() == f"graph: 1 replays, then none ({HELD})"
    assert [str(w.message) for w in recwarn if "no CUDA graph" in str(w.message)] == [
        f"FuseCallback: no CUDA graph over 'net': {HELD}. It runs without one."
    ]


def test_outputs_used_within_their_step_keep_the_graph():
    net, twin, graphed = graphed_twins()
    for step in range(4):
        x = torch.randn(4, 6)
        graphed.begin_step(grads_zeroed_after_forward=False)
        torch.testing.assert_close(train_step(net, x, []), train_step(twin, x, []))
        for got, expected in zip(net.parameters(), twin.parameters()):
            torch.testing.assert_close(got.grad, expected.grad)
    assert graphed.captured and graphed.replays == 4


def test_outputs_sharing_memory_are_counted_once_each_and_held_only_when_kept():
    slots = graph_slots.OutputSlots()
    key = ("call", 0)

    def replay(keep: list) -> None:
        base = torch.ones(4) * 2  # a model returning its logits and a view of them
        slots.replayed(key, (base, base[:2]))
        keep.append(base[:1])

    replay([])
    slots.begin_step()
    assert not slots.held(key)
    kept: list = []
    replay(kept)
    slots.begin_step()
    assert slots.held(key)
    slots.replayed(key, (torch.ones(1),))
    assert not slots.held(key)  # replayed in this step already: only a step's first replay looks


def chunked_step(model, chunks, keep: list, copies: bool) -> None:
    """Manual optimization a chunk at a time: each chunk's call and its backward, what it returned kept in ``keep``
    (or copies of it)."""
    model.zero_grad(set_to_none=True)
    for chunk in chunks:
        out = model(chunk)
        out.pow(2).mean().backward()
        keep.append(out.detach().clone() if copies else out.detach())


@pytest.mark.parametrize("copies", [False, True])
def test_a_call_after_its_own_backward_never_writes_over_outputs_still_held_in_the_step(copies, caplog):
    net, twin, graphed = graphed_twins()
    for step in range(2):
        chunks = list(torch.randn(4, 3, 6))
        graphed.begin_step(grads_zeroed_after_forward=False)
        got, want = [], []
        chunked_step(net, chunks, got, copies)
        chunked_step(twin, chunks, want, copies)
        torch.testing.assert_close(torch.stack(got), torch.stack(want))
        for a, b in zip(net.parameters(), twin.parameters()):
            torch.testing.assert_close(a.grad, b.grad)
        del got
    if copies:  # the loop's variable alone holds a call's outputs at the next call: the two slots take turns
        assert graphed.replays == 8 and graphed.graphs == 2 and "still needed" not in caplog.text
    else:  # once both slots' outputs are kept, calls run without a graph, said once
        assert graphed.replays == 4 and caplog.text.count("still needed") == 1
