"""The fallbacks for a step that raises: in backward under a plan, or in eager's forward refused for its size.

A compiled region's forward falls back on its own (:mod:`lightning_fuse.compiler`), but its backward runs later,
inside Lightning's closure (``loss.backward()``, activation checkpointing's recomputation, gradient hooks), where
nothing of ours is on the stack. :class:`BackwardGuard` sits in the LightningModule's public ``backward`` hook,
which Lightning calls for automatic and manual optimization alike: if backward raises while a plan runs, the
plan is dropped (the model is eager from then on) or, under torch's cudagraph trees, handed over to the same
compile without them (:meth:`~lightning_fuse.fit.FitState.fail_plan`), the step's gradients are cleared, and with
automatic optimization the step is redone under what runs then (its ``training_step`` again, then backward; guarded
again where a plan took over), so the optimizer step that follows uses that plan's or eager's gradients. With manual
optimization the step's backward is skipped instead (Lightning gives no point from which to redo a user's whole
step); the plan search has already run every candidate's backward on the run's own inputs, so this is rare.

Before the plan, and in the eager reference steps after it, the network runs eagerly, and an eager kernel may refuse
a call for its size where compiled code would not: :class:`EagerRescue` runs such a call compiled, and FuseCallback
trains on compiled from then on.

Example::

    >>> import torch
    >>> from lightning.pytorch import LightningModule
    >>> module = LightningModule()
    >>> guard = BackwardGuard(on_failure=print)
    >>> guard.install(module)
    >>> "backward" in vars(module)
    True
    >>> guard.uninstall(); "backward" in vars(module)
    False
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn

from lightning_fuse import compat
from lightning_fuse.compiler import compilable_call, describe_error

SIZE_LIMITS = ("INT_MAX", "32-bit index", "canUse32BitIndexMath")
"""Words of the errors eager kernels raise for inputs too large for them (HF SegFormer at 64 images of 512 px on an
H200: "upsample_bilinear2d_nhwc only supports output tensors with less than INT_MAX elements"), where inductor's
code for the same call has no such limit."""


class BackwardGuard:
    """Redoes a step when its backward raises under a plan: eagerly, or under the plan handed over to.

    Args:
        on_failure: Called with the error's one-line description; it drops the plan or hands over to another, and
            returns whether a plan still runs (the redone step is then guarded as well).
        context: The context ``training_step`` runs in (the Trainer's precision: autocast), for the redo.
        scale: Applied to the redone loss before backward (a GradScaler's ``scale``), as Lightning did to the first.

    Example::

        >>> BackwardGuard(on_failure=print).armed
        False
    """

    def __init__(self, on_failure: Callable[[str], bool | None], context: Callable[[], Any] = nullcontext,
                 scale: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss) -> None:  # fmt: skip
        self.on_failure, self.context, self.scale = on_failure, context, scale
        self.armed = False  # a plan runs in this step: its backward is guarded
        self.redone_steps = 0
        self._module: LightningModule | None = None
        self._original: Any = None
        self._prior: Any = None
        self._step: tuple[Any, int] | None = None

    def install(self, module: LightningModule) -> None:
        # An instance attribute over LightningModule.backward, the public hook Lightning's precision plugins call
        # for every backward (manual_backward too); removed at teardown, so the class is never touched.
        self._module, self._original = module, module.backward
        self._prior = vars(module).get("backward")  # the user's own instance attribute, if any, comes back
        module.backward = self._backward

    def uninstall(self) -> None:
        if self._module is not None and vars(self._module).get("backward") == self._backward:
            if self._prior is None:
                del self._module.backward
            else:
                self._module.backward = self._prior
        self._module, self._step, self.armed = None, None, False

    def arm(self, batch: Any, batch_idx: int, armed: bool) -> None:
        """Before each step: the batch to redo it with, and whether a plan runs in it (eager steps are not guarded)."""
        self._step, self.armed = (batch, batch_idx), armed

    def _backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        while True:  # ends: a failed plan hands over at most once (on_failure), and an eager step is not guarded
            try:
                return self._original(loss, *args, **kwargs)
            except Exception as err:  # noqa: BLE001 - compiled code failed in backward: the plan goes, the run stays
                if not self.armed:
                    raise
                reason = describe_error(err)
            self.armed = bool(self.on_failure(f"backward raised {reason}"))
            self._module.zero_grad(set_to_none=True)
            if not self._module.automatic_optimization:
                rank_zero_warn("FuseCallback: with manual optimization this step's gradients were dropped; it is "
                               "skipped.")
                return None
            self.redone_steps += 1
            loss = self.scale(self._redo_loss())

    def _redo_loss(self) -> torch.Tensor:
        batch, batch_idx = self._step
        with self.context():
            out = self._module.training_step(batch, batch_idx)
        return out["loss"] if isinstance(out, Mapping) else out


def refused_for_size(error: BaseException) -> bool:
    """Whether ``error`` is an eager kernel refusing an input for its size (:data:`SIZE_LIMITS`).

    Example::

        >>> refused_for_size(RuntimeError("only supports output tensors with less than INT_MAX elements"))
        True
        >>> refused_for_size(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
        False
    """
    return isinstance(error, RuntimeError) and any(words in str(error) for words in SIZE_LIMITS)


class EagerRescue:
    """Runs the network compiled where eager's kernels refuse a call of it for its size (before a plan is chosen,
    and in the eager reference steps after it).

    Installed in the network's compiled-call slot (where ``Module.compile`` installs its own) while FuseCallback
    runs it eagerly to record its inputs (the sanity check, the first steps), and in each eager reference step
    (:meth:`installed`, the plan's modules bypassed): a call runs the plain network, and one that eager refuses
    (:func:`refused_for_size`) runs again, its running statistics put back as they were (but in a reference step),
    through ``torch.compile(network, **compile_kwargs)``, as do all later calls, out of the eager stance and any
    dispatch mode (under one, dynamo runs the compiled function's plain code). :attr:`reason` then says why, and
    FuseCallback trains on compiled from the start (:data:`~lightning_fuse.options.COMPILED_FROM_THE_START`): given
    that plan's ``torch.compile`` arguments, the rescue compiles what the plan then runs (dynamo reuses its code).
    Any other error passes.

    Example::

        >>> net = torch.nn.Linear(2, 2)
        >>> rescue = EagerRescue(net, {"backend": "eager"})
        >>> rescue.install()
        >>> net(torch.ones(1, 2)).shape, rescue.reason
        (torch.Size([1, 2]), None)
        >>> rescue.uninstall()
    """

    def __init__(self, network: torch.nn.Module, compile_kwargs: dict[str, Any]) -> None:
        self.network, self.compile_kwargs = network, compile_kwargs
        self.reason: str | None = None
        """Why eager's call was refused (``None``: it never was)."""
        self._compiled: Callable[..., Any] | None = None
        self._keeps_stats = True  # running statistics copied before each call, to put back after a refusal

    def install(self) -> None:
        """Take the network's compiled-call slot, unless something (the user's own compile) holds it already."""
        if compat.compiled_call_impl(self.network) is None:
            compat.set_compiled_call_impl(self.network, self._call)

    def uninstall(self) -> None:
        if compat.compiled_call_impl(self.network) == self._call:
            compat.set_compiled_call_impl(self.network, None)
        self._compiled = None

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Inside it, the rescue is installed (an eager reference step, with the plan's modules bypassed), without the
        copy of the running statistics before each call: one copy a buffer would slow the steps the reference times.
        A refused call's updates of them before it raised then stay (a batch norm counts that call twice)."""
        self._keeps_stats = False
        self.install()
        try:
            yield
        finally:
            self.uninstall()
            self._keeps_stats = True

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            stats = self._running_stats() if self._keeps_stats else []
            before = [stat.clone() for stat in stats]
            try:
                return compat.call_uncompiled(self.network, *args, **kwargs)
            except RuntimeError as err:
                if not refused_for_size(err):
                    raise
                self.reason = describe_error(err)
            with torch.no_grad():  # as they were before the refused call: it runs again
                for stat, saved in zip(stats, before, strict=True):
                    stat.copy_(saved)
            self._compiled = torch.compile(compilable_call(self.network), **self.compile_kwargs)
        try:
            with torch.compiler.set_stance("default"), compat.without_dispatch_modes():
                return self._compiled(*args, **kwargs)
        except Exception as err:
            if hasattr(err, "add_note"):  # Python 3.11+
                err.add_note(f"FuseCallback ran this call of the network compiled, as eager had refused one: "
                             f"{self.reason}")  # fmt: skip
            raise

    def _running_stats(self) -> list[torch.Tensor]:
        """The buffers a training call updates in place: those of the modules that track running statistics (a
        batch norm's mean, variance and count). Other buffers are not copied: some hold gigabytes (a static cache)."""
        return [buffer for module in self.network.modules() if getattr(module, "track_running_stats", False)
                for buffer in module.buffers(recurse=False)]  # fmt: skip
