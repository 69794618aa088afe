"""Gradient clipping inside the optimizer's replayed update.

Lightning clips the gradients between the closure's backward and the optimizer's update, through its precision
plugin's ``clip_gradients``. At small batch that is host work between two replays: the plugin walks the parameters,
groups their gradients and launches the norms, the stack and the scaling one by one. Where an optimizer's update
replays from a CUDA graph (:mod:`~lightning_fuse.optimizer_graph`), :class:`ClippingInUpdate` hands that call to
the optimizer's graph: the same ``clip_gradients`` is captured with the update, on the graph's gradient buffers,
and it runs eagerly just before the update wherever the update runs eagerly. Either way the clipping is the
plugin's own, so the parameters are those a plain fit gives.

Where it sits: ``clip_gradients`` is replaced on the plugin instance while a graph is installed (Lightning's public
method, the one ``LightningModule.clip_gradients`` calls; there is no public hook after it), and put back once the
last graph is uninstalled. ``tests/test_optimizer_graph.py`` fails where Lightning stops clipping through it. After a
replayed update, the parameters' ``.grad`` hold the gradients as they were before clipping (the graph clipped its
own copy of them); Lightning zeroes them next.

Example::

    >>> from lightning.pytorch.plugins.precision import Precision
    >>> net = torch.nn.Linear(2, 1); optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> plugin, held = Precision(), []
    >>> clipping = ClippingInUpdate(plugin)
    >>> clipping.add(optimizer, lambda key, clip: held.append(key) or True)  # the graph takes every clipping
    >>> plugin.clip_gradients(optimizer, 1.0); held
    [(1.0, 'norm')]
    >>> clipping.remove(optimizer); "clip_gradients" in vars(plugin)
    False
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from lightning_fuse import compat

ClipKey = tuple[float, str]
"""What a clipping is: its value and its algorithm (``"norm"`` or ``"value"``)."""
Defer = Callable[[ClipKey, Callable[[], None]], bool]
"""An optimizer graph's taker: ``defer(key, clip)`` is ``True`` where it runs ``clip()`` with its update."""


class ClippingInUpdate:
    """Routes a precision plugin's ``clip_gradients`` of an optimizer with an installed graph to that graph.

    Args:
        precision: The Trainer's precision plugin (``trainer.precision_plugin``).

    Example::

        >>> from lightning.pytorch.plugins.precision import Precision
        >>> clipping = ClippingInUpdate(Precision())
        >>> clipping.installed
        False
    """

    def __init__(self, precision: Any) -> None:
        self._precision = precision
        self._takers: dict[int, Defer] = {}
        self._own: Callable[..., None] | None = None

    @property
    def installed(self) -> bool:
        return self._own is not None

    def add(self, optimizer: torch.optim.Optimizer, defer: Defer) -> None:
        """From now on, ``optimizer``'s clipping is offered to ``defer`` first."""
        if self._own is None:
            self._own = self._precision.clip_gradients
            self._precision.clip_gradients = self._clip_gradients
        self._takers[id(optimizer)] = defer

    def remove(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer``'s clipping runs in place again; with the last one, the plugin is as it was."""
        self._takers.pop(id(optimizer), None)
        if not self._takers and self._own is not None:
            compat.restore_method(self._precision, "clip_gradients", self._own)
            self._own = None

    def _clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = "norm") -> None:
        own = partial(self._own, optimizer, clip_val, gradient_clip_algorithm)
        defer = self._takers.get(id(optimizer))
        clips = clip_val is not None and clip_val > 0
        if not clips or defer is None or not defer(_key(clip_val, gradient_clip_algorithm), own):
            own()


def _key(clip_val: float, algorithm: Any) -> ClipKey:
    """The clipping's key: Lightning passes the algorithm as a string enum (``GradClipAlgorithmType``)."""
    return float(clip_val), str(getattr(algorithm, "value", algorithm))
