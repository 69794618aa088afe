"""Host syncs that would fail a CUDA graph's capture, found before the capture (or the compile) costs anything.

Inside a capture an operation that makes the host wait for the device (``.item()``, a CPU tensor copied to the GPU,
a data-dependent shape) fails the capture. torch's sync debug mode makes such an operation raise outside one too:
:func:`host_syncs_raise` turns it on around a call, and the checks below run one training call twice with it on,
the network compiled by dynamo alone (:func:`syncs_when_compiled`) or eager between its regions
(:func:`syncs_between_regions`).

Example::

    >>> import torch
    >>> with host_syncs_raise(False):  # off the GPU there is nothing to raise
    ...     torch.ones(1).item()
    1.0
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_fuse import compat
from lightning_fuse.compiler import compilable_call, describe_error

SYNC_DEBUG_PROTOTYPE = "Synchronization debug mode is a prototype feature"
"""The start of torch's warning on turning host-sync checks on, once a process (:func:`_set_sync_debug_mode`)."""


def syncs_when_compiled(module: nn.Module, forward_backward: Callable[[], None], on_cuda: bool) -> str | None:
    """Why ``module`` compiled whole still makes the host wait for the device (``None``: it does not), found with
    dynamo's tracing alone (the ``eager`` backend: seconds, no inductor compile).

    ``forward_backward()`` runs one training call of the module, without synchronising. It runs twice: the first
    traces, the second runs with host syncs raising (on CUDA). A sync that dynamo traces away (an HF model's check of
    its attention mask) passes; one in the eager code between graph breaks (a TorchScript helper) is what would
    fail a CUDA graph over the compiled network, after the costly compile. A sync inside the traced graph refuses it
    too, though inductor may compile it away (a tensor built from a Python value): the first sync stops the check,
    and one behind it may not go away. On an H200 HF DeBERTa-v2's first sync was such a tensor in its traced graph,
    and its inductor-compiled network then failed the capture in a TorchScript helper between graph breaks (59 s of
    compile spent); HF Bloom's network compiled by inductor synced nowhere in a probe, yet failed FuseCallback's
    capture after this check.

    Example::

        >>> lin = torch.nn.Linear(2, 2)
        >>> syncs_when_compiled(lin, lambda: lin(torch.ones(1, 2)).sum().backward(), on_cuda=False) is None
        True
    """
    installed = compat.compiled_call_impl(module)
    compat.set_compiled_call_impl(module, torch.compile(compilable_call(module), backend="eager"))
    try:
        return _sync_on_second_call(forward_backward, on_cuda)
    finally:
        compat.set_compiled_call_impl(module, installed)


def syncs_between_regions(
    regions: Sequence[nn.Module], forward_backward: Callable[[], None], on_cuda: bool
) -> str | None:
    """Why no graph over the network with ``regions`` compiled can be captured: a host sync in the eager code
    between the regions (``None``: none found, or not on CUDA), found with the eager network in a second.

    ``forward_backward()`` runs one training call, without synchronising. It runs twice, the second time with host
    syncs raising everywhere but inside the regions' forwards (their compile may trace a sync away). A sync in the
    glue (an HF model's check of its attention mask, a TorchScript helper) fails every capture of the network;
    finding it here spares compiling the regions first.

    Example::

        >>> lin = torch.nn.Linear(2, 2)
        >>> syncs_between_regions([lin], lambda: lin(torch.ones(1, 2)).sum().backward(), on_cuda=False) is None
        True
    """
    if not on_cuda:
        return None
    modes: list[int] = []  # the mode each running region's forward interrupted, restored at its end

    def allow(*_: Any) -> None:
        modes.append(torch.cuda.get_sync_debug_mode())
        _set_sync_debug_mode("default")

    handles = [handle for region in regions for handle in (region.register_forward_pre_hook(allow, prepend=True),
               region.register_forward_hook(lambda *_: _set_sync_debug_mode(modes.pop())))]  # fmt: skip
    try:
        return _sync_on_second_call(forward_backward, on_cuda)
    finally:
        for handle in handles:
            handle.remove()


def _sync_on_second_call(forward_backward: Callable[[], None], on_cuda: bool) -> str | None:
    """Run ``forward_backward`` once (first calls trace, build lazy buffers), then again with host syncs raising
    (on CUDA): the sync that raised, described, or ``None``. Only its description leaves the ``except``: the error
    itself, raised through a context manager, is in a reference cycle that holds the half-built autograd graph until
    Python's next collection, autograd nodes of the default stream which a later capture may meet (when this check
    returned the error, HF Bloom's capture after it failed on an H200, and torch warned of "an AccumulateGrad node
    created prior to the current iteration being kept alive")."""
    try:
        forward_backward()
        with host_syncs_raise(on_cuda):
            forward_backward()
    except RuntimeError as err:
        return describe_error(err)
    return None


@contextmanager
def host_syncs_raise(on: bool) -> Iterator[None]:
    """Inside the block (``on``: a CUDA run), an operation that makes the host wait for the device raises, as it
    would inside a capture: ``.item()``, a CPU tensor copied to the GPU, a data-dependent shape.

    Example::

        >>> with host_syncs_raise(False):
        ...     torch.ones(1).item()
        1.0
    """
    if not on:
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    _set_sync_debug_mode("error")
    try:
        yield
    finally:
        _set_sync_debug_mode(before)


def _set_sync_debug_mode(mode: int | str) -> None:
    """:func:`torch.cuda.set_sync_debug_mode`, without torch's warning that the mode "is a prototype feature and
    does not yet detect all synchronizing operations": FuseCallback's checks turn it on, not the user, and a sync it
    misses fails the capture that follows instead, which is caught there."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SYNC_DEBUG_PROTOTYPE)
        torch.cuda.set_sync_debug_mode(mode)
