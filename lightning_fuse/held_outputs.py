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
    >>> logits = watch({"logits": logits})["logits"]  # a call returned it
    >>> kept = [logits.detach()]; del logits  # the step keeps its output
    >>> watch.held()
    True
    >>> kept.clear(); watch.held()
    False
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_fuse import compat


@dataclass(frozen=True)
class Returned:
    """A call's outputs as it returned them: each output memory (weakly), the tensors of ours that share it
    (weakly: what the call returned, and what that was made from), and how many other tensors shared it then.

    Held: a returned tensor is still alive, or more tensors other than ours share a memory than then."""

    memories: tuple[Any, ...]
    ours: tuple[tuple[weakref.ref, ...], ...]
    returned: tuple[weakref.ref, ...]
    others: tuple[int, ...]

    @classmethod
    def of(cls, outputs: Sequence[torch.Tensor], made_from: Sequence[torch.Tensor] = ()) -> Returned:
        """Counted as ``outputs`` are returned (``made_from``: the tensors they alias, which die with them)."""
        groups: dict[int, list[torch.Tensor]] = {}
        for tensor in (*outputs, *made_from):
            groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
        memories = tuple(compat.memory_of(group[0]) for group in groups.values())
        others = tuple(compat.storage_users(memory) - len(group) for memory, group in zip(memories, groups.values()))
        ours = tuple(tuple(weakref.ref(tensor) for tensor in group) for group in groups.values())
        return cls(memories, ours, tuple(weakref.ref(output) for output in outputs), others)

    def held(self) -> bool:
        if any(output() is not None for output in self.returned):
            return True
        return any(compat.storage_users(memory) - sum(ref() is not None for ref in ours) > others
                   for memory, ours, others in zip(self.memories, self.ours, self.others, strict=True))  # fmt: skip


@dataclass
class OutputWatch:
    """The outputs of a training iteration's calls, counted as each call returns them: whether one is still held
    when the next iteration begins (:meth:`held`), before it is :meth:`clear`-ed.

    Called with what a call returned (any structure), it returns the same with each tensor a view of its own:
    torch's cudagraph trees hand back, replay after replay, output tensors they keep themselves, so only a tensor
    that the caller alone holds tells when the caller lets go of it."""

    returned: list[Returned] = field(default_factory=list)
    collected: bool = False
    """Whether :meth:`held` ran the cycle collector already."""

    def __call__(self, outputs: Any) -> Any:
        own = compat.tree_map(lambda leaf: leaf.view_as(leaf) if isinstance(leaf, torch.Tensor) else leaf, outputs)
        self.returned.append(Returned.of(_tensors(own), made_from=_tensors(outputs)))
        return own

    def held(self) -> bool:
        """Whether an output is still held. One that only a reference cycle reaches is not: a cycle keeps what it
        reaches until the collector's next pass, at a moment of its own, so the first time one seems held the
        collector runs (once a watch: a pass can take tens of ms) and the outputs are counted again. A false
        reading hands the plan over to a compile without graphs, compiled then: HF DeBERTa-v2's warm fit at 64 on
        an H200 did so at its first step under the plan, 45 s of compiling, its training step keeping nothing;
        what held the outputs there is not known."""
        if not any(returned.held() for returned in self.returned):
            return False
        if self.collected:
            return True
        self.collected = True
        gc.collect()
        return any(returned.held() for returned in self.returned)

    def clear(self) -> None:
        self.returned.clear()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in compat.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]
