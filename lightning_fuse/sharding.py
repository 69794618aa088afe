"""FSDP2's sharded parameters (``torch.distributed.fsdp.fully_shard``, Lightning's ``ModelParallelStrategy``), as
FuseCallback's checks against eager must see them.

A module that ``fully_shard`` wrapped holds its parameters as ``DTensor`` shards between calls: its own forward hooks
gather them (and cast its inputs, under a mixed-precision policy) before the forward and shard them again after it,
and its gradients are ``DTensor`` shards too. Two checks must see that: a region's first compiled output is
compared with an eager run of the same call, which for such a module must go through its hooks
(:func:`is_sharded`), and a plan candidate's gradient norm with eager's (each rank compares its own shards:
:func:`local_shard`).

Example::

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)  # not sharded
    >>> is_sharded(lin), local_shard(lin.weight) is lin.weight
    (False, True)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

if torch.distributed.is_available():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
else:  # a build without torch.distributed shards nothing
    FSDPModule = DTensor = ()  # type: ignore[assignment,misc]


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` wrapped ``module``: its forward hooks gather its parameters (and cast its inputs
    under a mixed-precision policy), so its forward runs as in training only through its whole call."""
    return isinstance(module, FSDPModule)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (an FSDP2 gradient), any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_shards(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """This rank's shards of ``tensors`` where any is a ``DTensor`` (the optimizer graph's gradient buffers under
    FSDP2), ``None`` where none is. Taken under ``no_grad``, where a shard is the tensor's own storage, not a view
    autograd tracks."""
    if not any(isinstance(tensor, DTensor) for tensor in tensors):
        return None
    with torch.no_grad():
        return [local_shard(tensor) for tensor in tensors]
