"""The network's input shapes over the fit's first steps: which dims vary between its training calls, and the
attention kernel that holds over lengths that vary.

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

Where they vary, :class:`NoCudnnAttention` keeps cuDNN's attention out of the plan's steps: it builds a plan of its
own for every new length.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_fuse import compat
from lightning_fuse.buckets import suggest_buckets

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

    def static_sizes(self) -> dict[int, set[int]]:
        """For each varying dim, the sizes it held only in tensor leaves where it never varied: marking those
        dynamic would turn static code dynamic (an image batch's 3 channels beside text whose length varies in dim
        1; the images' batch of 2 beside box counts that vary in dim 0).

        Example::

            >>> shapes = CallShapes()
            >>> for length in (5, 9):
            ...     shapes.add((), {"input_ids": torch.zeros(2, length), "pixel_values": torch.zeros(2, 3, 8, 8)})
            >>> shapes.static_sizes()
            {1: {3}}
        """
        varying, first = self._varying(), self._calls[0][1] if self._calls else ()
        fixed = {dim: {shape[dim] for leaf, shape in enumerate(first)
                       if shape is not None and dim < len(shape) and dim not in varying.get(leaf, ())}
                 for dim in self.varying_dims}  # fmt: skip
        return {dim: sizes - set(self.sizes(dim)) for dim, sizes in fixed.items()}

    def sizes(self, dim: int) -> list[int]:
        """The sizes seen at ``dim`` in the tensor leaves where that dim varies, sorted."""
        leaves = [leaf for leaf, dims in self._varying().items() if dim in dims]
        return sorted({shapes[leaf][dim] for _, shapes in self._calls for leaf in leaves})

    def note(self, left_out: list[str], buckets: int) -> str:
        """What varying shapes change (``left_out``: the candidates they leave out of the search), and, without
        ``buckets``, the ``pad_buckets`` that would hold the lengths seen.

        Example::

            >>> shapes = CallShapes()
            >>> for length in (5, 9):
            ...     shapes.add((torch.zeros(2, length),), {})
            >>> print(shapes.note(["regions+graph"], buckets=0))  # doctest: +NORMALIZE_WHITESPACE
            FuseCallback: the network's input shapes vary between its first 2 training calls (lengths 5..9): dim 1 is
            compiled as dynamic, and regions+graph (CUDA graphs of one shape each) are left out of the search. To run
            CUDA graphs over varying lengths, pad them to a few sizes: FuseCallback(pad_buckets=[8, 16]) (from the
            lengths seen; extend it to your longest sequence).
        """
        lengths = self.sizes(1)
        seen = f" (lengths {lengths[0]}..{lengths[-1]})" if lengths else ""
        dims = sorted(self.varying_dims)
        marked = f"dim {dims[0]} is" if len(dims) == 1 else f"dims {', '.join(map(str, dims))} are"
        change = f"{marked} compiled as dynamic" if dims else "the calls' structure changes"
        note = f"FuseCallback: the network's input shapes vary between its first {self.calls} training calls{seen}: "
        note += change
        if left_out:
            note += f", and {', '.join(left_out)} (CUDA graphs of one shape each) are left out of the search"
        if lengths and not buckets:
            note += (f". To run CUDA graphs over varying lengths, pad them to a few sizes: "
                     f"FuseCallback(pad_buckets={suggest_buckets(lengths)}) (from the lengths seen; extend it to your "
                     "longest sequence)")  # fmt: skip
        return note + "."

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


class NoCudnnAttention:
    """While :attr:`enabled`, ``scaled_dot_product_attention`` leaves cuDNN's attention out, for lengths that vary.

    On Hopper and Blackwell GPUs torch tries cuDNN's attention first for fp16 and bf16 calls. cuDNN builds an
    execution plan for each new problem shape (batch, heads, lengths) and caches it: tens of milliseconds of host
    time, for the forward and again for the backward. Where each batch has its own length, that is a build at
    nearly every step, in eager and compiled code alike (inductor calls the same kernel). Flash and memory-efficient
    attention take any length. Once :meth:`apply` is called (a CUDA fit whose first steps' lengths vary, without
    ``pad_buckets``), FuseCallback turns cuDNN attention off for the steps its plan runs, for the plan search and for
    its eager reference steps, through torch's public ``torch.backends.cuda.enable_cudnn_sdp``. The reference too:
    cuDNN plans only the lengths its own calls meet, and the plan's steps leave it out, so nearly every reference
    step with cuDNN met a length it had not planned and paid the build, which a plain eager fit pays once a length
    (on an H100, Llama at 8 with 16 lengths that come again: 189 ms a reference step against the plain eager fit's
    65). The logged speedup is then against eager without cuDNN attention. The eager steps of a fit whose plan was
    dropped run the user's setting. An ``sdpa_kernel`` context in the model's code still decides inside it.

    Example::

        >>> attention = NoCudnnAttention()
        >>> attention.enabled = True; torch.backends.cuda.cudnn_sdp_enabled()  # not applied: nothing changes
        True
        >>> attention.apply(); attention.enabled = True; torch.backends.cuda.cudnn_sdp_enabled()
        False
        >>> attention.restore(); torch.backends.cuda.cudnn_sdp_enabled()
        True
    """

    def __init__(self) -> None:
        self.applies = False
        self._user_setting = True

    def apply(self) -> None:
        """From now on, :attr:`enabled` decides (where the user left cuDNN attention on); one line says so."""
        self._user_setting = torch.backends.cuda.cudnn_sdp_enabled()
        self.applies = self._user_setting
        if self.applies:
            rank_zero_info(
                "FuseCallback: lengths vary from step to step. Where the network calls scaled_dot_product_attention, "
                "cuDNN attention (torch's first choice for fp16/bf16 attention on recent GPUs) would build a plan for "
                "each new length: the steps FuseCallback runs, its eager reference steps too, use flash or "
                "memory-efficient attention instead, so fuse/speedup is against eager without cuDNN attention. Pad "
                "the lengths to a few sizes (pad_buckets) to keep cuDNN attention."
            )

    @property
    def enabled(self) -> bool:
        """Whether cuDNN attention is off now."""
        return self.applies and not torch.backends.cuda.cudnn_sdp_enabled()

    @enabled.setter
    def enabled(self, off: bool) -> None:
        if self.applies:
            torch.backends.cuda.enable_cudnn_sdp(not off)

    def restore(self) -> None:
        """The user's setting back, for good."""
        if self.applies:
            torch.backends.cuda.enable_cudnn_sdp(self._user_setting)
            self.applies = False
