"""The optimizer's update as one CUDA graph replay, kept where the whole training step measures faster with it.

At small batch a step's GPU work is a few milliseconds, and the optimizer's host work is a large share of what is
left once the forward and backward are one replay: a foreach AdamW launches a dozen operations per chunk of
tensors, and loops over the parameters in Python. :class:`OptimizerGraph` captures ``optimizer.step()``'s update
once and replays it at every later step, as NeMo's and Megatron's whole-step graphs do, but inside Lightning's loop
and as a measured choice:

- **Where it sits.** The torch optimizer's ``step`` is replaced on the instance (the only public point between
  Lightning's closure and the update: Lightning calls ``optimizer.step(closure=...)`` from its precision plugin).
  The replacement runs the closure (Lightning's forward, backward and gradient clipping) and then the update:
  replayed, or the optimizer's own ``step()``. Uninstalling puts the optimizer back as it was.
- **Gradient clipping.** Lightning's clipping (its precision plugin's ``clip_gradients``) is captured with the
  update where a :class:`~lightning_fuse.clipping.ClippingInUpdate` is given: the replay clips the graph's gradient
  buffers, and an eager update is preceded by the plugin's own clipping. A step clipping otherwise than at the
  capture (another value or algorithm) runs the optimizer's own update.
- **What the replay reads.** The gradients are copied into the graph's own buffers (one ``_foreach_copy_``, on each
  rank's own shards of them under FSDP2); the learning rate of each parameter group is a device tensor the graph
  reads, refilled when a scheduler changed the group's ``lr`` (which stays a float for everything else that reads
  it); Adam's step counters live on the device
  (``capturable=True``, which checkpoints do not keep: :meth:`OptimizerGraph.as_saved_without`). The eager
  updates run as the user configured them, with the counters where the user keeps them
  (:class:`~lightning_fuse.step_counters.StepCounters`), so that an eager reference step costs what the user's
  own step costs.
- **Which kernel.** Where the user left Adam's implementation to torch, the replay runs torch's fused kernel
  (:func:`_fused_in_graph`): the foreach update under ``capturable=True`` launches two small kernels per parameter
  beside its chunked ones. The eager updates keep the user's implementation.
- **When it steps eagerly instead.** Eager reference steps (:attr:`enabled` off), a step whose set of parameters
  with gradients differs from the capture's, after the optimizer's other hyperparameters or its state were replaced
  (said once), and when the capture failed (said once): every such step is the optimizer's own, so a run never
  trains differently for it.
- **Kept by measurement.** After the capture, whole steps alternate in blocks between the replay and the eager
  update (:class:`~lightning_fuse.optimizer_trial.Trial`); the graph stays only where the median whole step is
  below :data:`~lightning_fuse.optimizer_trial.KEEP_BELOW` of eager's. Each eager block starts on an idle device
  (:meth:`~lightning_fuse.timing.StepTimer.wait_for_device`), or the GPU work the replays left queued would be
  timed as the eager update's steps.
  With several processes, rank zero's trial decides for every rank (:func:`settle_together`): a rank that kept its
  graph and one that dropped it would update with different kernels, and their parameters would drift apart.

Only Adam, AdamW and SGD as torch ships them are taken (an optimizer that evaluates its closure several times, or
one with step hooks, is left alone), and no ``GradScaler`` (its step skips updates on the host's word).

Example::

    >>> net = torch.nn.Linear(2, 2)
    >>> optimizer = torch.optim.AdamW(net.parameters())
    >>> print(OptimizerGraph.refusal(optimizer, scaler=None, on_cuda=False))
    the parameters are not on a CUDA device
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_fuse import compat, replay, sharding
from lightning_fuse.clipping import ClipKey, ClippingInUpdate
from lightning_fuse.compiler import describe_error
from lightning_fuse.optimizer_trial import BLOCK_STEPS, EAGER, GRAPH, TRIAL_BLOCKS, Trial
from lightning_fuse.step_counters import StepCounters
from lightning_fuse.timing import StepTimer

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""Optimizers whose update is captured: each evaluates its closure once, and takes a device tensor as its learning
rate inside a capture (Adam and AdamW with ``capturable=True``)."""
SETTLE_EVERY = 2 * (TRIAL_BLOCKS + 1) * BLOCK_STEPS
"""With several processes, the training steps between two shares of rank zero's verdict (:func:`settle_together`):
one trial and a block pair more, so that the first share usually finds the trial done."""
Capture = Callable[[Callable[[], None]], Callable[[], None]]


