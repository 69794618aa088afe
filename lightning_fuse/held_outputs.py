"""Whether what a call returned is still held: the count of tensors sharing each output's memory, then and now.

A CUDA graph's replay writes a call's outputs into the same memory each time. Outputs a training step keeps past
its end (``self.outputs.append(logits.detach())``, Lightning's way to an epoch-end metric) are overwritten by the
next step's replay of FuseCallback's own graph (:mod:`~lightning_fuse.graph_slots`), and freed when the next step
begins under torch's cudagraph trees (reading them then fails: "accessing tensor output of CUDAGraphs that has been
overwritten by a subsequent run"). Nothing here holds the outputs: their memory is watched through weak references,
as torch's trees watch theirs.

Example::

    >>> import torch
    >>> watch = OutputWatch()
    >>> logits = torch.ones(2, 3) * 2
    >>> watch({"logits": logits})  # a call returned it
    >>> kept = [logits.detach()]; del logits  # the step keeps its output
    >>> watch.held()
    True
    >>> kept.clear(); watch.held()
    False
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_fuse import compat


@dataclass(frozen=True)
class Returned:
    """The memories of a call's outputs, and how many tensors shared each once the call had returned, the call's
    own outputs not counted: any more later, and something holds them."""

    memories: tuple[Any, ...]
    users: tuple[int, ...]

    @classmethod
    def of(cls, outputs: Sequence[torch.Tensor]) -> Returned:
        """Counted as ``outputs`` are returned (the caller still holds them: they are not counted)."""
        pointers = [output.untyped_storage().data_ptr() for output in outputs]
        one_each = dict(zip(pointers, outputs))  # an output per memory
        memories = tuple(compat.memory_of(output) for output in one_each.values())
        users = tuple(compat.storage_users(memory) - pointers.count(pointer)
                      for pointer, memory in zip(one_each, memories))  # fmt: skip
        return cls(memories, users)

    def held(self) -> bool:
        """Whether more tensors share an output's memory than when the call returned it."""
        return any(compat.storage_users(memory) > users for memory, users in zip(self.memories, self.users,
                                                                                 strict=True))  # fmt: skip


@dataclass
class OutputWatch:
    """The outputs of a training iteration's calls, counted as each call returns them (called with what it
    returned, any structure): whether one is still held when the next iteration begins (:meth:`held`), before it
    is :meth:`clear`-ed."""

    returned: list[Returned] = field(default_factory=list)

    def __call__(self, outputs: Any) -> None:
        self.returned.append(Returned.of([leaf for leaf in compat.tree_leaves(outputs)
                                          if isinstance(leaf, torch.Tensor)]))  # fmt: skip

    def held(self) -> bool:
        return any(returned.held() for returned in self.returned)

    def clear(self) -> None:
        self.returned.clear()
