"""Whether a call draws random numbers, read off the default generator of the device it runs on and the host's.

Dropout written as a layer (``nn.Dropout``) shows in the module tree; dropout written as a function does not
(``F.dropout(x, p=self.dropout, training=self.training)``, as in HF's OPT and BART layers, or a stochastic depth
of one's own). Both advance the device's default generator, so FuseCallback watches the generator around the calls
it runs eagerly: a training call that drew numbers cannot match its compiled self (inductor draws others), so its
output and loss are not held to eager's. The host's global generators are watched too: HF's Wav2Vec2 and HuBERT
draw their SpecAugment masks with ``np.random``, so a compiled call's masks differ from those of the eager call it
is checked against, as dropout's do.

Example::

    >>> import torch
    >>> watch = RandomDraws()
    >>> with watch.around(torch.device("cpu")):
    ...     _ = torch.nn.functional.dropout(torch.ones(4), p=0.5)
    >>> watch.drew
    True
    >>> import numpy as np
    >>> with RandomDraws().around(torch.device("cpu")) as host:
    ...     _ = np.random.rand(2)
    >>> host.drew
    True
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_fuse import compat


def generator_state(device: torch.device) -> torch.Tensor | None:
    """The state of ``device``'s default generator (``None``: a device whose state is not read, or a CUDA stream
    being captured, where reading it is not allowed)."""
    if device.type == "cpu":
        return torch.get_rng_state()
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        return torch.cuda.get_rng_state(device)
    return None


def host_state() -> tuple[Any, ...]:
    """The state of the host's global generators, Python's ``random`` and NumPy's, in a form ``==`` compares."""
    numpy_state = np.random.get_state()  # ('MT19937', keys, position, has_gauss, cached_gaussian)
    return (random.getstate(), numpy_state[1].tobytes(), *numpy_state[2:])


def call_device(module: nn.Module, args: tuple, kwargs: dict) -> torch.device:
    """Where a call runs: its first tensor input's device, else its module's first parameter's, else the CPU."""
    tensor = next((leaf for leaf in compat.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)), None)
    if tensor is None:
        tensor = next(module.parameters(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


class RandomDraws:
    """Whether any call watched (:meth:`around`, or :meth:`start` and :meth:`stop`) drew random numbers.

    Example::

        >>> import torch
        >>> watch = RandomDraws()
        >>> watch.start(torch.device("cpu")); _ = torch.ones(4) * 2; watch.stop()
        >>> watch.drew
        False
    """

    def __init__(self) -> None:
        self.drew = False
        self._device: torch.device | None = None
        self._before: torch.Tensor | None = None
        self._host_before: tuple[Any, ...] | None = None

    def start(self, device: torch.device) -> None:
        self._device, self._before, self._host_before = device, generator_state(device), host_state()

    def stop(self) -> None:
        if self._device is None:
            return
        after = generator_state(self._device) if self._before is not None else None
        device_drew = after is not None and not torch.equal(after, self._before)
        self.drew = self.drew or device_drew or host_state() != self._host_before
        self._device = self._before = self._host_before = None

    @contextmanager
    def around(self, device: torch.device) -> Iterator[RandomDraws]:
        self.start(device)
        try:
            yield self
        finally:
            self.stop()

    def watch_module(self, module: nn.Module) -> list[Any]:
        """Watch every call of ``module`` from now on; remove the returned hook handles to stop."""
        start = module.register_forward_pre_hook(
            lambda mod, args, kwargs: self.start(call_device(mod, args, kwargs)), with_kwargs=True
        )
        stop = module.register_forward_hook(lambda *_: self.stop(), always_call=True)
        return [start, stop]
