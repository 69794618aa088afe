"""A module's forward and backward as two CUDA graphs, replayed as one autograd node that writes the parameters'
gradients itself.

:func:`torch.cuda.make_graphed_callables` hands the parameters to its autograd node as inputs, so that autograd
accumulates their gradients. Every replay then pays autograd's bookkeeping per parameter on the host: an edge each
in the forward, an ``AccumulateGrad`` node each in the backward. At small batch the host is the step's limit
(ResNet-18 has 62 parameters, a GPT of 8 layers 101). :class:`Replay` takes only the call's tensors, and its
backward does what those nodes would: a parameter without a gradient gets the graph's gradient buffer (autograd
would keep that very buffer too), the others get it added, in one launch.

Nothing else may watch the gradients arrive for that: :func:`capture` writes them itself only in a single process
(DDP's reducer and FSDP hook autograd's accumulation) where no parameter has a gradient hook, and otherwise
captures with ``make_graphed_callables``. Either way the capture's matrix products get cuBLAS workspaces in the
graph's own memory (:func:`own_cublas_workspaces`): a workspace allocated before the capture is freed under the graph
when torch's cudagraph trees record (a ``reduce-overhead`` trial), and the graph's next replay faults. What a capture
leaves behind is cleared here too: the autograd graph its outputs keep alive (:func:`release_capture_graph`), and,
after a failed capture, its stream left current and a CUDA generator that still counts it as under way
(:func:`capture_failure_undone`). And a failure of torch's cudagraph trees is told from one of the compiled code
(:func:`raised_in_cudagraph_trees`).

Example::

    >>> import torch
    >>> lin = torch.nn.Linear(2, 1)
    >>> writes_gradients_itself([lin.weight, lin.bias])  # one process, no hooks
    True
    >>> handle = lin.bias.register_hook(lambda grad: grad * 2)
    >>> writes_gradients_itself([lin.weight, lin.bias])
    False
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import torch
from torch import nn

from lightning_fuse import compat


def writes_gradients_itself(params: Sequence[nn.Parameter]) -> bool:
    """Whether a replay may write ``params``' gradients itself: one process, and no gradient hook on any of them."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return not distributed and not any(compat.has_gradient_hooks(p) for p in params)


