"""FuseCallback's arguments: their defaults and allowed values, defined once, and checked before anything runs.

Every check names the argument, the value received and what to pass instead, so a mistake fails at
construction, not deep inside torch during the first step. The modules that act on a setting import its values
from here; this module imports none of them (only :mod:`~lightning_fuse.compat`, to ask torch which backends and
inductor options exist).

Example::

    >>> FuseOptions(mode="fast")
    Traceback (most recent call last):
    ...
    ValueError: `mode` must be one of auto, default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs, got 'fast'.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_origin

import torch
from torch import nn

from lightning_fuse.compat import inductor_option_type, inductor_options, is_backend

AUTO = "auto"
"""The value of every setting FuseCallback decides itself (targets, mode, cuda_graph, dynamic_dims)."""
FULL = "full"
"""``targets="full"``: the whole network as one region."""
Target = str | type
"""A dotted-name glob (``"model.blocks.*"``), a class name (``"Block"``), a class, or ``"auto"``/``"full"``."""
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""torch.compile's modes, the values of ``mode`` beside ``"auto"``."""
GRAPHING_MODES = ("reduce-overhead", "max-autotune")
"""torch.compile modes that record torch's own CUDA graphs, one per input shape."""
COMPILED_FROM_THE_START = {"mode": "reduce-overhead", "targets": "full", "eager_steps": 0, "verify": False}
"""FuseCallback's arguments for a model that runs compiled but not eagerly: the whole network compiled at the first
step, no eager reference, no region's first output checked against eager."""
LIMIT_ACTIONS = ("eager", "dynamic")
"""What ``on_recompile_limit`` may do with a region past its limit."""
RECOMPILE_LIMIT = 8
"""Compiles a region may make beyond its first before ``on_recompile_limit`` applies (the default)."""
REFERENCE_BUDGET = 0.02
"""Default share of the fit's training time that the eager reference (timed steps and lead-ins) may take."""
DimSpec = Mapping[str | int, Sequence[int]]
"""``dynamic_dims`` as a mapping: batch key (``str``) or index (``int``) -> the dims that vary."""