def cuda_capture(update: Callable[[], None]) -> Callable[[], None]:
    """Record ``update()`` into a CUDA graph (its kernels do not run) and return the graph's replay."""
    graph = torch.cuda.CUDAGraph()
    with replay.capture_failure_undone(), torch.cuda.graph(graph):
        update()
    return graph.replay


class OptimizerGraph:
    """Replays one torch optimizer's update from a CUDA graph while :attr:`enabled`, where it measures faster.

    Args:
        optimizer: A torch optimizer (see :meth:`refusal` for which).
        capture: ``update -> replay`` (:func:`cuda_capture`; injectable, so the bookkeeping is testable on a CPU).
        timer: Times the trial's whole steps (one mark per ``step()`` call).
        decides_alone: Whether this process's trial decides (one process); ``False``: it only measures, and
            :meth:`settle` applies the verdict shared by rank zero (:func:`settle_together`).
        clipping: Where Lightning's gradient clipping is handed to the graph (``None``: Lightning clips in place,
            before the update).

    Example::

        >>> net = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> graph = OptimizerGraph(optimizer, capture=lambda update: update)  # on CPU: "replay" runs the update
        >>> graph.install()
        >>> for _ in range(3):
        ...     net(torch.ones(1, 2)).sum().backward()
        ...     optimizer.step(); optimizer.zero_grad()
        >>> graph.replays  # the first step ran eagerly, the second captured
        2
        >>> graph.uninstall()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, capture: Capture = cuda_capture,
                 timer: StepTimer | None = None, decides_alone: bool = True,
                 clipping: ClippingInUpdate | None = None) -> None:  # fmt: skip
        self.optimizer = optimizer
        self.decides_alone = decides_alone
        self.enabled = True
        self.replays = 0
        self.disabled_reason: str | None = None
        self.trial = Trial()
        self._capture_fn = capture
        self._timer = timer or StepTimer(_device_of(optimizer))
        self._previous_step: Callable[..., Any] | None = None
        self._counters = StepCounters(optimizer)  # the graph's configuration, or the user's for eager updates
        self._replay: Callable[[], None] | None = None
        self._warm = False  # one eager update in the capture's configuration ran
        self._params: list[nn.Parameter] = []
        self._grads: list[torch.Tensor] = []  # the graph's gradient buffers
        self._grad_shards: list[torch.Tensor] | None = None  # under FSDP2, this rank's shards of them
        self._lrs: list[torch.Tensor] = []  # the graph's learning rates, one per group
        self._fused: list[bool] = []  # per group: the graph updates with torch's fused kernel (_fused_in_graph)
        self._lr_seen: list[float] = []
        self._settings: list[dict[str, Any]] = []
        self._owner: tuple[Any, Any] = (None, None)
        self._last_mode: str | None = None
        self._untimed_step = False  # the step running holds a capture, a compile or a recording: the trial skips it
        self._clipping = clipping
        self._in_closure = False
        self._pending_clip: tuple[ClipKey, Callable[[], None]] | None = None  # the closure's clipping, not yet run
        self._captured_clip: ClipKey | None = None

    @staticmethod
    def refusal(optimizer: torch.optim.Optimizer, scaler: Any, on_cuda: bool) -> str | None:
        """Why ``optimizer``'s update is not captured (``None``: it may be).

        Example::

            >>> OptimizerGraph.refusal(torch.optim.LBFGS(torch.nn.Linear(1, 1).parameters()), None, True)
            'LBFGS is not one of Adam, AdamW, SGD (each evaluates its closure once)'
        """
        if type(optimizer) not in SUPPORTED:
            names = ", ".join(cls.__name__ for cls in SUPPORTED)
            return f"{type(optimizer).__name__} is not one of {names} (each evaluates its closure once)"
        if not on_cuda:
            return "the parameters are not on a CUDA device"
        if scaler is not None:
            return "a GradScaler steps it (fp16 mixed precision), skipping updates on the host's word"
        if compat.has_step_hooks(optimizer):
            return "it has step hooks, which a replay would not run"
        if any(isinstance(group["lr"], torch.Tensor) for group in optimizer.param_groups):
            return "its learning rate is a tensor already"
        if isinstance(optimizer, torch.optim.SGD) and not all(group["fused"] for group in optimizer.param_groups):
            return "SGD reads its learning rate as a number unless fused=True"
        return None

    @property
    def captured(self) -> bool:
        return self._replay is not None

    def install(self) -> None:
        self._previous_step = compat.replace_optimizer_step(self.optimizer, self._step)
        if self._clipping is not None:
            self._clipping.add(self.optimizer, self.take_clipping)

    def uninstall(self) -> None:
        """The optimizer as before :meth:`install`: its own ``step``, its ``capturable`` settings, no graph."""
        if self._previous_step is not None:
            compat.restore_method(self.optimizer, "step", self._previous_step)
            self._previous_step = None
        if self._clipping is not None:
            self._clipping.remove(self.optimizer)
        self.release()

    def release(self) -> None:
        """Drop the graph and its buffers; the optimizer's settings and step counters go back as the user had them.
        Where it was not disabled, the next steps warm up and capture it again (over parameters given new storage,
        :mod:`~lightning_fuse.module_state`)."""
        self._replay, self._grads, self._grad_shards, self._lrs, self._warm = None, [], None, [], False
        self._counters.to_host()

    def as_saved_without(self, state: dict[str, Any]) -> None:
        """This optimizer's ``state_dict()`` as it would be without the graph: each group's ``capturable`` setting
        as the user made it, and Adam's step counters where that setting keeps them, so that a run resumed from the
        checkpoint steps as it would have.

        Example::

            >>> opt = torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())
            >>> graph = OptimizerGraph(opt); opt.param_groups[0]["capturable"] = True
            >>> state = opt.state_dict(); graph.as_saved_without(state); state["param_groups"][0]["capturable"]
            False
        """
        self._counters.as_saved_by_user(state)

    def describe(self) -> str:
        """What became of the graph, for the fit's summary."""
        if not self.replays:
            return f"optimizer step: eager ({self.disabled_reason or 'not captured'})"
        dropped_by_trial = self.trial.decided and not self.trial.keep  # the trial's verdict says why
        since = f"; eager since: {self.disabled_reason}" if self.disabled_reason and not dropped_by_trial else ""
        trial = self.trial.describe() if self.trial.decided or not self.disabled_reason else ""
        kernel = " (torch's fused kernel)" if any(self._fused) else ""
        return f"optimizer step: {self.replays} replays{kernel}{trial}{since}"

    # ------------------------------------------------------------------ the step
    def _step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The optimizer's ``step``: the closure (forward, backward, clipping), then the update."""
        self._time_trial()
        loss, self._pending_clip, own_step = None, None, self._previous_step  # no clip left by a closure that raised
        if closure is not None:
            self._in_closure = self.enabled and self.disabled_reason is None
            try:
                with torch.enable_grad():
                    loss = closure()
            finally:
                self._in_closure = False
        mode = self._update(own_step)
        if mode == GRAPH:
            compat.mark_optimizer_stepped(self.optimizer)  # as the LR scheduler's wrapper of step would
        self._last_mode = mode if self.enabled else None
        return loss

    def take_clipping(self, key: ClipKey, clip: Callable[[], None]) -> bool:
        """Take the closure's gradient clipping (``clip()``, as ``key`` says) into this step's update: ``False``
        outside this graph's step, or where its update runs eagerly for good (Lightning then clips at once)."""
        if self._in_closure:
            self._pending_clip = (key, clip)
        return self._in_closure

    def _update(self, own_step: Callable[..., Any]) -> str:
        """One update (the clipping taken from the closure first), replayed where it may be; returns how it ran.
        ``own_step``: the optimizer's, where the closure uninstalled the graph (a backward failed, the plan was
        dropped: found on an H200, where the step went on to call the replaced ``step``, gone, and the run ended)."""
        key, clip = self._pending_clip or (None, None)
        self._pending_clip = None
        if not (self._previous_step and self.enabled and self.trial.wants_graph()) or self.disabled_reason is not None:
            return self._eager_update(clip, own_step)
        if not self._still_captured_state() or (self.captured and key != self._captured_clip):
            return self._eager_update(clip)
        if not self._warm:
            _run(clip)  # on the gradients, as Lightning would have
            return EAGER if self._warm_up() else self._eager_update(None)
        self._counters.to_device()
        if not self.captured and not self._capture(key, clip):
            return self._eager_update(clip)
        grads = [p.grad for p in self._params]
        if not self._fit_buffers(grads) or not self._copy_in(grads):
            return self._eager_update(clip)
        self._refresh_lrs()
        self._replay()
        self._counters.updated(self._params)
        self.replays += 1
        return GRAPH

    def _eager_update(self, clip: Callable[[], None] | None, step: Callable[..., Any] | None = None) -> str:
        """The optimizer's own update (``step``, else the one replaced), as the user configured it
        (:mod:`~lightning_fuse.step_counters`)."""
        _run(clip)
        self._counters.to_host()
        (step or self._previous_step)()
        return EAGER

    def _warm_up(self) -> bool:
        """An eager update in the capture's configuration (device step counters, tensor learning rates): it creates
        the optimizer's state and loads its kernels, which a capture must find ready. ``False`` where the optimizer
        refused that configuration (before updating anything), said once."""
        try:
            self._configure_for_capture()
            self._with_graph_inputs(self._previous_step, grads=None)
            self._counters.updated(self._params)
        except Exception as err:  # noqa: BLE001 - the optimizer's own update runs instead
            self._disable(f"it refused to run as a CUDA graph needs ({describe_error(err)})")
            return False
        self._warm = True
        return True

    def _configure_for_capture(self) -> None:
        self._counters.to_device()
        compat.silence_uncaptured_warning(self.optimizer)  # eager reference steps run uncaptured on purpose
        self._params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        device = self._params[0].device if self._params else torch.device("cpu")
        self._lrs = [torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
                     for group in self.optimizer.param_groups]  # fmt: skip
        self._lr_seen = [float(group["lr"]) for group in self.optimizer.param_groups]
        self._fused = [_fused_in_graph(self.optimizer, group) for group in self.optimizer.param_groups]
        self._settings = [_settings(group, self.optimizer.defaults) for group in self.optimizer.param_groups]
        self._owner = (self.optimizer.state, self.optimizer.param_groups)

    def _capture(self, key: ClipKey | None, clip: Callable[[], None] | None) -> bool:
        """Capture the clipping ``clip`` (as ``key`` says; ``None``: none) and the update (neither runs); ``False``
        when it failed, said once."""
        self._grads = [torch.zeros_like(p) for p in self._params]
        self._grad_shards = sharding.local_shards(self._grads)
        step = self._previous_step

        def update() -> None:
            _run(clip)  # on the gradient buffers, which the parameters' .grad are while this runs
            step()

        try:
            params, grads = self._params, self._grads
            self._replay = self._capture_fn(lambda: self._with_graph_inputs(update, grads, params))
            self._untimed_step, self._captured_clip = True, key
        except Exception as err:  # noqa: BLE001 - a failed capture costs the graph, never the run
            self.release()
            self._disable(f"the capture failed ({describe_error(err)})")
            return False
        return True

    def _with_graph_inputs(self, step: Callable[[], Any], grads: Sequence[torch.Tensor] | None,
                           params: Sequence[nn.Parameter] = ()) -> None:  # fmt: skip
        """Run ``step()`` reading the graph's learning rates and, where given, its gradient buffers, with torch's
        fused kernel where :func:`_fused_in_graph` allows it; every group's ``lr`` and ``fused`` and every
        parameter's ``.grad`` are as before afterwards."""
        groups = self.optimizer.param_groups
        saved = [(group["lr"], group["fused"]) for group in groups]
        held = [p.grad for p in params]
        try:
            for group, lr, fused in zip(groups, self._lrs, self._fused, strict=True):
                group["lr"], group["fused"] = lr, fused or group["fused"]
            for p, grad in zip(params, grads or (), strict=False):
                p.grad = grad
            step()
        finally:
            for group, (lr, fused) in zip(groups, saved, strict=True):
                group["lr"], group["fused"] = lr, fused
            for p, grad in zip(params, held, strict=True):
                p.grad = grad

    def _refresh_lrs(self) -> None:
        """Give the graph the groups' learning rates where a scheduler changed them (one fill each, no sync)."""
        for i, group in enumerate(self.optimizer.param_groups):
            if group["lr"] != self._lr_seen[i]:
                self._lrs[i].fill_(group["lr"])
                self._lr_seen[i] = group["lr"]

    def _still_captured_state(self) -> bool:
        """Whether the optimizer still holds the state and settings the graph was made for; once it does not (its
        state loaded anew, a hyperparameter other than ``lr`` changed), the graph goes, said once."""
        if not self._warm:
            return True
        groups = self.optimizer.param_groups
        state, owned_groups = self._owner
        if state is not self.optimizer.state or owned_groups is not groups or len(groups) != len(self._settings):
            self._disable("its state or parameter groups were replaced")
            return False
        for group, settings in zip(groups, self._settings, strict=True):
            if _settings(group, self.optimizer.defaults) != settings:
                self._disable("a hyperparameter other than the learning rate changed")
                return False
        return True

    def _fit_buffers(self, grads: list[torch.Tensor | None]) -> bool:
        """Whether every captured parameter has a gradient of its buffer's shape, dtype and device (not a frozen
        parameter's ``None``, nor a sparse gradient), in one pass over them."""
        return all(g is not None and g.shape == b.shape and g.dtype == b.dtype and g.device == b.device
                   and not g.is_sparse for g, b in zip(grads, self._grads, strict=True))  # fmt: skip

    def _copy_in(self, grads: list[torch.Tensor]) -> bool:
        """Copy the gradients into the graph's buffers, each rank's own shard of them under FSDP2 (a sharded tensor
        has no multi-tensor copy); ``False`` where that failed, said once, with nothing updated yet."""
        try:
            sources = grads if self._grad_shards is None else sharding.local_shards(grads)
            compat.copy_tensors(self._grad_shards or self._grads, sources)
        except Exception as err:  # noqa: BLE001 - the optimizer's own update runs instead
            self._disable(f"its gradients could not be copied into the graph's buffers ({describe_error(err)})")
            return False
        return True

    def _disable(self, reason: str) -> None:
        if self.disabled_reason is None:
            self.disabled_reason = reason
            self.release()
            rank_zero_info(f"FuseCallback: the optimizer's update runs eagerly from now on: {reason}.")

    # ------------------------------------------------------------------ the trial
    def _time_trial(self) -> None:
        """Mark this step's start, which ends the step before: timed as the update that began it, when that step
        and this one both ran under the plan, while the trial runs."""
        if self.trial.decided:
            return
        if self._last_mode is not None and self.enabled and self.replays and not self._untimed_step:
            self._timer.stop(self._last_mode)
        self._untimed_step = False
        self.trial.advance(self._last_mode == GRAPH)
        if self._last_mode == GRAPH and not self.trial.wants_graph():
            self._timer.wait_for_device()  # an eager block is timed at its own pace, not as the replays' queue drains
        self._timer.start()
        if self.trial.due():
            times = self._timer.collect()
            self.trial.measure(times.get(GRAPH, []), times.get(EAGER, []))
            if self.decides_alone and self.trial.measured is not None:
                self.settle(self.trial.measured)

    def leave_step_untimed(self) -> None:
        """Keep the step running out of the trial: it compiled, or recorded one of torch's CUDA graphs (a one-time
        cost that would land in one block of the trial and bias its verdict)."""
        self._untimed_step = True

    def proposal(self) -> float | None:
        """This process's word for a shared verdict (:func:`settle_together`): its trial's ratio, ``inf`` where the
        graph is gone for good (disabled or uninstalled), ``None`` while the trial has too few steps to say."""
        if self.trial.decided:
            return self.trial.ratio
        if self.disabled_reason is not None or self._previous_step is None:
            return math.inf
        return self.trial.measured

    def settle(self, ratio: float) -> None:
        """Keep the graph where ``ratio`` (the whole step with it over the eager update's; ``inf``: rank zero's
        graph is gone) is below :data:`~lightning_fuse.optimizer_trial.KEEP_BELOW`, else run the optimizer's own
        update from now on."""
        if self.trial.decided:
            return
        if not math.isfinite(ratio):
            self._disable("rank zero's update runs eagerly, and every rank updates the same way")
            return
        self.trial.settle(ratio)
        if self.trial.keep:
            rank_zero_info(f"FuseCallback: the optimizer's update replays from a CUDA graph: whole steps "
                           f"measured {ratio:.2f}x of the eager update's.")  # fmt: skip
        else:
            self._disable(f"the trial measured it at {ratio:.2f}x of the eager update's whole step")


