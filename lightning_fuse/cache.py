"""A persistent compile cache: one directory per (torch, triton, device, compiled code) key.

Inductor's and Triton's on-disk caches are pointed into the directory before any compile, and torch's portable
"mega-cache" (:func:`torch.compiler.save_cache_artifacts`) is saved there at fit end and loaded at fit start, so a
second run of the same model starts warm. Corrupt or foreign artifacts are ignored with a warning; writes are
atomic under a file lock, so several processes (DDP ranks) can share one directory.

Example::

    >>> import tempfile
    >>> cache = CompileCache(tempfile.mkdtemp(), key_parts=["my-model"])
    >>> with cache.activated():
    ...     loaded = cache.load()
    >>> loaded
    False
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_fuse.compat import dynamo_counters
from lightning_fuse.options import check_writable

log = logging.getLogger(__name__)

ARTIFACTS = "mega_cache.bin"
ENV_DIRS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/lightning_fuse`` (``~/.cache/lightning_fuse`` by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_fuse"


def cache_key(modules: Iterable[nn.Module], device: torch.device, extra: Iterable[str] = ()) -> str:
    """A short hash of the versions, device name and source code of the compiled modules' classes."""
    parts = [torch.__version__, _triton_version(), _device_name(device), *extra]
    for cls in sorted({type(m) for m in modules}, key=lambda c: c.__qualname__):
        parts.append(cls.__module__ + "." + cls.__qualname__)
        parts.append(_source(cls))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


class CompileCache:
    """A compile cache directory.

    Args:
        root: The parent directory (``None``: :func:`default_cache_root`).
        key_parts: Strings that identify what is compiled; the directory is ``root/<hash of key_parts>``. Use
            :func:`cache_key` for the usual key.

    Raises:
        ValueError: If ``root`` exists and is not a directory, or cannot be written to.

    Example::

        >>> import tempfile
        >>> CompileCache(tempfile.mkdtemp(), ["abc"]).directory.name
        'abc'
    """

    def __init__(self, root: str | os.PathLike | None, key_parts: Iterable[str]) -> None:
        key = "-".join(key_parts)
        self.directory = Path(root or default_cache_root()).expanduser() / key
        check_writable(self.directory.parent, "cache_dir")
        self.loaded = False
        self._saved_env: dict[str, str | None] = {}

    @property
    def artifacts_path(self) -> Path:
        return self.directory / ARTIFACTS

    @contextmanager
    def activated(self) -> Iterator[CompileCache]:
        """Point inductor's and Triton's caches into the directory for the duration of the block."""
        self.activate()
        try:
            yield self
        finally:
            self.deactivate()

    def activate(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for var, sub in ENV_DIRS.items():
            self._saved_env[var] = os.environ.get(var)
            os.environ[var] = str(self.directory / sub)

    def deactivate(self) -> None:
        for var, value in self._saved_env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        self._saved_env.clear()

    def load(self) -> bool:
        """Load the saved artifacts into torch's caches; ``False`` (with a warning if corrupt) when unusable."""
        path = self.artifacts_path
        if not path.is_file():
            return False
        try:
            with _locked(self.directory):
                data = path.read_bytes()
            info = torch.compiler.load_cache_artifacts(data)  # logs and returns None on a bad checksum
            problem = None if info is not None else "torch rejected them (corrupt, or from another torch/GPU)"
        except Exception as err:  # noqa: BLE001 - a bad artifact must never cost the run
            problem = f"{type(err).__name__}: {str(err)[:200]}"
        if problem:
            rank_zero_warn(
                f"FuseCallback: ignoring the compile cache artifacts at {path} ({problem}); compiling cold. Delete "
                "the file to silence this; it is rewritten at the end of this run."
            )
            return False
        self.loaded = True
        return True

    def save(self) -> bool:
        """Save this process's compiled artifacts atomically; ``False`` when torch had nothing to save."""
        try:
            result = torch.compiler.save_cache_artifacts()
        except Exception as err:  # noqa: BLE001 - saving the cache is best effort
            rank_zero_warn(f"FuseCallback: could not save compile cache artifacts: {type(err).__name__}: {err}")
            return False
        if result is None:
            return False
        data, _ = result
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.artifacts_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        with _locked(self.directory):
            os.replace(tmp, self.artifacts_path)
        return True

    def warn_if_bypassed(self, since: tuple[int, ...]) -> None:
        """Say that the next run will compile part of the network again, where AOTAutograd's cache bypassed graphs
        after ``since`` (a :class:`CacheCounts`: the fit's start). It stores none of a graph that calls a
        ``torch.autograd.Function`` (HF BLOOM's GELU in training, on torch 2.11-2.14), so the next run traces and
        partitions that graph again before inductor's cache hands back its kernels: one reason a BLOOM's warm start
        took 0.39 of its cold one on an H200, where Llama-style models took 0.15-0.25 (``benchmarks/RESULTS.md``,
        seventy-second session).

        Example::

            >>> import tempfile
            >>> CompileCache(tempfile.mkdtemp(), ["k"]).warn_if_bypassed(cache_counters())  # none since: silent
        """
        bypasses = cache_counters().since(since).bypasses
        if bypasses:
            rank_zero_warn(
                f"FuseCallback: torch's AOTAutograd cache would not store {bypasses} of this fit's compiled "
                "graph(s), so the next run traces and partitions them again and takes only inductor's code from the "
                "compile cache: a slower warm start. A torch.autograd.Function inside the compiled code is the "
                "usual cause; run with TORCH_LOGS=aot and look for 'Bypassing autograd cache' to see the reason."
            )


class CacheCounts(NamedTuple):
    """Lookups in torch's compile caches so far in this process: ``hits`` and ``misses`` of inductor's FX-graph cache
    and AOTAutograd's, and AOTAutograd's ``bypasses``, the graphs it would not store at all.

    Example::

        >>> CacheCounts(hits=3, misses=1, bypasses=0).since(CacheCounts(1, 1, 0))
        CacheCounts(hits=2, misses=0, bypasses=0)
    """

    hits: int
    misses: int
    bypasses: int

    def since(self, start: tuple[int, ...]) -> CacheCounts:
        """The lookups made after ``start``, an earlier count."""
        return CacheCounts(*(now - then for now, then in zip(self, start)))


def cache_counters() -> CacheCounts:
    """This process's lookups in torch's compile caches so far (:class:`CacheCounts`)."""
    counters = dynamo_counters()
    aot = counters["aot_autograd"]
    return CacheCounts(hits=counters["inductor"]["fxgraph_cache_hit"] + aot["autograd_cache_hit"],
                       misses=counters["inductor"]["fxgraph_cache_miss"] + aot["autograd_cache_miss"],
                       bypasses=aot["autograd_cache_bypass"])  # fmt: skip


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "no-triton"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type
