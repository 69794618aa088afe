"""A snapshot of what a trial or a capture may disturb: RNG states, and a module's gradients and buffers.

The plan search runs candidate forwards and backwards outside the training loop, and a CUDA graph capture runs
warmup passes; neither may leave a trace in training. :class:`Snapshot` takes what they could change and puts it
back.

Example::

    >>> import torch
    >>> bn = torch.nn.BatchNorm1d(2)
    >>> snapshot = Snapshot(bn)
    >>> _ = bn(torch.randn(4, 2)); _ = torch.rand(1)
    >>> snapshot.restore()
    >>> bn.running_mean.tolist(), torch.equal(torch.get_rng_state(), snapshot.rng)
    ([0.0, 0.0], True)
"""

from __future__ import annotations

import torch
from torch import nn


class Snapshot:
    """The CPU and CUDA RNG states and ``module``'s gradients (by reference) and buffers (copied), taken now.

    Args:
        module: The module whose gradients and buffers are kept.

    Example::

        >>> lin = torch.nn.Linear(2, 1)
        >>> snapshot = Snapshot(lin)
        >>> lin(torch.ones(1, 2)).sum().backward()
        >>> snapshot.restore_grads(); lin.weight.grad is None
        True
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.grads = [p.grad for p in module.parameters()]
        self.buffers = [b.detach().clone() for b in module.buffers()]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        self.restore_rng()
        self.restore_grads()
        self.restore_buffers()

    def restore_rng(self) -> None:
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def restore_grads(self) -> None:
        for param, grad in zip(self.module.parameters(), self.grads):
            param.grad = grad

    def restore_buffers(self) -> None:
        with torch.no_grad():
            for buffer, saved in zip(self.module.buffers(), self.buffers):
                buffer.copy_(saved)
