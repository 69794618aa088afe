"""FSDP2's sharded parameters (``torch.distributed.fsdp.fully_shard``, Lightning's ``ModelParallelStrategy``), as
FuseCallback's checks against eager must see them.

A module that ``fully_shard`` wrapped holds its parameters as ``DTensor`` shards between calls: its own forward hooks
gather them before the forward and shard them again after it, and its gradients are ``DTensor`` shards too. Two
checks run the network outside those hooks' order: a region's first compiled output is compared with the module's
forward run again (which the hooks do not gather for: :func:`gathered` does), and a plan candidate's gradient norm
with eager's (each rank compares its own shards: :func:`local_shard`).

Example::

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)  # not sharded: both leave it as it is
    >>> with gathered(lin):
    ...     out = lin.forward(torch.ones(1, 2))
    >>> local_shard(lin.weight) is lin.weight
    True
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

if torch.distributed.is_available():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
else:  # a build without torch.distributed shards nothing
    FSDPModule = DTensor = ()  # type: ignore[assignment,misc]


@contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """Inside it, a module ``fully_shard`` wrapped holds its whole parameters, as in its forward; anything else is
    left as it is. A collective (an all-gather) on every rank: call it where every rank does."""
    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()  # its backward gathers them again where it needs them


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (an FSDP2 gradient), any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
