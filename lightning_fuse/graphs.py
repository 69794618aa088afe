"""One CUDA graph over a module's forward and backward, replayed whenever the input shapes match the capture.

Small models spend most of a training step launching kernels from the CPU; per-region graphs (``mode=
"reduce-overhead"``) still launch once per region and copy at every region boundary. Capturing the whole module
(compiled regions included) with :func:`torch.cuda.make_graphed_callables` replays the forward and the backward as
one launch each. Batches of another shape (a partial last batch), eval mode, and eager reference steps run the
module as usual, so nothing is lost when the graph does not apply.

Example::

    >>> import torch
    >>> net = torch.nn.Linear(4, 4)
    >>> graphed = GraphedModule("net", net)
    >>> graphed.install()
    >>> net(torch.randn(2, 4)).shape  # on CPU the module simply runs as before
    torch.Size([2, 4])
    >>> graphed.uninstall()
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_fuse.compiler import forced_eager
from lightning_fuse.regions import has_params, is_metric

Signature = tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]


def graph_target(root: nn.Module) -> tuple[str, nn.Module]:
    """The top-level child of ``root`` holding the most parameters: the network that ``training_step`` calls.

    Raises:
        ValueError: If ``root`` has no child with parameters.
    """
    children = [(n, m) for n, m in root.named_children() if has_params(m) and not is_metric(m)]
    if not children:
        raise ValueError(
            "cuda_graph needs the LightningModule to hold its network as a child module (e.g. self.model); none "
            "with parameters was found. Use cuda_graph=False."
        )
    return max(children, key=lambda item: sum(p.numel() for p in item[1].parameters()))


class GraphedModule:
    """Routes a module's training forward through one captured CUDA graph when the shapes allow it.

    Args:
        name: The module's dotted name (for messages).
        module: The module whose ``forward`` (and backward) is captured.

    The graph is captured on the first eligible call after :attr:`capture_allowed` is set: training mode, grad
    enabled, not under ``set_stance("force_eager")``, only CUDA tensor positional arguments. A failed capture
    warns once and the module runs as before.

    Example::

        >>> g = GraphedModule("model", torch.nn.Linear(2, 2)); g.capture_allowed
        False
    """

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module
        self.capture_allowed = False
        self.captured_during_last_call = False
        self.replays = 0
        self.disabled_reason: str | None = None
        self._graphed: Any = None
        self._signature: Signature | None = None
        self._inner: Any = None
        self._capturing = False

    def install(self) -> None:
        # Sit where Module.compile sits (``_compiled_call_impl``), outside any compiled region of the module itself,
        # so the capture decision runs in Python even when the whole module is compiled.
        self._inner = self.module._compiled_call_impl
        self.module._compiled_call_impl = self

    def uninstall(self) -> None:
        if self.module._compiled_call_impl is self:
            self.module._compiled_call_impl = self._inner
        self._graphed = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.captured_during_last_call = False
        if self._capturing or kwargs or not self._eligible(args):
            return self._run_inner(*args, **kwargs)
        if self._graphed is None:
            if not self.capture_allowed:
                return self._run_inner(*args)
            self._capture(args)
            if self._graphed is None:
                return self._run_inner(*args)
            self.captured_during_last_call = True
        if _signature(args) != self._signature:
            return self._run_inner(*args)
        self.replays += 1
        return self._graphed(*args)

    def _run_inner(self, *args: Any, **kwargs: Any) -> Any:
        """The module as it runs without the graph: its compiled call if it is a region, else its plain call."""
        return (self._inner or self.module._call_impl)(*args, **kwargs)

    def _eligible(self, args: tuple) -> bool:
        return (
            self.disabled_reason is None
            and self.module.training
            and torch.is_grad_enabled()
            and not forced_eager()
            and bool(args)
            and all(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        )

    def _capture(self, args: tuple) -> None:
        buffers = [b.detach().clone() for b in self.module.buffers()]
        self._capturing = True  # make_graphed_callables calls the module: those calls must reach the inner module
        try:
            torch.cuda.make_graphed_callables(self.module, args, num_warmup_iters=3)
            with torch.no_grad():  # its warmup ran real forwards: undo their batch-norm statistics updates
                for buffer, saved in zip(self.module.buffers(), buffers):
                    buffer.copy_(saved)
            self._graphed = self.module.__dict__.pop("forward")  # it patched forward; we replay it ourselves
            release_capture_graph(self._graphed)
            self._signature = _signature(args)
            rank_zero_info(f"FuseCallback: captured one CUDA graph over {self.name!r} forward+backward.")
        except Exception as err:  # noqa: BLE001 - a capture failure must not cost the run
            self.module.__dict__.pop("forward", None)
            self.disabled_reason = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            rank_zero_warn(
                f"FuseCallback: could not capture a CUDA graph over {self.name!r} ({self.disabled_reason}); it runs "
                "without one. Typical causes: a host sync (.item(), printing a tensor) or a data-dependent shape in "
                "forward. Pass cuda_graph=False to silence this."
            )
        finally:
            self._capturing = False


def release_capture_graph(graphed: Any) -> int:
    """Free the autograd graph of the capture, which the graphed forward's closures keep alive; returns how many
    captured outputs were detached.

    ``make_graphed_callables`` keeps its captured forward outputs, and with them the autograd graph of the capture,
    including each parameter's ``AccumulateGrad`` node, made on its side stream. A node accumulates on the stream it
    was made on, so while it lives every backward accumulates each gradient on that side stream, with a
    cross-stream sync per parameter (torch warns "The AccumulateGrad node's stream does not match ..."). The replay
    never uses that graph: detached, the nodes are freed and the next forward makes new ones on its own stream.

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
            if obj.grad_fn is not None and not obj._is_view():
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


def _signature(args: tuple) -> Signature:
    return tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in args)