def install_optimizer_graphs(optimizers: Sequence[torch.optim.Optimizer], scaler: Any, device: torch.device,
                             capture: Capture | None = None, decides_alone: bool = True, precision: Any = None,
                             ) -> list[OptimizerGraph | None]:  # fmt: skip
    """An installed :class:`OptimizerGraph` for each optimizer that may have one (``None`` for the others, with
    one line saying why on CUDA). ``capture``: how to capture (``None``: :func:`cuda_capture`, on CUDA only);
    ``decides_alone``: one process (else :func:`settle_together` decides); ``precision``: the Trainer's precision
    plugin, whose gradient clipping the graphs take into their updates (``None``: it stays where it is).

    Example::

        >>> opt = torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())
        >>> install_optimizer_graphs([opt], None, torch.device("cpu"))
        [None]
    """
    on_cuda = device.type == "cuda" or capture is not None
    clipping = ClippingInUpdate(precision) if precision is not None else None
    graphs: list[OptimizerGraph | None] = []
    for optimizer in optimizers:
        refusal = OptimizerGraph.refusal(optimizer, scaler, on_cuda)
        if refusal is not None and on_cuda:
            rank_zero_info(f"FuseCallback: {type(optimizer).__name__}'s update runs eagerly: {refusal}.")
        graph = None if refusal else OptimizerGraph(optimizer, capture=capture or cuda_capture,
                                                    decides_alone=decides_alone, clipping=clipping)  # fmt: skip
        if graph is not None:
            graph.install()
        graphs.append(graph)
    return graphs