@dataclass(kw_only=True)
class FuseOptions:
    """The validated settings of a :class:`~lightning_fuse.FuseCallback` (see its docstring for each field).

    Example::

        >>> FuseOptions(eager_steps=4).reference_budget
        0.02
    """

    targets: Target | Sequence[Target] = AUTO
    exclude: Target | Sequence[Target] = ()
    mode: str = AUTO
    backend: str | Callable[..., Any] = "inductor"
    fullgraph: bool = False
    dynamic: bool | None = None
    options: Mapping[str, Any] | None = None
    cuda_graph: bool | str = AUTO
    optimizer_graph: bool = True
    dynamic_dims: str | DimSpec | None = AUTO
    verify: bool = True
    cache_dir: str | os.PathLike | bool | None = None
    recompile_limit: int = RECOMPILE_LIMIT
    on_recompile_limit: str = "eager"
    warmup_steps: int | None = None
    eager_steps: int = 20
    reference_budget: float = REFERENCE_BUDGET
    pad_buckets: Sequence[int] | None = None
    gpu_sample_hz: float = 10.0
    profile_steps: int = 0
    length_fn: Callable[[Any], int] | None = None

    def __post_init__(self) -> None:
        self.targets = normalize_targets(self.targets, "targets")
        self.exclude = normalize_targets(self.exclude, "exclude")
        _one_of("mode", self.mode, (AUTO, *MODES))
        _one_of("on_recompile_limit", self.on_recompile_limit, LIMIT_ACTIONS)
        _one_of("cuda_graph", self.cuda_graph, (AUTO, True, False))
        if not (isinstance(self.backend, str) or callable(self.backend)):
            raise TypeError(f"`backend` must be a backend name or a callable, got {type(self.backend).__name__}.")
        if isinstance(self.backend, str):
            _check_backend_name(self.backend)
        for name in ("fullgraph", "verify", "optimizer_graph"):
            _bool(name, getattr(self, name))
        if not (self.dynamic is None or isinstance(self.dynamic, bool)):
            raise TypeError(
                f"`dynamic` must be None, True or False, got {type(self.dynamic).__name__}: {self.dynamic!r}."
            )
        if self.options is not None and not isinstance(self.options, Mapping):
            raise TypeError(f"`options` must be a dict of inductor options or None, got {type(self.options).__name__}.")
        if self.options and self.backend == "inductor":
            _check_inductor_options(self.options)
        if self.options is not None and self.mode not in (AUTO, "default") and self.backend != "inductor":
            raise ValueError(
                f"`mode={self.mode!r}` and `options` combine only with backend='inductor', whose options a mode "
                f"stands for (torch.compile refuses both); with backend={self.backend!r}, pass one of them."
            )
        _int_at_least("recompile_limit", self.recompile_limit, 1)
        _int_at_least("eager_steps", self.eager_steps, 0)
        if isinstance(self.reference_budget, bool) or not isinstance(self.reference_budget, (int, float)):
            raise TypeError(
                f"`reference_budget` must be a fraction of the training time, got {self.reference_budget!r}."
            )
        check_reference_budget(self.reference_budget)
        if self.pad_buckets is not None:
            check_pad_buckets(self.pad_buckets)
        _int_at_least("profile_steps", self.profile_steps, 0)
        if self.warmup_steps is not None:
            _int_at_least("warmup_steps", self.warmup_steps, 0)
        if isinstance(self.gpu_sample_hz, bool) or not isinstance(self.gpu_sample_hz, (int, float)):
            raise TypeError(f"`gpu_sample_hz` must be a number (samples per second), got {self.gpu_sample_hz!r}.")
        if not 0 <= self.gpu_sample_hz <= 1000:
            raise ValueError(f"`gpu_sample_hz` must be in [0, 1000] (0 disables sampling), got {self.gpu_sample_hz}.")
        if self.length_fn is not None and not callable(self.length_fn):
            raise TypeError("`length_fn` must be a callable batch -> number of items (e.g. tokens), or None.")
        self.dynamic_dims = check_dim_spec(self.dynamic_dims)
        self._check_cache_dir()
        self._check_conflicts()

    def _check_cache_dir(self) -> None:
        if self.cache_dir is None or self.cache_dir is False:
            return
        if self.cache_dir is True:
            self.cache_dir = None
            return
        if not isinstance(self.cache_dir, (str, os.PathLike)):
            raise TypeError(f"`cache_dir` must be a path, None (default location) or False, got {self.cache_dir!r}.")
        check_writable(Path(self.cache_dir).expanduser(), "cache_dir")

    def _check_conflicts(self) -> None:
        if self.cuda_graph is True and self.mode in ("reduce-overhead", "max-autotune"):
            raise ValueError(
                f"`cuda_graph=True` and `mode={self.mode!r}` both capture CUDA graphs and cannot be combined. Use "
                "cuda_graph=True with mode='default' (one graph over the whole step), or cuda_graph=False."
            )
        if self.cuda_graph is True and isinstance(self.dynamic_dims, Mapping):
            raise ValueError(
                "`cuda_graph=True` needs static shapes but `dynamic_dims` declares varying dims. Use one: "
                "cuda_graph=False to compile with dynamic dims, or dynamic_dims='auto' (batches whose shape differs "
                "from the captured one, such as a partial last batch, then run without the graph)."
            )


def _check_backend_name(name: str) -> None:
    """Resolve ``name`` as torch.compile will (registered and entry-point backends), so a typo fails here."""
    if not name.strip():
        raise ValueError("`backend` is an empty string; use 'inductor' (default), 'aot_eager' or 'eager'.")
    if not is_backend(name):
        close = difflib.get_close_matches(name, torch.compiler.list_backends(exclude_tags=()), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"`backend` {name!r} is not a torch.compile backend.{hint} Use 'inductor' (default), 'aot_eager', "
            "'eager', a name from torch.compiler.list_backends(), or a callable; register a custom name with "
            "@torch._dynamo.register_backend before creating the callback."
        )


def _check_inductor_options(options: Mapping[str, Any]) -> None:
    """The check torch.compile makes on inductor ``options``, made here so a typo fails before fit."""
    known = inductor_options()
    if known is None:  # torch moved them: compat has warned, torch.compile checks at the first compile
        return
    for key, value in options.items():
        name = str(key).replace("-", "_")  # torch accepts both spellings
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"`options` key {key!r} is not an inductor option.{hint} torch._inductor.list_options() lists them."
            )
        expected = inductor_option_type(name)
        if isinstance(expected, type) and get_origin(expected) is None and not isinstance(value, expected):
            raise TypeError(  # generics such as list[str] cannot be checked with isinstance
                f"`options[{key!r}]` must be {expected.__name__}, got {type(value).__name__}: {value!r}."
            )


