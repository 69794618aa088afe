"""Which of a module's CUDA graphs a call may replay without overwriting what is still needed.

A graph's replay writes the call's outputs, and the activations its backward reads, into the same memory each time.
Two calls of one signature in a training step before their backward (two augmented views of a batch in a
consistency loss, as FixMatch or SimCLR train; a siamese network) each need theirs until then: the second replay
of one graph overwrote the first's, so the first call's loss and gradients were the second's (on an H200 a FixMatch
step's loss rose from 2.6 to 7.4 where eager's fell). Each such call takes a graph of its own, a *slot* (at most
:data:`SLOTS` per signature), or runs without one; so does a call after another's backward in the same step while
what the other returned is still held (manual optimization a chunk at a time, keeping each chunk's outputs).
Outputs kept past their step (``self.outputs.append(logits)``, Lightning's way to an epoch-end metric) would be
overwritten by the next step's replay: :mod:`~lightning_fuse.held_outputs` tells, and
:class:`~lightning_fuse.graphs.GraphedModule` runs without its graph from then on.

Example::

    >>> import torch
    >>> slots = OutputSlots()
    >>> out = torch.ones(2, requires_grad=True) * 2
    >>> slots.free("call"), slots.replayed(("call", 0), (out,)), slots.free("call")
    (('call', 0), None, ('call', 1))
    >>> out.sum().backward(); del out  # its backward came, and nothing holds what it returned
    >>> slots.free("call")
    ('call', 0)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from lightning_fuse.held_outputs import Returned

SLOTS = 2
"""Graphs per call signature for calls whose replays await their backward together (two views of a batch)."""


@dataclass
class _Slot:
    pending: bool = False
    """Replayed, its backward still to come (until the step ends)."""
    fresh: bool = True
    """Not replayed yet in this step."""
    returned: Returned | None = None
    """The last replay's outputs, counted."""


class OutputSlots:
    """The slots of a module's graphs: which one a call may replay, and whether a slot's last outputs are held.

    A slot is pending from its replay until the backward reaches it, or until :meth:`begin_step`.

    Example::

        >>> slots = OutputSlots()
        >>> outputs = (torch.ones(2) * 2,)
        >>> slots.replayed(("call", 0), outputs)
        >>> kept = [outputs[0].detach()]; del outputs  # the step's output, kept in a list
        >>> slots.begin_step(); slots.held(("call", 0))
        True
    """

    def __init__(self) -> None:
        self._slots: dict[Hashable, _Slot] = {}

    def begin_step(self) -> None:
        """A training step begins: every slot is free, and held outputs are looked for at its first replay."""
        for slot in self._slots.values():
            slot.pending, slot.fresh = False, True

    def free(self, signature: Hashable) -> tuple[Hashable, int] | None:
        """The key of the first slot of ``signature`` whose last outputs are no longer needed: not replayed yet in
        this step, or replayed, its backward come and its outputs held by nothing (a loop that calls the network and
        its backward a chunk at a time, keeping what each call returned); ``None`` when every slot's are needed."""
        for index in range(SLOTS):
            slot = self._slots.get((signature, index))
            if slot is None or slot.fresh or not (slot.pending or _outputs_held(slot)):
                return signature, index
        return None

    def held(self, key: Hashable) -> bool:
        """Whether, at its first replay in this step, the slot's last outputs (the last step's) are still held."""
        slot = self._slots.get(key)
        return slot is not None and slot.fresh and _outputs_held(slot)

    def replayed(self, key: Hashable, outputs: Sequence[torch.Tensor]) -> None:
        """The slot just replayed, returning ``outputs``: pending until their backward, and counted."""
        slot = self._slots.setdefault(key, _Slot())
        slot.pending, slot.fresh = True, False
        needs_backward = next((o.grad_fn for o in outputs if o.grad_fn is not None), None)
        if needs_backward is not None:
            needs_backward.register_prehook(lambda grads: setattr(slot, "pending", False))
        slot.returned = Returned.of(outputs)

    def forget(self) -> None:
        """The graphs were dropped: no slot is pending, nothing is counted."""
        self._slots.clear()


def _outputs_held(slot: _Slot) -> bool:
    """Whether more tensors share the slot's last outputs' memory than when its call returned them."""
    return slot.returned is not None and slot.returned.held()