def capture(module: nn.Module, sample_args: tuple[torch.Tensor, ...], num_warmup_iters: int = 3) -> Callable[..., Any]:
    """``module(*sample_args)``'s forward and backward captured as CUDA graphs (warmed up ``num_warmup_iters`` times
    on a side stream first, as ``make_graphed_callables`` does, and captured with cuBLAS workspaces of their own:
    :func:`own_cublas_workspaces`); returns the replay, called as the module.

    Raises:
        RuntimeError: Under autocast with its cache on (the graph would keep the capture's casts of the weights).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    if not writes_gradients_itself(params):
        with own_cublas_workspaces(), capture_failure_undone():
            return torch.cuda.make_graphed_callables(module, sample_args, num_warmup_iters=num_warmup_iters)
    if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
        raise RuntimeError("a CUDA graph cannot be captured under autocast with cache_enabled=True")
    surface = [t for t in sample_args if t.requires_grad] + params
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(num_warmup_iters):
            outputs = module(*sample_args)
            _gradients(outputs, surface, [torch.empty_like(o) if o.requires_grad else None for o in outputs])
    torch.cuda.synchronize()
    forward, backward, pool = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    with own_cublas_workspaces(), capture_failure_undone():  # own: not the workspace of the warmup
        with torch.cuda.graph(forward, stream=stream, pool=pool):
            outputs = module(*sample_args)
        grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in outputs]
        with torch.cuda.graph(backward, stream=stream, pool=pool):
            grads = _gradients(outputs, surface, grad_outputs)
    return Replay(forward.replay, backward.replay, sample_args, outputs, grad_outputs, grads, params)


def release_capture_graph(graphed: Any) -> int:
    """Free the autograd graph of the capture, which the graphed forward's closures keep alive; returns how many
    captured outputs were detached.

    ``make_graphed_callables`` keeps its captured forward outputs, and with them the autograd graph of the capture,
    including each parameter's ``AccumulateGrad`` node, made on its side stream. A node accumulates on the stream it
    was made on, so while it lives every backward accumulates each gradient on that side stream, with a
    cross-stream sync per parameter. The replay never uses that graph: detached, the nodes are freed and the next
    forward makes new ones on its own stream.

    Example::

        >>> def capture():
        ...     out = (torch.ones(2, requires_grad=True) * 2,)
        ...     return (lambda: out), out
        >>> replay, out = capture()
        >>> release_capture_graph(replay), out[0].grad_fn
        (1, None)
    """
    detached, seen, todo = 0, set(), [graphed]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.grad_fn is not None and not compat.is_view(obj):
                obj.detach_()
                detached += 1
        elif isinstance(obj, (tuple, list)):
            todo.extend(obj)
        elif isinstance(obj, staticmethod):
            todo.append(obj.__func__)
        elif isinstance(obj, type) and issubclass(obj, torch.autograd.Function):
            todo.extend(vars(obj).values())
        elif inspect.isfunction(obj):
            todo.extend(cell.cell_contents for cell in obj.__closure__ or () if _filled(cell))
    return detached


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


@contextmanager
def capture_failure_undone() -> Iterator[None]:
    """If the block (a CUDA graph capture) raises, undo what the failed capture left behind before the error goes on:
    the current stream, and torch's CUDA generators (:func:`release_generators`).

    ``torch.cuda.graph`` makes its capture stream current and, on exit, calls ``capture_end`` before it makes the
    previous stream current again; when ``capture_end`` raises ("operation failed due to a previous error during
    capture"), the capture stream stays current for the rest of the process. Every later step then runs on that side
    stream, unordered with anything on the stream the training loop began on: on an H200, DeiT's steps after its
    failed ``regions+graph`` trial read 4.0 ms on events of that stream against 15.8 ms of work
    (``benchmarks/RESULTS.md``).

    Example::

        >>> with capture_failure_undone():
        ...     pass
    """
    stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None
    try:
        yield
    except BaseException:
        release_generators()
        if stream is not None:
            torch.cuda.set_stream(stream)  # after the generators: their release is a capture too
        raise


def release_generators() -> None:
    """End the capture that torch's default CUDA generator still counts as under way after a capture failed at its
    end (no-op where CUDA is not initialised).

    ``CUDAGraph.capture_end`` raises before it tells the generators registered with the graph that the capture is
    over ("operation failed due to a previous error during capture"). From then on every random op outside a graph
    raises "Offset increment outside graph capture encountered unexpectedly": dropout in the eager fallback, the
    next candidate's compile. A capture that succeeds tells them: one of a single fill. Nothing public resets the
    flag otherwise (``set_rng_state`` does not). A device left in error fails this capture too, silently: its next
    operation reports that error anyway. Inside a capture (a region that failed within the graph over the network)
    it waits for that capture's end.

    Example::

        >>> release_generators()  # on a CPU: nothing to end
    """
    if not torch.cuda.is_initialized() or torch.cuda.is_current_stream_capturing():
        return
    with suppress(RuntimeError):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.zeros(1, device="cuda")


def raised_in_cudagraph_trees(err: BaseException) -> bool:
    """Whether ``err``, or an error it was raised from, came through torch's cudagraph trees: a recording or replay of
    theirs failed (a capture that met a host sync, a recording that "observed an input tensor deallocate"), where the
    same compile without graphs may still run; not an error of the compiled code alone, such as an input inductor
    cannot lower, which would fail that compile too.

    Example::

        >>> raised_in_cudagraph_trees(RuntimeError("an input inductor cannot lower"))
        False
    """
    trees = compat.cudagraph_trees_module()
    while err is not None and trees is not None:
        if any(frame.f_globals.get("__name__") == trees for frame, _ in traceback.walk_tb(err.__traceback__)):
            return True
        err = err.__cause__ or err.__context__
    return False


@contextmanager
def own_cublas_workspaces() -> Iterator[None]:
    """The block's matrix products allocate their cuBLAS workspaces anew: inside a capture, in the graph's own
    memory pool (why: :func:`~lightning_fuse.compat.clear_cublas_workspaces`); none of them outlives the block.

    Example::

        >>> with own_cublas_workspaces():
        ...     pass
    """
    compat.clear_cublas_workspaces()
    try:
        yield
    finally:
        compat.clear_cublas_workspaces()


def _gradients(outputs: Sequence[torch.Tensor], inputs: list[torch.Tensor],
               grad_outputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:  # fmt: skip
    """The gradients of ``inputs`` (``None`` where unused) given those of ``outputs`` (``None``: needs none)."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if g is not None]
    if not pairs or not inputs:
        return [None] * len(inputs)
    return list(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True))


