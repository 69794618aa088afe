"""One CUDA graph over a module's forward and backward, for any call signature, that cannot cost the run.

Small models spend most of a training step launching kernels from the CPU; per-region graphs (``mode=
"reduce-overhead"``) still launch once per region and copy at every region boundary. :class:`GraphedModule`
captures the whole module (compiled regions included) with :func:`~lightning_fuse.replay.capture` and replays
the forward and the backward as one launch each.

Third-party models are called with keyword arguments and return ``ModelOutput``s, dicts or tuples holding
``None``: the call's inputs and outputs are flattened with torch's pytree utilities, only the tensor leaves live in
the graph, and the rest is rebuilt around each replay. An output leaf that is neither a tensor nor a plain value (a
cache object, say) leaves the module uncaptured, with a one-line reason. Before capturing, two eager probes run the
module on the captured inputs: the first compiles every region for these shapes and records the output's shape;
the second must not compile and, on CUDA, runs with host syncs raising (CPU tensors copied in forward, ``.item()``):
what would fail inside a capture fails here, harmlessly; a probe's output that outlives its call is collected
before the capture (its autograd graph would fail it: :func:`_free_outlived`). If the capture fails anyway, the
RNG state, buffers, gradients and the autocast cache are restored and the module runs as before. Batches of another
signature, eval mode, and eager reference steps run the module as usual.

Example::

    >>> import torch
    >>> net = torch.nn.Linear(4, 4)
    >>> graphed = GraphedModule("net", net)
    >>> graphed.install()
    >>> net(torch.randn(2, 4)).shape  # on CPU the module simply runs as before
    torch.Size([2, 4])
    >>> graphed.uninstall()
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_fuse import compat, replay
from lightning_fuse.compiler import PLAIN, describe_error, forced_eager
from lightning_fuse.graph_slots import SLOTS, OutputSlots
from lightning_fuse.held_gradients import own_kept_gradients, own_kept_gradients_before_backward
from lightning_fuse.host_syncs import host_syncs_raise
from lightning_fuse.regions import has_params, is_metric
from lightning_fuse.state import Snapshot

TRAINABLE_SETS = 2
"""How many sets of trainable parameters a module keeps graphs for at once: a GAN's two optimizers, each switching
the other's parameters off (Lightning's ``toggle_optimizer``), or a backbone before and after it is unfrozen."""
SET_REPLACEMENTS = 4
"""How often the graphs of the set used least recently make way for a new set: the plan search's set (every
parameter trains outside the training step) for the training steps' sets, an unfreezing schedule's stages. Beyond
that, a new set runs without a graph rather than capture again and again."""
HELD = ("its outputs were still held after their step (kept for an epoch-end metric, say), and the next replay "
        "would overwrite them: keep copies (`.detach().clone()`) to keep the graph")
"""Why a module's graph ends when a step's outputs outlive it (:mod:`~lightning_fuse.graph_slots`)."""


class Uncapturable(Exception):
    """The module's call cannot live in a CUDA graph; the message says why in one line.

    Example::

        >>> str(Uncapturable("its output holds a DynamicCache"))
        'its output holds a DynamicCache'
    """


def graph_target(root: nn.Module) -> tuple[str, nn.Module]:
    """The top-level child of ``root`` holding the most parameters: the network that ``training_step`` calls.

    Raises:
        ValueError: If ``root`` has no child with parameters.
    """
    children = [(n, m) for n, m in root.named_children() if has_params(m) and not is_metric(m)]
    if not children:
        raise ValueError(
            "cuda_graph needs the LightningModule to hold its network as a child module (e.g. self.model); none "
            "with parameters was found. Use cuda_graph=False."
        )
    return max(children, key=lambda item: sum(p.numel() for p in item[1].parameters()))


class FlatCall(nn.Module):
    """``module(*args, **kwargs)`` as a function of the call's tensor leaves alone, returning tensor leaves alone.

    ``make_graphed_callables`` takes and returns tensors only; this adapter carries the rest (the pytree
    structure, keyword names, non-tensor inputs and outputs) around it. The module is held as a child, so its
    parameters are the graph's parameters (frozen ones get no gradient).

    Args:
        module: The module to call.
        run: How to call it (its installed compiled call, or its plain call).
        args: The positional arguments of the call to capture.
        kwargs: Its keyword arguments.

    Raises:
        Uncapturable: From :meth:`forward`, if the output holds a leaf that is neither a tensor nor a plain value.

    Example::

        >>> lin = torch.nn.Linear(2, 2)
        >>> flat = FlatCall(lin, compat.plain_call(lin), (), {"input": torch.ones(1, 2)})
        >>> outs = flat(*flat.tensors((), {"input": torch.ones(1, 2)}))
        >>> flat.rebuild(outs).shape
        torch.Size([1, 2])
    """

    def __init__(self, module: nn.Module, run: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.target = module
        self._run = run
        leaves, self._in_spec = compat.tree_flatten((args, kwargs))
        self._in_slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        # not the call's tensors: a region's input is the region before it's output, which would look held past its
        # step (on an H200, 9 of HF Wav2Vec2's 12 layers lost their graphs so)
        self._in_constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self._out_spec: Any = None
        self._out_leaves: list[tuple[bool, Any]] = []  # (is a tensor, the plain value)
        self.trained = [p for p in module.parameters() if p.requires_grad]

    def tensors(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
        return self.pick(compat.tree_leaves((args, kwargs)))

    def pick(self, leaves: list[Any]) -> tuple[torch.Tensor, ...]:
        """The graph's inputs among a call's flattened leaves."""
        return tuple(leaves[i] for i in self._in_slots)

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self._in_constants)
        for slot, tensor in zip(self._in_slots, tensors):
            leaves[slot] = tensor
        args, kwargs = compat.tree_unflatten(leaves, self._in_spec)
        out_leaves, self._out_spec = compat.tree_flatten(self._run(*args, **kwargs))
        odd = [type(leaf).__name__ for leaf in out_leaves if not isinstance(leaf, (torch.Tensor, *PLAIN))]
        if odd:
            raise Uncapturable(f"its output holds a {odd[0]}, which a graph replay cannot rebuild")
        self._out_leaves = [(isinstance(leaf, torch.Tensor), None if isinstance(leaf, torch.Tensor) else leaf)
                            for leaf in out_leaves]  # fmt: skip
        return tuple(leaf for leaf in out_leaves if isinstance(leaf, torch.Tensor))

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        """The module's output from the replayed tensor leaves and the plain leaves seen at capture."""
        replayed = iter(tensors)
        leaves = [next(replayed) if is_tensor else leaf for is_tensor, leaf in self._out_leaves]
        return compat.tree_unflatten(leaves, self._out_spec)


