r"""The runs under the LOGDIRs of ``lightning-fuse report``: where their TensorBoard event files are, and what each
one logged.

Every directory under the LOGDIRs that holds TensorBoard event files with ``fuse/`` scalars is one run
(:class:`Run`): its ``fuse/`` scalars (logged once per epoch with ``step = epoch``) and texts (the end-of-fit
``fuse/summary``), and its Hydra folder and overrides (``.hydra/`` next to or above the event files). A run is
named by its overrides (``(defaults)`` when there are none; those every run shares are said once, above the table,
see :func:`shared_overrides`), else by the logger's ``name/version`` folders.

Reading event files needs ``tensorboard``: ``pip install "lightning-fuse[report]"``.

Example::

    >>> run = Run("tb", Path("tb"), {"speedup": {1: 1.4, 0: 1.2}, "step_ms": {0: 3.0}})
    >>> run.epochs, run.series("speedup", epochs=[1]), run.config() is None
    ([0, 1], [(1, 1.4)], True)
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

PREFIX = "fuse/"
INSTALL_HINT = 'pip install "lightning-fuse[report]"'
_GENERIC_FOLDER = re.compile(r"^(tb|tensorboard|logs?|version_\d+|\d+)$")


class NoRunsError(LookupError):
    """A LOGDIR holds no event files with ``fuse/`` scalars.

    Example::

        >>> str(NoRunsError("logs"))  # doctest: +ELLIPSIS
        'no fuse/ scalars found under logs: point at the directory a FuseCallback run logged to, e.g. ...'
    """

    def __init__(self, logdir: str | os.PathLike, events: bool = True) -> None:
        where = "" if events else (
            " (no TensorBoard event files at all: FuseCallback logs through the Trainer's loggers, so give the Trainer"
            " a TensorBoardLogger)"
        )  # fmt: skip
        super().__init__(
            f"no fuse/ scalars found under {logdir}{where}: point at the directory a FuseCallback run logged to,"
            " e.g. outputs/<date>/<time>"
        )


@dataclass(frozen=True)
class Run:
    """What one run logged.

    Attributes:
        name: the run's Hydra overrides, or else its logger's ``name/version`` folders; the path is added where two
            runs would share a name.
        path: the directory of the run's event files.
        scalars: metric (tag without ``fuse/``) -> {epoch: value}.
        texts: ``fuse/`` text tags (such as the end-of-fit ``fuse/summary``) -> the last text logged.
        hydra: the run's Hydra folder (``.hydra/``), if it has one.
        overrides: its Hydra overrides (``.hydra/overrides.yaml``), ``None`` without Hydra.

    Example::

        >>> run = Run("tb", Path("tb"), {"speedup": {1: 1.4, 0: 1.2}})
        >>> run.series("speedup"), run.epochs
        ([(0, 1.2), (1, 1.4)], [0, 1])
    """

    name: str
    path: Path
    scalars: dict[str, dict[int, float]]
    texts: dict[str, str] = field(default_factory=dict)
    hydra: Path | None = None
    overrides: tuple[str, ...] | None = None

    @property
    def epochs(self) -> list[int]:
        """Every epoch for which any ``fuse/`` scalar was logged, sorted."""
        return sorted({step for values in self.scalars.values() for step in values})

    def series(self, metric: str, epochs: Sequence[int] | None = None) -> list[tuple[int, float]]:
        """(epoch, value) pairs of ``metric`` (only ``epochs``, if given), sorted by epoch; empty if never logged."""
        pairs = sorted(self.scalars.get(metric, {}).items())
        return pairs if epochs is None else [(epoch, value) for epoch, value in pairs if epoch in epochs]

    def config(self) -> Any:
        """Its Hydra config (``.hydra/config.yaml``); ``None`` without Hydra, or where it cannot be read."""
        return _read_yaml(self.hydra / "config.yaml") if self.hydra else None


def load_runs(paths: Sequence[str | os.PathLike]) -> list[Run]:
    """Find and read every run under the given LOGDIRs, searched recursively.

    Args:
        paths: LOGDIRs; each one may be a run itself or hold many.

    Returns:
        The runs, LOGDIR by LOGDIR in the order given, sorted by path within one.

    Raises:
        FileNotFoundError: If a path does not exist or is not a directory.
        NoRunsError: If a LOGDIR holds no ``fuse/`` scalars.
        ModuleNotFoundError: If ``tensorboard`` is not installed; the message says how to install it.

    Example::

        >>> runs = load_runs(["outputs/2026-01-05/10-31-02"])  # doctest: +SKIP
        >>> [run.name for run in runs]  # doctest: +SKIP
        ['model=resnet18 fuse=auto']
    """
    if importlib.util.find_spec("tensorboard") is None:
        raise ModuleNotFoundError(f"reading TensorBoard event files needs tensorboard: {INSTALL_HINT}")
    runs: list[Run] = []
    for given in paths:
        root = Path(given)
        if not root.is_dir():
            reason = "is not a directory" if root.exists() else "does not exist"
            raise FileNotFoundError(f"{given} {reason}: pass the folder the TensorBoard event files are in.")
        directories = _event_dirs(root)
        found = [run for run in (_read_run(root, d) for d in directories) if run.scalars]
        if not found:
            raise NoRunsError(given, events=bool(directories))
        runs.extend(sorted(found, key=lambda run: _natural_key(run.path)))
    return _name_apart(runs)


def shared_overrides(runs: Sequence[Run]) -> list[str]:
    """The Hydra overrides that every run named by overrides has, when there are two or more such runs.

    The report says them once, above the table, and leaves them out of the runs' names.

    Example::

        >>> runs = [Run("", Path(str(i)), {}, overrides=("model=gpt", f"fuse={f}")) for i, f in enumerate("ab")]
        >>> shared_overrides(runs), [run.name for run in _name_apart(runs)]
        (['model=gpt'], ['fuse=a', 'fuse=b'])
    """
    named = [run.overrides for run in runs if run.overrides is not None]
    return [item for item in named[0] if all(item in other for other in named[1:])] if len(named) > 1 else []


def _name_apart(runs: list[Run]) -> list[Run]:
    """Names without the overrides every run shares; the path added to names that are still alike."""
    shared = set(shared_overrides(runs))
    if shared:
        runs = [
            run if run.overrides is None else
            replace(run, name=" ".join(o for o in run.overrides if o not in shared) or "(shared overrides only)")
            for run in runs
        ]  # fmt: skip
    alike = {name for name, count in Counter(run.name for run in runs).items() if count > 1}
    return [replace(run, name=f"{run.name} [{_shown(run.path)}]") if run.name in alike else run for run in runs]


def _event_dirs(root: Path) -> list[Path]:
    """Directories under ``root`` (itself included) that hold TensorBoard event files."""
    return sorted({file.parent for file in root.rglob("*tfevents*") if file.is_file()})


def _read_run(root: Path, directory: Path) -> Run:
    """Read the ``fuse/`` scalars and texts of the event files in ``directory`` (not its subdirectories)."""
    accumulator = _event_accumulator(directory)
    accumulator.Reload()
    tags = accumulator.Tags()
    scalars: dict[str, dict[int, float]] = {}
    for tag in tags.get("scalars", []):
        if tag.startswith(PREFIX):
            events = sorted(accumulator.Scalars(tag), key=lambda event: event.wall_time)
            scalars[tag[len(PREFIX) :]] = {event.step: event.value for event in events}  # a rerun epoch: last wins
    texts = {}
    for tag in tags.get("tensors", []):
        if tag.startswith(PREFIX):
            events = sorted(accumulator.Tensors(tag), key=lambda event: event.wall_time)
            strings = events[-1].tensor_proto.string_val if events else []
            texts[tag] = b"\n".join(strings).decode("utf-8", "replace")
    hydra = _hydra_dir(directory)
    listed = _read_yaml(hydra / "overrides.yaml") if hydra else None
    overrides = tuple(map(str, listed)) if isinstance(listed, list) else None
    name = _run_name(root, directory, overrides)
    return Run(name, directory, scalars, texts=texts, hydra=hydra, overrides=overrides)


def _event_accumulator(directory: Path) -> Any:
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError as err:
        raise ModuleNotFoundError(f"reading TensorBoard event files needs tensorboard: {INSTALL_HINT}") from err
    return event_accumulator.EventAccumulator(
        str(directory),
        size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0},  # 0 keeps every event
    )


def _hydra_dir(directory: Path, levels: int = 3) -> Path | None:
    """The ``.hydra/`` folder holding ``overrides.yaml`` in ``directory`` or up to ``levels`` folders above it."""
    for folder in [directory, *directory.resolve().parents][: levels + 1]:
        if (folder / ".hydra" / "overrides.yaml").is_file():
            return folder / ".hydra"
    return None


def _run_name(root: Path, directory: Path, overrides: tuple[str, ...] | None) -> str:
    """The run's Hydra overrides, ``(defaults)`` when it has none.

    Without Hydra: the run's path below the LOGDIR (the LOGDIR's own name if it is the run), widened by the folders
    above it while it starts with a logger's generic folder (``tb``, ``version_0``, ``0``), e.g.
    ``lightning_logs/version_0``.
    """
    if overrides is not None:
        return " ".join(overrides) or "(defaults)"
    parts = directory.resolve().parts
    width = max(1, len(directory.relative_to(root).parts))
    while _GENERIC_FOLDER.match(parts[-width]) and width < len(parts) - 1:
        width += 1
    return "/".join(parts[-width:])


def _read_yaml(path: Path) -> Any:
    """The YAML document at ``path``; ``None`` if it is missing or unreadable (a name falls back, never fails)."""
    import yaml  # PyYAML: a dependency of lightning

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when inside it, else absolute."""
    path = path.resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def _natural_key(path: Path) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in path.parts]
