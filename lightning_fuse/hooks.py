"""What a fit puts on the model and on torch, and takes off at its end.

:class:`FitHooks` holds each of them: the recorder of the network's training inputs (until the plan is chosen),
``use_cache=False`` in an HF causal LM's training calls and its ``generate`` run eagerly
(:mod:`~lightning_fuse.kv_cache`), cuDNN attention left out where the lengths vary
(:class:`~lightning_fuse.call_shapes.NoCudnnAttention`), the backward guard (:mod:`~lightning_fuse.guard`), dynamo's
recompile limit raised for the regions, the compile cache's environment (:mod:`~lightning_fuse.cache`), the buckets
that pad the batches (:mod:`~lightning_fuse.buckets`), and the watch on the model's parameters and buffers
(:mod:`~lightning_fuse.module_state`).
:meth:`FitHooks.install` puts them on at fit start, :meth:`FitHooks.remove` takes every one off.

Example::

    >>> import torch
    >>> net = torch.nn.Linear(2, 2)
    >>> hooks = FitHooks()
    >>> hooks.start_recording(net)
    >>> _ = net(torch.zeros(3, 2))
    >>> hooks.shapes.calls, hooks.recorded[0][0].shape
    (1, torch.Size([3, 2]))
    >>> hooks.remove()  # the recorder, and whatever else was put on, taken off
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_fuse import compat
from lightning_fuse.buckets import PadToBuckets
from lightning_fuse.call_shapes import CallShapes, NoCudnnAttention
from lightning_fuse.guard import BackwardGuard, EagerRescue
from lightning_fuse.kv_cache import EagerGeneration, NoCacheInTraining
from lightning_fuse.module_state import StateWatch
from lightning_fuse.randomness import RandomDraws

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins import Precision

    from lightning_fuse.cache import CompileCache


@dataclass
class FitHooks:
    """The hooks and settings of one fit, each removed by :meth:`remove`.

    Example::

        >>> FitHooks().buckets is None
        True
    """

    no_cache: NoCacheInTraining | None = None
    generation: EagerGeneration | None = None
    guard: BackwardGuard | None = None
    rescue: EagerRescue | None = None
    """Runs the network compiled where eager refuses a call for its size, until the plan is chosen and in its eager
    reference steps (one process)."""
    attention: NoCudnnAttention = field(default_factory=NoCudnnAttention)
    """cuDNN attention off in the plan's steps and the eager reference's, where the lengths vary."""
    cache: CompileCache | None = None
    buckets: PadToBuckets | None = None
    shapes: CallShapes = field(default_factory=CallShapes)
    """The shapes of the network's training calls before the plan was chosen."""
    recorded: tuple[tuple, dict] | None = None
    """The network's last training call before the plan was chosen: the plan search's input."""
    random: RandomDraws = field(default_factory=RandomDraws)
    """Whether the network's calls before the plan was chosen drew random numbers (dropout, a layer or a function)."""
    saved_recompile_limit: int | None = None
    state: StateWatch | None = None
    """Whether the model's parameters and buffers were renamed or given new storage since the last look."""
    _recorder: list[Any] = field(default_factory=list)

    @classmethod
    def install(cls, network: nn.Module, pl_module: pl.LightningModule, precision: Precision,
                on_failure: Callable[[str], bool], pad_buckets: Sequence[int] | None,
                rescue_compile: dict[str, Any] | None = None) -> FitHooks:  # fmt: skip
        """Put a fit's hooks on: ``use_cache=False`` and the input recorder on ``network``, eager ``generate``, the
        backward guard and the state watch on ``pl_module`` (``on_failure``: the plan dropped or handed over,
        :meth:`~lightning_fuse.fit.FitState.fail_plan`; a redone step runs in ``precision``'s autocast and loss
        scale), the buckets where ``pad_buckets`` are given, and the rescue of eager's refusals where its
        ``torch.compile`` arguments, ``rescue_compile``, are given (:class:`~lightning_fuse.guard.EagerRescue`)."""
        hooks = cls(buckets=PadToBuckets(pad_buckets) if pad_buckets else None)
        if rescue_compile is not None:
            hooks.rescue = EagerRescue(network, rescue_compile)
            hooks.rescue.install()
        hooks.no_cache = NoCacheInTraining(network)
        hooks.no_cache.install()
        hooks.generation = EagerGeneration(pl_module)
        hooks.generation.install()
        hooks.start_recording(network)
        scaler = getattr(precision, "scaler", None)  # 16-mixed: a redone loss is scaled like the first
        hooks.guard = BackwardGuard(on_failure, precision.forward_context,
                                    scaler.scale if scaler is not None else lambda loss: loss)  # fmt: skip
        hooks.guard.install(pl_module)
        hooks.state = StateWatch(pl_module)
        return hooks

    def start_recording(self, network: nn.Module) -> None:
        """Record the network's training inputs (and their shapes), and whether its calls draw random numbers,
        until :meth:`stop_recording` (which ends the rescue of eager's refusals too)."""
        # first of the hooks: the search replays the call as the training step makes it, so that a graph it captures
        # has the signature the training calls have (not the one other hooks, use_cache=False, turn it into)
        self._recorder = [network.register_forward_pre_hook(self._record, with_kwargs=True, prepend=True),
                          *self.random.watch_module(network)]  # fmt: skip

    def _record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled():
            self.recorded = (args, kwargs)
            self.shapes.add(args, kwargs)

    def stop_recording(self) -> None:
        for handle in self._recorder:
            handle.remove()
        self._recorder = []
        if self.rescue is not None:
            self.rescue.uninstall()

    def raise_recompile_limit(self, regions: int, limit: int, modules: Sequence[nn.Module] = ()) -> None:
        """Raise dynamo's recompile limit for ``regions`` regions that may recompile ``limit`` times each, above the
        entries that earlier compiles in this process left on ``modules``' forward code (:meth:`remove` puts it
        back). Where those entries reached the limit, dynamo would run every call eagerly, without a word."""
        self.saved_recompile_limit = compat.dynamo_recompile_limit()
        # Regions of one class share dynamo's cache (one code object), so dynamo's own per-code limit (8) would be
        # reached before ours; our limit is per region and enforced in compiler.CompiledRegion.
        codes = (getattr(type(module).forward, "__code__", None) for module in modules)
        left = max((compat.cache_entries(code) for code in codes if code is not None), default=0)
        wanted = min(256, left + (limit + 1) * max(1, regions))
        compat.set_dynamo_recompile_limit(max(self.saved_recompile_limit, wanted))

    @contextmanager
    def eager_reference(self, bypassed: AbstractContextManager[None]) -> Iterator[None]:
        """An eager reference step: inside ``bypassed`` (the plan's modules run their plain call), with eager's
        refusals of the network's call for its size rescued where the fit rescues them (:attr:`rescue`)."""
        with bypassed, self.rescue.installed() if self.rescue is not None else nullcontext():
            yield

    def set_plan_step(self, plan_step: bool, reference: bool = False) -> None:
        """The plan's steps (``plan_step``) run without the KV cache and, where the lengths vary, without cuDNN
        attention; eager steps run the user's call as written, and its settings except that an eager reference
        step (``reference``) leaves cuDNN attention out too (:class:`~lightning_fuse.call_shapes.NoCudnnAttention`
        says why)."""
        if self.no_cache is not None:
            self.no_cache.enabled = plan_step
        self.attention.enabled = plan_step or reference

    def remove(self) -> None:
        """Take off everything :meth:`install` put on, and put torch's settings back."""
        self.stop_recording()
        if self.no_cache is not None:
            self.no_cache.uninstall()
        if self.generation is not None:
            self.generation.uninstall()
        self.attention.restore()
        if self.guard is not None:
            self.guard.uninstall()
        if self.cache is not None:
            self.cache.deactivate()
        if self.saved_recompile_limit is not None:
            compat.set_dynamo_recompile_limit(self.saved_recompile_limit)
            self.saved_recompile_limit = None
