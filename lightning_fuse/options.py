"""FuseCallback's arguments, checked before anything runs.

Every check names the argument, the value received and what to pass instead, so a mistake fails at
construction, not deep inside torch during the first step. FuseCallback's signature takes its defaults from here
(:data:`RECOMPILE_LIMIT`, :data:`REFERENCE_BUDGET` and :data:`AUTO`, each defined by the module that acts on it).

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

from lightning_fuse.buckets import PadToBuckets
from lightning_fuse.compat import backend_names, inductor_option_type, inductor_options, is_backend
from lightning_fuse.compiler import LIMIT_ACTIONS, MODES, RECOMPILE_LIMIT
from lightning_fuse.regions import AUTO, Target, normalize_targets
from lightning_fuse.shapes import DimSpec, DynamicDims
from lightning_fuse.timing import REFERENCE_BUDGET, check_reference_budget


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
        if self.options is not None and self.mode not in (AUTO, "default"):
            raise ValueError(
                f"`mode={self.mode!r}` and `options` cannot be combined (torch.compile refuses both); put the mode's "
                "settings into `options`, e.g. options={'triton.cudagraphs': True} for reduce-overhead."
            )
        _int_at_least("recompile_limit", self.recompile_limit, 1)
        _int_at_least("eager_steps", self.eager_steps, 0)
        if isinstance(self.reference_budget, bool) or not isinstance(self.reference_budget, (int, float)):
            raise TypeError(
                f"`reference_budget` must be a fraction of the training time, got {self.reference_budget!r}."
            )
        check_reference_budget(self.reference_budget)
        if self.pad_buckets is not None:
            PadToBuckets(self.pad_buckets)  # raises here, at construction, for bad sizes
        _int_at_least("profile_steps", self.profile_steps, 0)
        if self.warmup_steps is not None:
            _int_at_least("warmup_steps", self.warmup_steps, 0)
        if isinstance(self.gpu_sample_hz, bool) or not isinstance(self.gpu_sample_hz, (int, float)):
            raise TypeError(f"`gpu_sample_hz` must be a number (samples per second), got {self.gpu_sample_hz!r}.")
        if not 0 <= self.gpu_sample_hz <= 1000:
            raise ValueError(f"`gpu_sample_hz` must be in [0, 1000] (0 disables sampling), got {self.gpu_sample_hz}.")
        if self.length_fn is not None and not callable(self.length_fn):
            raise TypeError("`length_fn` must be a callable batch -> number of items (e.g. tokens), or None.")
        self.dims = DynamicDims(self.dynamic_dims)  # validates the spec's types
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
        from lightning_fuse.cache import check_writable

        check_writable(Path(self.cache_dir).expanduser(), "cache_dir")

    def _check_conflicts(self) -> None:
        if self.cuda_graph is True and self.mode in ("reduce-overhead", "max-autotune"):
            raise ValueError(
                f"`cuda_graph=True` and `mode={self.mode!r}` both capture CUDA graphs and cannot be combined. Use "
                "cuda_graph=True with mode='default' (one graph over the whole step), or cuda_graph=False."
            )
        if self.cuda_graph is True and isinstance(self.dims.spec, Mapping):
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
        close = difflib.get_close_matches(name, backend_names(), n=3)
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
