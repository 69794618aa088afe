"""Gradients a CUDA graph replay would overwrite, given memory of their own first.

A replay's backward writes the parameters' gradients into the graph's own buffers, and autograd keeps such a
buffer as the ``.grad`` of a parameter that had none. A gradient kept past its step (accumulated over micro-batches,
or zeroed in place) lives in those buffers, and the next replay overwrites them: its backward, and already its
forward, since the forward and backward graphs share one memory pool (on an H100 a bias's gradient buffer lay where
the forward keeps its temporaries). :mod:`~lightning_fuse.graphs` calls these before each replay.

Example::

    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.ones(2); held = p.grad
    >>> own_kept_gradients([p]); p.grad is held
    False
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def own_kept_gradients_before_backward(outputs: Sequence[torch.Tensor], params: Sequence[nn.Parameter]) -> None:
    """Once the replay's backward is about to run (the first of ``outputs`` to receive its gradient), give every
    gradient of ``params`` still held then memory of its own (:func:`own_kept_gradients`).

    Only for gradients zeroed after the forward: the forward may have overwritten a gradient buffer, and zeroing
    (to ``None``, or in place) makes that harmless, while an accumulated gradient would be lost.

    Example::

        >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.ones(2); held = p.grad
        >>> out = p * 2
        >>> own_kept_gradients_before_backward([out], [p])
        >>> p.grad is held  # nothing copied before the backward
        True
        >>> out.sum().backward(); held.tolist(), p.grad.tolist()
        ([1.0, 1.0], [3.0, 3.0])
    """
    pending = [True]

    def before_backward(grad: torch.Tensor) -> None:
        if pending:
            pending.clear()
            own_kept_gradients(params)

    for output in outputs:
        if output.requires_grad:
            output.register_hook(before_backward)


def own_kept_gradients(params: Sequence[nn.Parameter]) -> None:
    """Give every gradient still held before a replay memory of its own (why: this module's docstring). Called
    before the forward wherever the gradients are kept; where they are zeroed between the forward and the
    backward, :func:`own_kept_gradients_before_backward` calls it at the backward instead. After ``zero_grad()``'s
    default (``None``) there is nothing to copy.

    Example::

        >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.ones(2); held = p.grad
        >>> own_kept_gradients([p])
        >>> p.grad.data_ptr() != held.data_ptr(), p.grad.tolist()
        (True, [1.0, 1.0])
    """
    for p in params:
        if p.grad is not None:
            p.grad = p.grad.clone()
