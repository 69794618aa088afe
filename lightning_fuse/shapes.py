"""Dynamic dims on batches, a batch's size and its items, and accounting of compiles, recompiles and graph breaks
per region.

Example::

    >>> import torch
    >>> dims = DynamicDims({"x": [0]})
    >>> sizes = dims.apply({"x": torch.zeros(8, 3), "y": torch.zeros(8)})
    >>> sizes
    {(0, 8)}
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader

from lightning_fuse.compat import (
    compilation_metrics,
    compile_event,
    dynamo_counters,
    maybe_mark_dynamic,
    register_compile_callbacks,
    remove_compile_callbacks,
)
from lightning_fuse.options import AUTO, DimSpec, check_dim_spec

ModeKey = tuple[bool, bool, bool]
"""(module.training, grad enabled, inference mode): each combination legitimately has its own graph."""


class DynamicDims:
    """Marks the dims of batch tensors that vary, so a partial batch or a new length does not recompile.

    Args:
        spec: ``"auto"`` marks dim 0 of every tensor in the batch when its loader can yield a partial last batch;
            ``None`` marks nothing; a mapping from a batch key (a ``str`` for dict or
            dataclass batches, an ``int`` index for tuple/list batches) to the dims that vary, e.g.
            ``{"input_ids": [0, 1]}`` or ``{0: [0]}``.

    Raises:
        TypeError: If ``spec`` is not ``"auto"``, ``None`` or a mapping of keys to lists of ints.
        ValueError: On the first batch, if a key is missing from it or a dim is out of range.

    Example::

        >>> import torch
        >>> DynamicDims({0: [0]}).apply((torch.zeros(4, 2), torch.zeros(4)))
        {(0, 4)}
    """

    def __init__(self, spec: str | DimSpec | None = AUTO) -> None:
        self.spec = check_dim_spec(spec)

    def apply(self, batch: Any, partial_possible: bool = True) -> set[tuple[int, int]]:
        """Mark the declared dims on ``batch`` and return the ``(dim, size)`` pairs marked.

        ``partial_possible`` says whether the batch's loader can yield a partial last batch (the ``"auto"`` rule).
        """
        if not self.spec or (self.spec == AUTO and not partial_possible):
            return set()
        if self.spec == AUTO:
            return {_mark(tensor, 0) for tensor in _tensors(batch) if tensor.dim() > 0 and tensor.shape[0] > 1}
        marked = set()
        for key, dims in self.spec.items():
            entry = self._lookup(batch, key)
            for tensor in _tensors(entry):
                for dim in dims:
                    self._check_dim(key, tensor, dim)
                    if tensor.shape[dim] > 1:  # sizes 0 and 1 are always specialised by dynamo
                        marked.add(_mark(tensor, dim))
        return marked

    def _lookup(self, batch: Any, key: str | int) -> Any:
        found, value = _get(batch, key)
        if not found:
            raise ValueError(
                f"`dynamic_dims` names key {key!r}, but the batch ({type(batch).__name__}) has keys "
                f"{_keys(batch)}. Use one of those (str keys for dict/dataclass batches, int indices for tuples)."
            )
        return value

    def _check_dim(self, key: str | int, tensor: torch.Tensor, dim: int) -> None:
        if not -tensor.dim() <= dim < tensor.dim():
            raise ValueError(
                f"`dynamic_dims[{key!r}]` names dim {dim}, but that batch entry has shape {tuple(tensor.shape)} "
                f"({tensor.dim()} dims). Use a dim in [0, {tensor.dim() - 1}]."
            )


def batch_size(batch: Any) -> int:
    """Dim 0 of the first tensor in the batch (1 for a batch without tensors)."""
    first = next(_tensors(batch), None)
    return int(first.shape[0]) if first is not None and first.dim() > 0 else 1


def count_items(length_fn: Callable[[Any], Any], batch: Any) -> float | torch.Tensor:
    """``length_fn(batch)``, kept as a tensor if it is one (no host sync per step), or a ``TypeError`` that says what
    it returned instead."""
    items = length_fn(batch)
    if isinstance(items, torch.Tensor) and items.numel() == 1:
        return items.detach().reshape(()).float()
    if isinstance(items, (int, float)) and not isinstance(items, bool):
        return float(items)
    got = f"a tensor of shape {tuple(items.shape)}" if isinstance(items, torch.Tensor) else (
        f"{type(items).__name__}: {items!r:.80}"
    )
    raise TypeError(
        "`length_fn` must return the number of items in a batch (an int, a float or a one-element tensor), "
        f"got {got}. Example: length_fn=lambda batch: batch['attention_mask'].sum()."
    )


def can_yield_partial_batch(loaders: Any) -> bool:
    """Whether any of ``loaders`` (a DataLoader or a collection of them) can yield a partial last batch."""
    found = []
    apply_to_collection(loaders, DataLoader, found.append)
    for loader in found:
        dataset = loader.dataset
        if loader.batch_size is None and loader.batch_sampler is None:
            continue  # the dataset yields ready batches: a size change recompiles once, as plain torch.compile does
        if loader.batch_size is None or not hasattr(dataset, "__len__"):
            return True  # a batch sampler or an iterable dataset: assume it can
        if len(dataset) % loader.batch_size and not loader.drop_last:
            return True
    return not found and loaders is not None


def mark_dims(batch: Any, dims: Collection[int], static: Mapping[int, Collection[int]] | None = None
              ) -> set[tuple[int, int]]:  # fmt: skip
    """Mark ``dims`` dynamic on every tensor of ``batch`` that has them (sizes 0 and 1 stay static, as dynamo
    specialises them, and so do the sizes ``static`` names for a dim: those it held in inputs where it never
    varied, :meth:`~lightning_fuse.call_shapes.CallShapes.static_sizes`); returns the ``(dim, size)`` pairs
    marked, for :func:`mark_region_inputs`.

    Example::

        >>> mark_dims({"input_ids": torch.zeros(2, 7), "labels": torch.zeros(2)}, {1})
        {(1, 7)}
        >>> mark_dims({"input_ids": torch.zeros(2, 7), "pixel_values": torch.zeros(2, 3, 4, 4)}, {1}, {1: {3}})
        {(1, 7)}
    """
    static = static or {}
    return {_mark(tensor, dim) for tensor in _tensors(batch) for dim in dims if dim < tensor.dim() and
            tensor.shape[dim] > 1 and tensor.shape[dim] not in static.get(dim, ())}  # fmt: skip


def mark_region_inputs(args: Sequence[Any], sizes: set[tuple[int, int]]) -> None:
    """Carry the batch's dynamic dims onto a region's tensor inputs (same dim index, same size).

    Activations entering a region are new tensors each step, so marks on the batch do not reach them.
    """
    for arg in args:
        if isinstance(arg, torch.Tensor):
            for dim, size in sizes:
                if dim < arg.dim() and arg.shape[dim] == size:
                    maybe_mark_dynamic(arg, dim)


def _mark(tensor: torch.Tensor, dim: int) -> tuple[int, int]:
    maybe_mark_dynamic(tensor, dim)
    return dim % tensor.dim(), tensor.shape[dim]


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))


def _get(batch: Any, key: str | int) -> tuple[bool, Any]:
    if isinstance(batch, Mapping):
        return (key in batch, batch.get(key))
    if isinstance(batch, (list, tuple)) and isinstance(key, int):
        return (-len(batch) <= key < len(batch), batch[key] if -len(batch) <= key < len(batch) else None)
    if dataclasses.is_dataclass(batch) and isinstance(key, str):
        return (hasattr(batch, key), getattr(batch, key, None))
    if isinstance(batch, torch.Tensor) and key == 0:
        return (True, batch)
    return (False, None)


def _keys(batch: Any) -> list[Any]:
    if isinstance(batch, Mapping):
        return list(batch)
    if isinstance(batch, (list, tuple)):
        return list(range(len(batch)))
    if dataclasses.is_dataclass(batch):
        return [f.name for f in dataclasses.fields(batch)]
    return []


@dataclass
class RegionCompiles:
    """What torch.compile did for one region.

    Example::

        >>> stats = RegionCompiles(recompiles_by_code=Counter({"0": 2, "3": 1}))
        >>> stats.recompiles, stats.most_recompiles_of_one_code
        (3, 2)
    """

    compiles: int = 0
    recompiles_by_code: Counter[str] = field(default_factory=Counter)
    """Recompiles per code object (dynamo's frame): a region whose code breaks into several frames recompiles each
    for a new kind of input, as torch's own limit (per code object) allows."""
    graph_breaks: int = 0
    compile_s: float = 0.0
    recompile_reasons: list[str] = field(default_factory=list)
    break_reasons: list[str] = field(default_factory=list)
    modes: set[tuple[ModeKey, str]] = field(default_factory=set)
    """The (mode, compile settings) pairs the region has been called under."""

    @property
    def recompiles(self) -> int:
        return sum(self.recompiles_by_code.values())

    @property
    def most_recompiles_of_one_code(self) -> int:
        return max(self.recompiles_by_code.values(), default=0)


class CompileTracker:
    """Attributes dynamo's compiles to the region being called, using torch's own compile callbacks and metrics.

    Compiles during a region's first call in a mode (train/eval, grad, inference) under a plan's compile settings
    are expected, however many frames that call compiles; any compile in a later call under a known mode and
    settings is a recompile, with dynamo's ``recompile_reason``. Another plan's settings make torch compile the
    same code anew (dynamo's BACKEND_MATCH): the plan's own compile, not a recompile for a new kind of input. A
    compiled graph's backward, compiled at its first call, adds its time only; a CUDA graph that torch's cudagraph
    trees record (their callbacks fire too) is no compile at all: it counts in :attr:`recordings`.

    Example::

        >>> tracker = CompileTracker()
        >>> tracker.install()
        >>> tracker.total_compiles
        0
        >>> tracker.remove()
    """

    OUTSIDE = "(outside regions)"
    _MAX_REASONS = 5

    def __init__(self) -> None:
        self.regions: dict[str, RegionCompiles] = {}
        self.total_s = 0.0
        self.total_compiles = 0
        self.recordings = 0
        """CUDA graphs torch's cudagraph trees recorded (each size's forward and backward)."""
        self._current: tuple[str, bool] | None = None
        self._started: float | None = None
        self._breaks_before: Counter[str] = Counter()
        self._last_metric: Any = None
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            register_compile_callbacks(self._on_start, self._on_end)
            self._last_metric = next(reversed(compilation_metrics()), None)
            self._installed = True

    def remove(self) -> None:
        if self._installed:
            remove_compile_callbacks(self._on_start, self._on_end)
            self._installed = False

    @contextmanager
    def calling(self, name: str, mode: ModeKey, settings: str = "") -> Iterator[None]:
        """Attribute compiles that happen inside the block to region ``name`` running in ``mode`` under the compile
        ``settings`` of a plan (e.g. ``repr`` of its ``torch.compile`` arguments)."""
        stats = self.stats(name)
        compiles_before, recompiles_before = stats.compiles, stats.recompiles
        key = (mode, settings)
        outer, self._current = self._current, (name, key in stats.modes)
        try:
            yield
        finally:
            self._current = outer
            stats.modes.add(key)
            if stats.compiles != compiles_before:  # dynamo records its metrics once the frame is done
                new_metrics = self._new_metrics()  # read past a first compile's too (its BACKEND_MATCH reason)
                if stats.recompiles != recompiles_before:
                    _extend_capped(stats.recompile_reasons, _recompile_reasons(new_metrics), self._MAX_REASONS)

    def stats(self, name: str) -> RegionCompiles:
        stats = self.regions.get(name)  # every region call asks: a new RegionCompiles only for a new name
        return stats if stats is not None else self.regions.setdefault(name, RegionCompiles())

    @property
    def total_recompiles(self) -> int:
        return sum(r.recompiles for r in self.regions.values())

    @property
    def total_graph_breaks(self) -> int:
        return sum(r.graph_breaks for r in self.regions.values())

    def _on_start(self, *_: Any) -> None:
        self._started = time.perf_counter()
        self._breaks_before = _graph_breaks()

    def _on_end(self, callback_args: Any = None) -> None:
        elapsed = time.perf_counter() - self._started if self._started is not None else 0.0
        self._started = None
        trigger, code = compile_event(callback_args)
        if trigger == "CUDAGRAPH_RECORDING":  # torch's cudagraph trees recording a graph: no compile
            self.recordings += 1
            return
        self.total_s += elapsed
        if trigger != "DYNAMO" or self._current is None:  # a lazy backward compile, code outside any region: time
            self.stats(self.OUTSIDE).compile_s += elapsed
            return
        self.total_compiles += 1
        name, mode_seen = self._current
        stats = self.stats(name)
        stats.compile_s += elapsed
        new_breaks = _graph_breaks() - self._breaks_before
        stats.graph_breaks += sum(new_breaks.values())
        _extend_capped(stats.break_reasons, new_breaks, self._MAX_REASONS)
        stats.compiles += 1
        if mode_seen:
            stats.recompiles_by_code[code] += 1

    def _new_metrics(self) -> list[Any]:
        """Dynamo's compilation metrics recorded since the last call."""
        metrics = compilation_metrics()
        # compile ids restart after torch._dynamo.reset(), so find the new entries by identity
        start = next((i + 1 for i in range(len(metrics) - 1, -1, -1) if metrics[i] is self._last_metric), 0)
        self._last_metric = metrics[-1] if metrics else None
        return list(metrics[start:])


def _graph_breaks() -> Counter[str]:
    """Dynamo's graph breaks so far, with the graphs a backend compiler refused: dynamo runs such a graph
    uncompiled ("Adding a graph break") and counts it apart, as unimplemented, in one message of many lines."""
    counters = dynamo_counters()
    refused = Counter({_refusal(key): n for key, n in counters["unimplemented"].items()
                       if key.startswith("Backend compiler exception")})  # fmt: skip
    return Counter(counters["graph_break"]) + refused


def _refusal(message: str) -> str:
    """A refused graph's reason in one line: dynamo's explanation and the last frame of its traceback."""
    explanation = re.search(r"Explanation: (.*)", message)
    frames = re.findall(r'File "(?:.*/)?([^"/]+)", line (\d+), in (\S+)', message)
    where = f" (at {frames[-1][0]}:{frames[-1][1]}, in {frames[-1][2]})" if frames else ""
    return (explanation.group(1) if explanation else message.splitlines()[0]) + where


def _recompile_reasons(metrics: Sequence[Any]) -> list[str]:
    reasons = [m.recompile_reason for m in metrics if m.recompile_reason]
    return reasons or ["a guard failed (dynamo recorded no reason; run with TORCH_LOGS=recompiles)"]


def explain_graph_break(reason: str) -> str:
    """A one-line fix for the most common graph-break causes."""
    text = reason.lower()
    if "backend compiler" in text:
        return ("the compiler refused the graph: it runs uncompiled and is refused again in every run, warm starts "
                "too. Usual cause: a value read (.item(), .tolist()) in a custom backward, as transformers 5.17's MoE "
                "grouped-mm fallback does (expert weights not in bf16; 5.24's is a custom op): upgrade transformers "
                "or keep the experts in bf16")
    if "data-dependent" in text or "data dependent" in text or ".item()" in text or "tensor.item" in text:
        return "data-dependent control flow or .item(): keep values as tensors (torch.where) or move it out"
    if "print" in text or "logging" in text or "log(" in text:
        return "printing/logging inside the region: move it out of the compiled module"
    if "unsupported" in text or "call_function" in text:
        return "an unsupported Python/library call: move it out of the region or wrap it in torch.compiler.disable"
    return "see TORCH_LOGS=graph_breaks for the full trace"


def _extend_capped(target: list[str], new: Any, cap: int) -> None:
    for reason in new:
        if len(target) >= cap:
            return
        reason = " ".join(str(reason).split())  # one line in the summary table
        if reason not in target:
            target.append(reason)


def warn_recompile(name: str, stats: RegionCompiles, marked: Collection[int] = (), evaluating: bool = False) -> None:
    """Warn (once per region, the caller ensures) that a region recompiled, with dynamo's reason and what to do
    (``marked``: the dims the fit marks dynamic on the region's inputs; declaring one of them is not the fix;
    ``evaluating``: the call was not a training one, in eval mode or without grad).

    Example::

        >>> import warnings
        >>> stats = RegionCompiles(recompiles_by_code=Counter({"0": 1}),
        ...                        recompile_reasons=["0/1: GLOBAL_STATE changed: grad_mode"])
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always"); warn_recompile("block", stats)
        >>> "`dynamic_dims` does not help" in str(caught[0].message)
        True
    """
    reason = stats.recompile_reasons[-1] if stats.recompile_reasons else "unknown"
    mismatch = re.search(r"size mismatch at index (\d+)(?:\. expected (\d+), actual (\d+))?", reason)
    one_sized = mismatch and {mismatch.group(2), mismatch.group(3)} & {"0", "1"}
    if one_sized or "0/1 specialization" in reason:
        hint = ("A dim met a size of 0 or 1, which torch compiles as a constant even in a dim marked dynamic: the "
                "calls where it is 0 or 1 and the others compile versions of their own (a last batch of one, say), "
                "and an input holding several such tensors (a detection batch's boxes, a tensor an image) compiles "
                "one for each mix, up to the recompile limit. Where it keeps recompiling, compile the parts whose "
                "inputs keep their sizes (`targets`, e.g. the backbone) or keep these sizes above 1")
    elif mismatch and int(mismatch.group(1)) in marked:
        hint = (f"Dim {mismatch.group(1)} was marked dynamic, but the first compile specialised it (code that sets "
                "it beside a static size, as an attention mask's other dims do): torch's automatic dynamic shapes "
                "compile it dynamic now, nothing to do unless it keeps recompiling")
    elif "KeyError on" in reason and ("._parameters[" in reason or "._buffers[" in reason):
        hint = ("A parameter or buffer of the region was removed or renamed (torch.nn.utils.prune, which Lightning's "
                "ModelPruning calls, turns a pruned `weight` into `weight_orig` and a mask): the region compiles "
                "again for the module as it now is, so `dynamic_dims` does not help. Nothing to do where it "
                "happens once a pruning")
    elif "GLOBAL_STATE" in reason:
        hint = ("The code ran under another global setting than when it was compiled (grad mode, autocast, a "
                "default dtype): dynamo compiles a version for each, so `dynamic_dims` does not help. Nothing to do "
                "where the settings are few (part of a forward under torch.no_grad, as a loss's matcher runs)")
    elif "G[" in reason and "size mismatch" not in reason:
        hint = ("The guard is on a global Python value, not on an input's size, so `dynamic_dims` does not help: "
                "dynamo compiles a version for each value the code meets. Where it grows call by call (a list each "
                "layer appends to, as transformers records output_router_logits or output_attentions), each layer "
                "compiles once, at the first step; turn that output off in training to compile one")
    elif evaluating:
        hint = ("It recompiled in an evaluation call (eval mode or no grad: a validation loop's), not in a training "
                "step: torch compiles such sizes dynamic after a few, and the training calls keep what was compiled "
                "for them. Nothing to do unless it keeps recompiling")
    else:
        hint = "If a batch dim or sequence length varies, declare it with `dynamic_dims`, e.g. {'x': [0]}"
    rank_zero_warn(f"FuseCallback: region {name!r} recompiled ({stats.recompiles}x so far). Reason: {reason}. {hint}.")
