"""Opt-in shape buckets: pad each batch's varying length up to one of a few sizes, where padding is exact.

Batches padded to their longest sequence (HF's ``DataCollatorWithPadding``) give every batch a new shape: a compiled
region recompiles or goes dynamic, and a CUDA graph, which is shape-specific, cannot replay. Serving engines (vLLM,
SGLang) capture graphs at a few sizes and pad up to the next; :class:`PadToBuckets` does that for training batches
(dicts of tensors), in place, before the step runs. Padding is exact only where the model ignores the padded
positions: an attention mask padded with 0 and labels padded with the loss's ignore index (-100). A key that has
the length dim but no padding value is refused, since its padding could change the result. The waste (padded
positions over all) is reported.

Example::

    >>> import torch
    >>> buckets = PadToBuckets([8, 16])
    >>> batch = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5),
    ...          "labels": torch.ones(2, 5, dtype=torch.long)}
    >>> buckets(batch)
    >>> batch["input_ids"].shape, batch["labels"][0, -1].item(), buckets.waste
    (torch.Size([2, 8]), -100, 0.375)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch.nn import functional

from lightning_fuse.options import check_pad_buckets

EXACT_PADDING = {"input_ids": 0, "attention_mask": 0, "token_type_ids": 0, "position_ids": 0, "labels": -100}
"""Padding values under which HF models give the same loss: masked tokens, ignored labels."""
SUGGESTED_BUCKETS = 4
"""About this many buckets are suggested over the lengths seen (:func:`suggest_buckets`)."""


class PadToBuckets:
    """Pads the length dim of a dict batch up to the smallest bucket that holds it, in place.

    Args:
        sizes: The bucket lengths, e.g. ``[128, 256, 512]``; a batch longer than the largest is left as it is.
        pad: Key -> padding value, for every key that has the length dim (:data:`EXACT_PADDING` by default).
        dim: The length dim.

    Raises:
        ValueError: At construction if ``sizes`` is empty or not positive; at a batch, if the batch is not a dict or
            a tensor with the length dim has no padding value (padding it might change the loss).

    Example::

        >>> PadToBuckets([4]).sizes
        [4]
    """

    def __init__(self, sizes: Sequence[int], pad: Mapping[str, int | float] | None = None, dim: int = 1) -> None:
        check_pad_buckets(sizes)
        self.sizes = sorted(sizes)
        self.pad = dict(EXACT_PADDING if pad is None else pad)
        self.dim = dim
        self.padded = 0
        self.total = 0

    @property
    def waste(self) -> float:
        """Padded positions over all positions, since the start."""
        return self.padded / self.total if self.total else 0.0

    def __call__(self, batch: Any) -> None:
        if not isinstance(batch, MutableMapping):
            raise ValueError(
                f"`pad_buckets` pads dict batches (as HF collators make), got a {type(batch).__name__}. Pad in your "
                "collate function instead, or drop `pad_buckets`."
            )
        length = self._length(batch)
        target = next((size for size in self.sizes if size >= length), None)
        if length is None or target is None:
            return
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() > self.dim:
                widths = [0, 0] * (value.dim() - self.dim - 1) + [0, target - length]
                batch[key] = functional.pad(value, widths, value=self.pad[key])
        rows = next(iter(batch.values())).shape[0] if batch else 0
        self.padded += rows * (target - length)
        self.total += rows * target

    def _length(self, batch: Mapping[str, Any]) -> int | None:
        lengths = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() > self.dim:
                if key not in self.pad:
                    raise ValueError(
                        f"`pad_buckets` cannot pad batch key {key!r}: it has the length dim {self.dim} but no known "
                        f"exact padding value. Pass pad={{..., {key!r}: <value>}} if padding it cannot change the loss."
                    )
                lengths[key] = value.shape[self.dim]
        if len(set(lengths.values())) > 1:
            raise ValueError(f"`pad_buckets`: the batch's keys disagree on the length dim {self.dim}: {lengths}.")
        return next(iter(lengths.values()), None)


def suggest_buckets(lengths: Sequence[int]) -> list[int]:
    """Buckets covering ``lengths``: multiples of a power of two (at least 8) near a quarter of the longest.

    Example::

        >>> suggest_buckets([64, 100, 256])
        [64, 128, 192, 256]
        >>> suggest_buckets([5, 16])
        [8, 16]
    """
    step = max(8, 2 ** round(math.log2(max(lengths) / SUGGESTED_BUCKETS)))
    return list(range(math.ceil(min(lengths) / step) * step, max(lengths) + step, step))