def settle_together(graphs: Sequence[OptimizerGraph | None], broadcast: Callable[[Any], Any]) -> bool:
    """With several processes: every rank's graphs take rank zero's word (:meth:`OptimizerGraph.proposal`, one
    ``broadcast`` for all of them); ``True`` once rank zero had a word for each, the same on every rank, so that
    every rank calls it at the same steps until then.

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1, fused=True)
        >>> graph = OptimizerGraph(opt, capture=lambda update: update, decides_alone=False)
        >>> settle_together([graph, None], broadcast=lambda words: [0.8, None])  # as rank zero measured
        True
        >>> graph.trial.keep
        True
    """
    words = broadcast([graph.proposal() if graph is not None else None for graph in graphs])
    for graph, word in zip(graphs, words, strict=True):
        if graph is not None and word is not None:
            graph.settle(word)
    return all(word is not None for graph, word in zip(graphs, words, strict=True) if graph is not None)


def _run(clip: Callable[[], None] | None) -> None:
    if clip is not None:
        clip()


def _settings(group: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters of a parameter group that the update reads (those the optimizer has ``defaults`` for)
    but its learning rate and ``capturable`` (set by the graph): the keys a scheduler adds for itself
    (``initial_lr``; SWALR's ``swa_lr``, made mid-fit by Lightning's StochasticWeightAveraging) are not among them.

    Example::

        >>> _settings({"lr": 0.1, "momentum": 0.9, "initial_lr": 0.1, "params": []}, {"lr": 0.01, "momentum": 0})
        {'momentum': 0.9}
    """
    return {key: group[key] for key in defaults if key in group and key not in ("lr", "capturable")}


def _fused_in_graph(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether the graph updates ``group`` with torch's fused Adam kernel: where the user left the implementation
    to torch (neither ``foreach`` nor ``fused`` set) and the parameters are real floating point on CUDA or the CPU.
    The update is the same up to float rounding, in one launch per chunk of tensors; the foreach update under
    ``capturable=True`` adds two kernels per parameter (its bias corrections). The eager updates keep the user's
    implementation."""
    return (isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and group.get("foreach") is None
            and group.get("fused") is None and not group.get("differentiable")
            and all(p.is_floating_point() and p.device.type in ("cuda", "cpu") for p in group["params"]))  # fmt: skip


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return params[0].device if params else torch.device("cpu")
