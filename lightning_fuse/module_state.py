"""What a CUDA graph reads of the model: each parameter's and buffer's name and storage, watched between epochs.

A graph replays the memory it was captured over. Between epochs a callback may rename a parameter or give it new
storage: Lightning's ``ModelPruning`` turns each pruned ``weight`` into ``weight_orig`` and a mask buffer, replaces
that buffer at every pruning, and with its lottery-ticket reset gives the parameters new storage
(``param.data = ...``). A graph captured before then computes and updates what the model no longer holds: on an
H200 such a fit's losses went to NaN. :class:`StateWatch` tells, at each epoch's first step (one walk over the
parameters and buffers an epoch, none per step), whether the state changed, so that the graphs are captured again.
A change in the middle of an epoch is not watched.

Example::

    >>> import torch
    >>> net = torch.nn.Linear(2, 2)
    >>> watch = StateWatch(net)
    >>> watch.changed()
    False
    >>> net.weight.data = torch.zeros(2, 2)  # new storage, as a lottery-ticket reset gives
    >>> watch.changed(), watch.changed()  # said once, against the state seen last
    (True, False)
"""

from __future__ import annotations

from itertools import chain

from torch import nn

from lightning_fuse.sharding import local_shard


def state_of(module: nn.Module) -> tuple[tuple[str, int], ...]:
    """Each parameter's and buffer's name and the address of its data (a sharded tensor's local shard).

    Example::

        >>> [name for name, _ in state_of(nn.BatchNorm1d(2))]
        ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked']
    """
    return tuple((name, local_shard(tensor).data_ptr())
                 for name, tensor in chain(module.named_parameters(), module.named_buffers()))  # fmt: skip


class StateWatch:
    """Whether ``module``'s parameters and buffers were renamed or given new storage since the last look.

    Example::

        >>> import torch
        >>> net = torch.nn.Linear(2, 2)
        >>> watch = StateWatch(net)
        >>> net.register_buffer("mask", torch.ones(2, 2)); watch.changed()
        True
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._seen = state_of(module)

    def changed(self) -> bool:
        """Whether the state differs from the one seen last (which this look's state then becomes)."""
        now = state_of(self.module)
        changed, self._seen = now != self._seen, now
        return changed