class Replay:
    """Replays a captured forward and backward as one autograd node that writes the parameters' gradients itself.

    Args:
        forward: Replays the forward's graph.
        backward: Replays the backward's graph.
        inputs: The graph's input buffers (each call copies its tensors into them).
        outputs: The forward's output buffers.
        grad_outputs: The backward's buffers for the outputs' gradients (``None``: an output that needs none).
        grads: The backward's gradient buffers: first those of the inputs that require a gradient, then those of
            ``params`` (``None``: unused).
        params: The parameters that train.

    Example::

        >>> x, w = torch.ones(2), torch.nn.Parameter(torch.full((2,), 3.0))
        >>> out, grad_out, grad_w = torch.zeros(2), torch.zeros(2), torch.zeros(2)
        >>> replay = Replay(lambda: out.copy_(x * w.detach()), lambda: grad_w.copy_(grad_out * x),
        ...                 (x,), [out], [grad_out], [grad_w], [w])
        >>> (y,) = replay(torch.full((2,), 2.0))
        >>> y.sum().backward()
        >>> w.grad.tolist(), w.grad is grad_w  # the graph's buffer, as autograd would keep it
        ([2.0, 2.0], True)
    """

    def __init__(self, forward: Callable[[], Any], backward: Callable[[], Any], inputs: Sequence[torch.Tensor],
                 outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None],
                 grads: Sequence[torch.Tensor | None], params: Sequence[nn.Parameter]) -> None:  # fmt: skip
        self._forward, self._backward = forward, backward
        self._inputs = tuple(inputs)
        self._outputs = tuple(o.detach() for o in outputs)  # the capture's autograd graph goes with the originals
        self._grad_outputs = tuple(grad_outputs)
        grads_left = iter(grads)
        self._input_grads = tuple(next(grads_left) if t.requires_grad else None for t in inputs)
        self._param_grads = [(p, g) for p, g in zip(params, grads_left, strict=True) if g is not None]
        device = self._outputs[0].device if self._outputs else None
        self._anchor = torch.empty(0, device=device, requires_grad=True)  # makes autograd call the backward

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _ReplayNode.apply(self, self._anchor, *inputs)

    def run_forward(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        for static, given in zip(self._inputs, inputs, strict=True):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        self._forward()
        return tuple(o.detach() for o in self._outputs)

    def run_backward(self, grad_outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        """Replay the backward, write the parameters' gradients; returns the inputs' gradients."""
        for static, given in zip(self._grad_outputs, grad_outputs, strict=True):
            if static is not None and static.data_ptr() != given.data_ptr():
                static.copy_(given)
        self._backward()
        accumulate(self._param_grads)
        return tuple(None if g is None else g.detach() for g in self._input_grads)


def accumulate(param_grads: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """What autograd's ``AccumulateGrad`` does with each new gradient, for all at once: a parameter without a
    gradient keeps the new one (a copy in the parameter's own layout where the two differ), the others add it in
    one launch.

    Example::

        >>> a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
        >>> a.grad = torch.ones(2); new = torch.full((2,), 5.0)
        >>> accumulate([(a, new), (b, new)])
        >>> a.grad.tolist(), b.grad is new
        ([6.0, 6.0], True)
    """
    held, added = [], []
    for param, grad in param_grads:
        if param.grad is not None:
            held.append(param.grad)
            added.append(grad)
        elif grad.stride() == param.stride():
            param.grad = grad
        else:
            param.grad = torch.empty_strided(param.shape, param.stride(), dtype=grad.dtype,
                                             device=grad.device).copy_(grad)  # fmt: skip
    if held:
        compat.add_tensors(held, added)


class _ReplayNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, replay: Replay, anchor: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.replay = replay
        return replay.run_forward(inputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, None, *ctx.replay.run_backward(grad_outputs))
