"""Adam's step counters where each update wants them: on the device for the captured update, on the host for the
user's own.

A captured Adam update needs ``capturable=True``: its step counters are device tensors, which the graph reads and
increments in place. The user's update (``capturable=False``) keeps them on the host and computes its bias
corrections there; run under ``capturable=True``, the same foreach update adds two small kernels per parameter. So
the eager updates among a fit's steps (eager reference steps, the optimizer trial's eager blocks) run the user's
configuration, not the graph's, or the eager side of the logged speedup would be slower than the user's own.

:class:`StepCounters` moves the counters between the two without a host sync, and without replacing the device
tensors a captured graph reads: the host keeps the count (each update in the graph's configuration adds one), and
the device tensors are refilled from it. Groups whose counters live on the device either way (``fused=True``, or
``capturable=True`` set by the user) only have their ``capturable`` flag switched.

Example::

    >>> net = torch.nn.Linear(2, 1)
    >>> optimizer = torch.optim.AdamW(net.parameters(), fused=True)
    >>> counters = StepCounters(optimizer)
    >>> counters.to_device(); optimizer.param_groups[0]["capturable"]
    True
    >>> counters.to_host(); optimizer.param_groups[0]["capturable"]
    False
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class StepCounters:
    """Switches an optimizer's groups between the user's configuration and the one a captured update needs.

    Args:
        optimizer: A torch optimizer; groups without a ``capturable`` setting (SGD) are left as they are.

    Example::

        >>> net = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.AdamW(net.parameters())  # counters on the host
        >>> counters = StepCounters(optimizer)
        >>> net(torch.ones(1, 2)).sum().backward(); optimizer.step()
        >>> counters.to_device(); optimizer.param_groups[0]["capturable"], float(optimizer.state[net.weight]["step"])
        (True, 1.0)
        >>> counters.to_host(); optimizer.param_groups[0]["capturable"], float(optimizer.state[net.weight]["step"])
        (False, 1.0)
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.user_capturable = [group.get("capturable") for group in optimizer.param_groups]
        self.on_device = False
        self._counts: dict[nn.Parameter, float] = {}  # the count each moved counter holds, known on the host
        self._device: dict[nn.Parameter, torch.Tensor] = {}  # the device counters, the same tensors all along
        self._pending: list[nn.Parameter] = []  # the parameters of the updates not yet counted on the host
        self._pending_updates = 0

    def to_device(self) -> None:
        """The graph's configuration: ``capturable=True``, the counters in the device tensors (refilled)."""
        if self.on_device:
            return
        self._set_flags(True)
        state = self.optimizer.state
        for p in self._moved_params():
            step = state.get(p, {}).get("step")
            if not isinstance(step, torch.Tensor):
                continue
            self._counts[p] = float(step)  # on the host: no sync
            device = self._device.get(p)
            if device is None:
                self._device[p] = device = torch.full((), self._counts[p], dtype=step.dtype, device=p.device)
            else:
                device.fill_(self._counts[p])
            state[p]["step"] = device
        self.on_device = True

    def updated(self, params: list[nn.Parameter]) -> None:
        """One update ran in the graph's configuration on ``params`` (each counter went up by one). Cheap where
        ``params`` is the list of the update before (a replay's): the counts are added up at :meth:`to_host`."""
        if params is not self._pending:
            self._add_pending()
            self._pending = params
        self._pending_updates += 1

    def to_host(self) -> None:
        """The user's configuration: their ``capturable`` settings, and host counters where they keep them."""
        if not self.on_device:
            return
        self._add_pending()
        self._set_flags(None)
        state = self.optimizer.state
        for p in self._moved_params():
            step = state.get(p, {}).get("step")
            if p in self._counts and step is self._device.get(p):
                state[p]["step"] = torch.tensor(self._counts[p], dtype=step.dtype)
            elif isinstance(step, torch.Tensor) and step.device.type != "cpu":
                state[p]["step"] = step.cpu()  # made by an update that failed midway: one sync
        self.on_device = False

    def as_saved_by_user(self, state: dict[str, Any]) -> None:
        """The optimizer's ``state_dict()`` as the user's configuration would save it: their ``capturable`` settings,
        and host counters where they keep them (copied off the device, one sync each: a checkpoint's cost)."""
        for group, saved, user in zip(self.optimizer.param_groups, state.get("param_groups", []),
                                      self.user_capturable, strict=False):  # fmt: skip
            if user is None:
                continue
            saved["capturable"] = user
            if _on_host(group, user):
                for index in saved["params"]:
                    entry = state["state"].get(index, {})
                    step = entry.get("step")
                    if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                        state["state"][index] = {**entry, "step": step.cpu()}  # the live state keeps its own

    def _add_pending(self) -> None:
        moved = set(self._moved_params())
        for p in self._pending:
            if p in moved:
                self._counts[p] = self._counts.get(p, 0.0) + self._pending_updates
                self._device.setdefault(p, self.optimizer.state[p]["step"])  # made by the first of those updates
        self._pending, self._pending_updates = [], 0

    def _set_flags(self, flag: bool | None) -> None:
        """Every group's ``capturable`` to ``flag`` (``None``: the user's), where the group has that setting."""
        for group, user in zip(self.optimizer.param_groups, self.user_capturable, strict=False):
            if user is not None:
                group["capturable"] = user if flag is None else flag

    def _moved_params(self) -> list[nn.Parameter]:
        """The parameters whose counters the user keeps on the host."""
        groups = zip(self.optimizer.param_groups, self.user_capturable, strict=False)
        return [p for group, user in groups if _on_host(group, user) for p in group["params"]]


def _on_host(group: dict[str, Any], user_capturable: bool | None) -> bool:
    """Whether the user's configuration keeps ``group``'s step counters on the host (``capturable`` and ``fused``
    both off)."""
    return user_capturable is False and not group.get("fused")