def _one_of(name: str, value: Any, allowed: Sequence[Any]) -> None:
    if isinstance(value, bool) and not any(a is value for a in allowed):
        raise ValueError(f"`{name}` must be one of {', '.join(map(str, allowed))}, got {value!r}.")
    if not isinstance(value, (str, bool)) or value not in allowed:
        raise ValueError(f"`{name}` must be one of {', '.join(map(str, allowed))}, got {value!r}.")


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False, got {type(value).__name__}: {value!r}.")


def _int_at_least(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}: {value!r}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}.")


def normalize_targets(value: Target | Sequence[Target], argument: str) -> tuple[Target, ...]:
    """Turn ``targets``/``exclude`` into a tuple, refusing anything that is not a string or a class.

    Raises:
        TypeError: If ``value`` or one of its items is neither a ``str`` nor a class.

    Example::

        >>> normalize_targets("model.blocks.*", "targets")
        ('model.blocks.*',)
    """
    items = (value,) if isinstance(value, (str, type)) else value
    if not isinstance(items, Sequence):
        raise TypeError(
            f"`{argument}` must be a string, a class, or a list of those, got {type(value).__name__}: {value!r}."
        )
    for item in items:
        if not isinstance(item, (str, type)):
            raise TypeError(
                f"`{argument}` items must be dotted-name globs, class names or classes, got "
                f"{type(item).__name__}: {item!r}. Example: targets=['model.blocks.*', MyAttention]."
            )
        if isinstance(item, type) and not issubclass(item, nn.Module):
            raise TypeError(f"`{argument}` class {item.__name__} is not a torch.nn.Module subclass.")
        if isinstance(item, str) and not item.strip():
            raise ValueError(f"`{argument}` contains an empty pattern; remove it or name a module.")
    return tuple(items)


def check_dim_spec(spec: Any) -> str | DimSpec | None:
    """``dynamic_dims`` checked: ``"auto"``, ``None`` (``False`` too) or a mapping of batch keys to lists of dims.

    Example::

        >>> check_dim_spec({"input_ids": 1})
        {'input_ids': (1,)}
    """
    if spec is None or spec is False or spec == AUTO:
        return None if spec is False else spec
    if not isinstance(spec, Mapping):
        raise TypeError(
            f'`dynamic_dims` must be "auto", None or a mapping like {{"x": [0]}} or {{0: [0]}}, got '
            f"{type(spec).__name__}: {spec!r}."
        )
    clean: dict[str | int, tuple[int, ...]] = {}
    for key, dims in spec.items():
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise TypeError(f"`dynamic_dims` keys must be str or int batch keys, got {key!r}.")
        dims = [dims] if isinstance(dims, int) else dims
        if not isinstance(dims, Sequence) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            raise TypeError(f"`dynamic_dims[{key!r}]` must be a list of ints (dims), got {dims!r}.")
        clean[key] = tuple(dims)
    return clean


def check_pad_buckets(sizes: Any) -> None:
    """Raise ``ValueError`` unless ``sizes`` is a non-empty list of positive lengths.

    Example::

        >>> check_pad_buckets([128, 256])
    """
    if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
        raise ValueError(f"`pad_buckets` must be a list of positive lengths, e.g. [128, 256, 512]; got {sizes!r}.")


def check_reference_budget(budget: float) -> None:
    """Raise ``ValueError`` unless ``budget`` is a share of the training time in (0, 0.5].

    Example::

        >>> check_reference_budget(0.02)
    """
    if not 0 < budget <= 0.5:
        raise ValueError(
            f"`reference_budget` must be in (0, 0.5], e.g. 0.02 for 2% of the training time, got {budget}. Use "
            "eager_steps=0 to turn the eager reference off."
        )


def check_writable(directory: Path, argument: str) -> None:
    """Raise a ``ValueError`` naming ``argument`` unless ``directory`` is (or can become) a writable directory."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"`{argument}` must be a directory, but {existing} is a file. Pass another path or False.")
    if not os.access(existing, os.W_OK):
        raise ValueError(
            f"`{argument}` directory {existing} is not writable. Pass a writable path, or `{argument}=False` to run "
            "without a persistent compile cache."
        )