def call_signature(args: tuple, kwargs: dict) -> tuple:
    """What a replay must match: the call's structure, each tensor's shape, dtype and ``requires_grad``, and the
    value of every plain non-tensor input (other objects by identity).

    Example::

        >>> call_signature((torch.ones(2),), {"flag": True}) == call_signature((torch.zeros(2),), {"flag": True})
        True
    """
    return _signature(*compat.tree_flatten((args, kwargs)))


def _signature(leaves: list[Any], spec: Any) -> tuple:
    return (spec, tuple(_leaf_key(leaf) for leaf in leaves))


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
    return leaf if isinstance(leaf, PLAIN) else ("object", id(leaf))


class GraphedModule:
    """Routes a module's training forward through one captured CUDA graph when the call's signature allows it.

    Args:
        name: The module's dotted name (for messages).
        module: The module whose ``forward`` (and backward) is captured.
        capture: ``make_graphed_callables``-like function (injectable, so the bookkeeping is testable on a CPU):
            :func:`~lightning_fuse.replay.capture` by default.
        on_device: Whether a tensor input may enter the graph (CUDA tensors by default).
        compiles: Returns the number of compiles so far; a probe that compiles twice is not captured.
        max_graphs: Graphs it may capture, one per call signature.
        on_capture_failure: Called with this GraphedModule, disabled, after its capture failed.

    The graph is captured on the first eligible call after :attr:`capture_allowed` is set: training mode, grad
    enabled, not under ``set_stance("force_eager")``, every tensor input on the device. A module that cannot be
    captured (:attr:`disabled_reason` says why) runs as before.

    Example::

        >>> g = GraphedModule("model", torch.nn.Linear(2, 2)); g.capture_allowed
        False
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        capture: Callable[..., Any] | None = None,
        on_device: Callable[[torch.Tensor], bool] = lambda tensor: tensor.is_cuda,
        compiles: Callable[[], int] = lambda: 0,
        max_graphs: int = 1,
        on_capture_failure: Callable[[GraphedModule], None] | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.capture_allowed = False
        self.captured_during_last_call = False
        self.replays = 0
        self.grads_zeroed_after_forward = False
        """Set per step (:meth:`begin_step`): the gradients are zeroed between this step's forward and backward
        (Lightning's automatic optimization at an optimizer step's first micro-batch), so held gradients are copied at
        the backward, where zeroing set them to ``None`` (nothing to copy), not at the forward (every gradient copied
        for nothing)."""
        self.disabled_reason: str | None = None
        self._capture_fn = capture or replay.capture
        self._on_device = on_device
        self._compiles = compiles
        self.max_graphs = max_graphs
        self._on_capture_failure = on_capture_failure
        self._graphs: dict[tuple, tuple[FlatCall, Any]] = {}  # ((call, trainable set), slot) -> (adapter, replay)
        self._slots = OutputSlots()
        self._params = list(module.parameters())
        self._said: set[str] = set()  # the info lines said once
        self._replacements_left = SET_REPLACEMENTS
        self._calls = 0
        self._last_call: dict[tuple, int] = {}  # set of trainable parameters -> the last call with it
        self._inner: Any = None
        self._capturing = False

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    @property
    def graphs(self) -> int:
        """How many graphs are captured (one per call signature, set of trainable parameters and slot)."""
        return len(self._graphs)

    def describe(self) -> str:
        """What became of the graph, for the fit's summary, e.g. ``graph: captured, 191 replays``.

        Example::

            >>> GraphedModule("model", torch.nn.Linear(2, 2)).describe()
            'graph: not captured (no eligible call)'
        """
        if self.captured:
            return f"graph: captured, {self.replays} replays"
        if self.replays:  # captured, then dropped: the model changed under it and capturing it again failed
            return f"graph: {self.replays} replays, then none ({self.disabled_reason or 'released'})"
        return f"graph: not captured ({self.disabled_reason or 'no eligible call'})"

    def install(self) -> None:
        # Sit where Module.compile sits, outside any compiled region of the module itself, so the capture decision
        # runs in Python even when the whole module is compiled.
        self._inner = compat.compiled_call_impl(self.module)
        compat.set_compiled_call_impl(self.module, self)

    def uninstall(self) -> None:
        if compat.compiled_call_impl(self.module) is self:
            compat.set_compiled_call_impl(self.module, self._inner)

    def release(self) -> None:
        """Drop every captured graph; their memory pools go with the collection that follows, run only when there
        were some (with none it cost a warm MobileNet fit 0.3 s as the losing candidates were released). The
        module's parameters are read again: the next eligible call captures over them as they are now (renamed or
        given new storage, :mod:`~lightning_fuse.module_state`)."""
        self._params = list(self.module.parameters())
        self._slots.forget()
        if self._graphs:
            self._graphs.clear()
            gc.collect()

    def disable(self, reason: str, warn: bool = True) -> None:
        """Run without the graph for the rest of the fit, with one warning saying why (``warn=False``: none, where
        another module's warning says it)."""
        if self.disabled_reason is None:
            self.disabled_reason = reason
            self.release()
            if warn:
                rank_zero_warn(f"FuseCallback: no CUDA graph over {self.name!r}: {reason}. It runs without one.")

    def begin_step(self, grads_zeroed_after_forward: bool) -> None:
        """A training step begins (:attr:`grads_zeroed_after_forward` says how its gradients are zeroed)."""
        self.grads_zeroed_after_forward = grads_zeroed_after_forward
        self._slots.begin_step()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.captured_during_last_call = False
        leaves, spec = compat.tree_flatten((args, kwargs))  # once per call: this is every training step's path
        if self._capturing or not self._eligible(leaves):
            return self.run_inner(*args, **kwargs)
        # a graph computes the gradients of the parameters that trained at its capture: a layer unfrozen since
        # (Lightning's BackboneFinetuning), or the other optimizer's half (toggle_optimizer), needs a graph of its own
        signature = (_signature(leaves, spec), tuple(p.requires_grad for p in self._params))
        self._calls += 1
        self._last_call[signature[1]] = self._calls
        key = self._slots.free(signature)
        if key is None:  # each graph's last outputs are still needed: a third view of the batch, say
            self._say_once("busy", f"FuseCallback: {self.name!r} was called while the last outputs of each of its "
                           f"{SLOTS} graphs for the call were still needed (awaiting their backward, or kept): such "
                           "calls run without a graph.")
            return self.run_inner(*args, **kwargs)
        if key in self._graphs and self._slots.held(key):
            self.disable(HELD)
            return self.run_inner(*args, **kwargs)
        if key not in self._graphs and self.capture_allowed and self._make_room(key):
            self._capture(key, leaves, args, kwargs)
            self.captured_during_last_call = key in self._graphs
        if key not in self._graphs:
            self._say_if_trainable_changed(signature)
            return self.run_inner(*args, **kwargs)
        flat, graphed = self._graphs[key]
        if not self.grads_zeroed_after_forward:
            own_kept_gradients(flat.trained)
        try:
            outputs = graphed(*flat.pick(leaves))
            self._slots.replayed(key, outputs)
            if self.grads_zeroed_after_forward:
                own_kept_gradients_before_backward(outputs, flat.trained)
            out = flat.rebuild(outputs)
        except Exception as err:  # noqa: BLE001 - a replay that fails costs the graph, never the run
            self.disable(f"its replay failed ({describe_error(err)})")
            return self.run_inner(*args, **kwargs)
        self.replays += 1
        return out

    def _make_room(self, key: tuple) -> bool:
        """Whether a graph for ``key`` may be captured: at most ``max_graphs`` call signatures, each for at most
        :data:`TRAINABLE_SETS` sets of trainable parameters, the set used least recently making way for a new one
        :data:`SET_REPLACEMENTS` times (each set with its slots: :mod:`~lightning_fuse.graph_slots`)."""
        (call, trainable), _ = key
        if len({c for (c, _), _ in self._graphs} | {call}) > self.max_graphs:
            return False
        trainable_sets = {t for (_, t), _ in self._graphs}
        if trainable in trainable_sets or len(trainable_sets) < TRAINABLE_SETS:
            return True
        if not self._replacements_left:
            return False
        self._replacements_left -= 1
        oldest = min(trainable_sets, key=self._last_call.__getitem__)
        for old in [old for old in self._graphs if old[0][1] == oldest]:
            del self._graphs[old]
        gc.collect()  # the dropped graphs' memory pools go
        return True

    def _say_if_trainable_changed(self, signature: tuple) -> None:
        """Once: a call like a captured one but with a set of trainable parameters the graphs no longer follow
        runs without a graph."""
        if any(call == signature[0] for (call, _), _ in self._graphs):
            self._say_once("trainable", f"FuseCallback: the parameters that train in {self.name!r} changed (a layer "
                           f"frozen or unfrozen) more often than its CUDA graphs follow ({TRAINABLE_SETS} sets at "
                           f"once, {SET_REPLACEMENTS} replaced): calls with a new set run without a graph.")

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            rank_zero_info(message)

    def run_inner(self, *args: Any, **kwargs: Any) -> Any:
        """The module as it runs without the graph: its compiled call if it is a region, else its plain call."""
        return (self._inner or compat.plain_call(self.module))(*args, **kwargs)

    def _eligible(self, leaves: list[Any]) -> bool:
        if self.disabled_reason is not None or not self.module.training or not torch.is_grad_enabled():
            return False
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        return bool(tensors) and not forced_eager() and all(self._on_device(t) for t in tensors)

    def _capture(self, key: tuple, leaves: list[Any], args: tuple, kwargs: dict) -> None:
        flat = FlatCall(self.module, self.run_inner, args, kwargs)
        tensors = static_inputs(flat.pick(leaves))
        self._capturing = True  # the capture calls the module: those calls must reach the inner module
        probed: int | None = None  # the compiles counted once the probes passed
        try:
            with restored_on_failure(self.module):
                probe_outputs = self._probe(flat, tensors)
                probed = self._compiles()
                _free_outlived(probe_outputs)
                graphed = self._capture_fn(flat, tensors, num_warmup_iters=3)
            graphed = graphed.__dict__.pop("forward") if isinstance(graphed, nn.Module) else graphed
            replay.release_capture_graph(graphed)
            self._graphs[key] = (flat, graphed)
            again = " for a call made again before the backward (a second view of the batch)" if key[1] else ""
            rank_zero_info(f"FuseCallback: captured a CUDA graph over {self.name!r} forward+backward{again} "
                           f"({len(self._graphs)} so far; at most {self.max_graphs} per set of trainable parameters).")
        except Uncapturable as err:
            self.disable(str(err))
        except Exception as err:  # noqa: BLE001 - a capture failure must not cost the run
            self.disable(self._capture_failure(err, probed))
        finally:
            self._capturing = False
        if self.disabled_reason is not None and self._on_capture_failure is not None:
            self._on_capture_failure(self)

    def _capture_failure(self, err: Exception, probed: int | None) -> str:
        """Why the capture failed, for the warning: a region that compiled inside it says so (the code around the
        regions took another path while capturing: transformers builds an attention mask only then)."""
        if probed is not None and self._compiles() != probed:
            return ("its compiled regions compiled again inside the capture, which no capture survives (the code "
                    "around them may take another path while a CUDA graph is captured, as transformers' attention "
                    f"masks do: {describe_error(err)})")  # fmt: skip
        return f"the capture failed ({describe_error(err)})"

    def _probe(self, flat: FlatCall, tensors: tuple[torch.Tensor, ...]) -> list[weakref.ref]:
        """Two eager forward+backward passes outside any capture; what would fail inside one fails here. Returns
        weak references to their outputs."""
        outputs = _forward_backward(flat, tensors)  # compiles every region for these shapes; checks the leaves
        before = self._compiles()
        with host_syncs_raise(any(t.is_cuda for t in tensors)):
            outputs += _forward_backward(flat, tensors)
        if self._compiles() != before:
            raise Uncapturable("its compiled regions compile again at every call, so they cannot be captured")
        return outputs


def describe_graphs(graphs: Sequence[GraphedModule]) -> str:
    """What became of a plan's graphs, for the fit's summary: one graph's :meth:`GraphedModule.describe`, or, with
    a graph per region, how many were captured and replayed, and why the first region without one has none.

    Example::

        >>> layers = [torch.nn.Linear(2, 2) for _ in range(3)]
        >>> graphs = [GraphedModule(f"layers.{i}", layer) for i, layer in enumerate(layers)]
        >>> describe_graphs(graphs)
        'graphs: 0 of 3 regions captured, 0 replays; 3 without one (layers.0: no eligible call)'
    """
    if len(graphs) == 1:
        return graphs[0].describe()
    line = f"graphs: {sum(g.captured for g in graphs)} of {len(graphs)} regions captured, "
    line += f"{sum(g.replays for g in graphs)} replays"
    missing = [graph for graph in graphs if not graph.captured]
    if missing:
        why = missing[0].disabled_reason or "no eligible call"
        line += f"; {len(missing)} without one ({missing[0].name}: {why})"
    return line


def static_inputs(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The graph's own input buffers, copies of the capture call's inputs: every replay copies its inputs into
    them, so they must not be the caller's tensors (a batch kept on the device, a slice of a dataset held there,
    would be overwritten by each later batch).

    Example::

        >>> batch = torch.ones(2, requires_grad=True)
        >>> (copy,) = static_inputs([batch])
        >>> copy.data_ptr() != batch.data_ptr(), copy.requires_grad, copy.is_leaf
        (True, True, True)
    """
    return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)


def _forward_backward(flat: FlatCall, tensors: tuple[torch.Tensor, ...]) -> list[weakref.ref]:
    """One forward and backward of ``flat`` that leaves every ``.grad`` untouched; weak references to its outputs."""
    outputs = [o for o in flat(*tensors) if o.requires_grad]
    inputs = [i for i in (*tensors, *flat.parameters()) if i.requires_grad]
    if outputs and inputs:
        torch.autograd.grad(outputs, inputs, [torch.ones_like(o) for o in outputs], allow_unused=True)
    return [weakref.ref(o) for o in outputs]


def _free_outlived(outputs: list[weakref.ref]) -> None:
    """Collect the garbage where an output of the probe outlived its call, so that its autograd graph goes before
    the capture.

    That graph holds the parameters' ``AccumulateGrad`` nodes, made on the probe's stream; while they live, the
    capture's backward, on a stream of its own, accumulates through them and waits across streams, which no capture
    survives. On an H200, each of five warm fits of HF Whisper (graph breaks in its forward, its compile from the
    cache) lost its graph at this point: torch warned that "the AccumulateGrad node's stream does not match" in the
    capture's warm-up, and the capture failed ("operation failed due to a previous error during capture"); in the two
    fits where a diagnostic listed what was alive there, an earlier output of the compiled network (loss, logits,
    the encoder's last state) was, referred to by its output object and two lists only. The cold fits, whose search
    captured after a long compile, did not fail. A collection frees what only a reference cycle holds; it costs up
    to 0.3 s in a large process, so it runs only where an output outlived its call.

    Example::

        >>> out = torch.ones(1, requires_grad=True) * 2
        >>> _free_outlived([weakref.ref(out)])  # alive: collects
    """
    if any(ref() is not None for ref in outputs):
        gc.collect()


@contextmanager
def restored_on_failure(module: nn.Module) -> Iterator[None]:
    """Whatever the block raises, leave the process as it was: RNG states, the module's buffers and gradients, the
    autocast cache, the graph's memory; buffers are restored on success too (warmup forwards update batch-norm
    statistics).

    Example::

        >>> bn = torch.nn.BatchNorm1d(2)
        >>> with restored_on_failure(bn):
        ...     _ = bn(torch.randn(4, 2))
        >>> bn.running_mean.tolist()
        [0.0, 0.0]
    """
    snapshot = Snapshot(module)
    try:
        yield
    except BaseException:
        gc.collect()  # the failed graph and its private memory pool
        if torch.cuda.is_initialized():
            with suppress(RuntimeError):  # the failed capture's own error, raised again here: already reported
                torch.cuda.synchronize()  # a capture that failed on the device says so here, not in the next step
                torch.cuda.empty_cache()
        snapshot.restore_rng()
        snapshot.restore_grads()
        torch.clear_autocast_cache()
        raise
    finally:
        snapshot.restore_buffers()
