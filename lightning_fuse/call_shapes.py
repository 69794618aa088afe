"""The network's input shapes over the fit's first steps: which dims vary between its training calls.

The plan is chosen by measurement on one recorded call, but it must hold for every batch. Where each batch has its
own sequence length, a CUDA graph (shape-specific: one graph recorded per length) and a static compile (one
recompile per length) would crawl. :class:`CallShapes` keeps the tensor shapes of the network's training calls
seen before the plan is chosen, so the search can leave graphs out and compile the varying dims as dynamic.

Example::

    >>> import torch
    >>> shapes = CallShapes()
    >>> for length in (70, 130, 250):
    ...     shapes.add((), {"input_ids": torch.zeros(2, length, dtype=torch.long), "flag": True})
    >>> shapes.varies, shapes.varying_dims, shapes.sizes(1)
    (True, {1}, [70, 130, 250])
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_fuse import compat

Shapes = tuple[tuple[int, ...] | None, ...]
"""One call's leaves: a tensor's shape, ``None`` for anything else."""


class CallShapes:
    """The tensor shapes of the training calls recorded so far (their structure and each tensor leaf's shape).

    Example::

        >>> shapes = CallShapes()
        >>> shapes.add((torch.zeros(4, 8),), {}); shapes.add((torch.zeros(4, 8),), {})
        >>> shapes.calls, shapes.varies, shapes.varying_dims
        (2, False, set())
    """

    def __init__(self) -> None:
        self._calls: list[tuple[Any, Shapes]] = []  # (pytree structure, shapes of the leaves)

    @property
    def calls(self) -> int:
        return len(self._calls)

    def add(self, args: tuple, kwargs: dict) -> None:
        """Record one call's shapes (not its tensors)."""
        leaves, spec = compat.tree_flatten((args, kwargs))
        self._calls.append((spec, tuple(tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None
                                        for leaf in leaves)))  # fmt: skip

    @property
    def varies(self) -> bool:
        """Whether any two calls differ in structure or in a tensor's shape."""
        return len(set(self._calls)) > 1

    @property
    def varying_dims(self) -> set[int]:
        """The dim indices whose size changed between calls, in any tensor leaf."""
        return {dim for dims in self._varying().values() for dim in dims}

    def sizes(self, dim: int) -> list[int]:
        """The sizes seen at ``dim`` in the tensor leaves where that dim varies, sorted."""
        leaves = [leaf for leaf, dims in self._varying().items() if dim in dims]
        return sorted({shapes[leaf][dim] for _, shapes in self._calls for leaf in leaves})

    def _varying(self) -> dict[int, set[int]]:
        """Leaf index -> the dims of that tensor whose size changed, over the calls of the first call's structure."""
        if not self._calls:
            return {}
        spec, first = self._calls[0]
        varying: dict[int, set[int]] = {}
        for _, shapes in (call for call in self._calls[1:] if call[0] == spec):
            for leaf, (a, b) in enumerate(zip(first, shapes)):
                if a is not None and b is not None and len(a) == len(b):
                    varying.setdefault(leaf, set()).update(dim for dim, (x, y) in enumerate(zip(a, b)) if x != y)
        return {leaf: dims for leaf, dims in varying.items() if dims}
