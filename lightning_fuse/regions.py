"""Which submodules to compile: resolve ``targets``/``exclude`` into a list of regions.

A *region* is a submodule of the LightningModule that gets compiled in place. Names are dotted paths relative to
the LightningModule (``"model.blocks.3"``), the same names ``named_modules()`` and ``state_dict`` use.

Example::

    >>> import torch.nn as nn
    >>> net = nn.Module()
    >>> net.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    >>> net.head = nn.Linear(4, 2)
    >>> [r.name for r in resolve_regions(net, "auto")]
    ['blocks.0', 'blocks.1', 'blocks.2']
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_fuse.compat import fsdp_wrapped_module
from lightning_fuse.options import AUTO, FULL, Target, normalize_targets

MIN_BLOCK_SHARE = 0.1
"""``"auto"`` takes the repeated blocks only where they hold at least this share of the network's parameters.
Below it they are incidental, not the network's body: HF's Time Series Transformer with one layer a side repeats
only its three 17-parameter output projections (1% of it), and "auto" compiles the whole network instead."""


@dataclass(frozen=True)
class Region:
    """One submodule chosen for compilation.

    Example::

        >>> from torch import nn
        >>> Region("model.head", nn.Linear(2, 3)).num_params
        9
    """

    name: str
    module: nn.Module

    @property
    def class_name(self) -> str:
        return type(self.module).__name__

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


def resolve_regions(
    root: nn.Module, targets: Target | Sequence[Target], exclude: Target | Sequence[Target] = ()
) -> list[Region]:
    """Resolve ``targets`` minus ``exclude`` on ``root`` into non-overlapping regions, outermost first.

    ``"auto"`` selects repeated blocks (children of an ``nn.ModuleList``/``nn.Sequential`` that share one class) when
    they are all alike (same parameter shapes) and hold :data:`MIN_BLOCK_SHARE` of the parameters or more, and falls
    back to ``"full"`` otherwise; ``"full"`` selects every
    top-level child that holds parameters. Overlapping matches keep the outermost module. An excluded module inside
    a selected one splits the selected module into its remaining children.

    Raises:
        ValueError: If a pattern or class matches no module; the message lists close module names.
    """
    targets = normalize_targets(targets, "targets")
    exclude = normalize_targets(exclude, "exclude")
    modules = {name: module for name, module in root.named_modules() if name and not is_metric(module)}
    selected: set[str] = set()
    for target in targets:
        selected |= _match(target, modules, root, "targets")
    excluded: set[str] = set()
    for pattern in exclude:
        excluded |= _match(pattern, modules, root, "exclude")
    names = _outermost(selected - excluded)
    regions: list[Region] = []
    for name in names:
        regions.extend(_split_around_excluded(name, modules[name], excluded))
    return [Region(r.name, fsdp_wrapped_module(r.module)) for r in regions]  # FSDP's collectives stay outside


def find_repeated_blocks(root: nn.Module) -> list[str]:
    """Names of the children of every ``ModuleList``/``Sequential`` whose (two or more) children share one class.

    The search does not descend into a block once found, so nested repeats inside a block stay part of it. Blocks
    that cannot be called (a ``ModuleList`` of ModuleLists, as HF's Funnel groups its layers) are searched
    instead: compiled, their forward would never run.
    """
    found: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if _is_repeated_container(child) and not isinstance(child[0], (nn.ModuleList, nn.ModuleDict)):
                found.extend(f"{name}.{block_name}" for block_name, _ in child.named_children())
            else:
                visit(name, child)

    visit("", root)
    return found


def format_plan(regions: Sequence[Region], root: nn.Module) -> str:
    """A readable table of the regions with their classes and parameter counts: what the plans that compile
    regions would compile (at fit start no plan is chosen, so nothing is said to be compiled yet)."""
    total = sum(p.numel() for p in root.parameters())
    covered = sum(r.num_params for r in regions)
    share = f"{100 * covered / total:.0f}%" if total else "-"
    width = max([len("region")] + [len(r.name) for r in regions])
    class_width = max([len("class")] + [len(r.class_name) for r in regions])
    lines = [
        f"{len(regions)} region(s) for the plans that compile regions, {_human(covered)} of {_human(total)} "
        f"parameters ({share})",
        f"  {'region':<{width}}  {'class':<{class_width}}  params",
    ]
    lines += [f"  {r.name:<{width}}  {r.class_name:<{class_width}}  {_human(r.num_params)}" for r in regions]
    return "\n".join(lines)


def _match(target: Target, modules: dict[str, nn.Module], root: nn.Module, argument: str) -> set[str]:
    if target == AUTO:
        blocks = find_repeated_blocks(root)
        return set(blocks) if blocks and _alike(root, blocks) and _hold_enough(root, blocks) else _top_level(modules)
    if target == FULL:
        return _top_level(modules)
    if isinstance(target, type):
        matched = {name for name, module in modules.items() if isinstance(module, target)}
    else:
        matched = {
            name
            for name, module in modules.items()
            if fnmatch.fnmatchcase(name, target) or type(module).__name__ == target
        }
    if not matched:
        raise ValueError(_no_match_message(target, modules, argument))
    return matched


def _no_match_message(target: Target, modules: dict[str, nn.Module], argument: str) -> str:
    label = target.__name__ if isinstance(target, type) else target
    candidates = sorted(set(modules) | {type(m).__name__ for m in modules.values()})
    close = difflib.get_close_matches(label, candidates, n=5, cutoff=0.4)
    hint = f" Close names: {', '.join(close)}." if close else ""
    some = ", ".join(list(modules)[:8])
    return (
        f"`{argument}` entry {label!r} matches no submodule of the LightningModule.{hint} "
        f"Names are dotted paths from the LightningModule (e.g. {some}); globs like 'model.blocks.*' and class "
        f"names work too."
    )


def _alike(root: nn.Module, names: Sequence[str]) -> bool:
    """Whether the blocks are interchangeable: one class and the same parameter shapes.

    Identical blocks compile once and share the code (cheap regional compile). Blocks of one class at different
    widths, like a CNN's stages, compile once per shape, slower than compiling the whole network (our H100
    measurements: ResNet-18's 8 BasicBlocks 47.6 s cold, the whole network 30.1 s), and miss fusion at the
    boundaries: "auto" then compiles the whole network instead.
    """
    shapes = {
        (type(m).__name__, tuple(tuple(p.shape) for p in m.parameters())) for m in map(root.get_submodule, names)
    }
    return len(shapes) == 1


def _hold_enough(root: nn.Module, names: Sequence[str]) -> bool:
    """Whether the blocks hold at least :data:`MIN_BLOCK_SHARE` of ``root``'s parameters (the network's body)."""
    total = sum(p.numel() for p in root.parameters())
    held = sum(Region(name, root.get_submodule(name)).num_params for name in names)
    return held >= MIN_BLOCK_SHARE * total


def _top_level(modules: dict[str, nn.Module]) -> set[str]:
    return {name for name, module in modules.items() if "." not in name and has_params(module)}


def _outermost(names: set[str]) -> list[str]:
    kept: list[str] = []
    for name in sorted(names, key=lambda n: (n.count("."), n)):
        if not any(_is_inside(name, outer) for outer in kept):
            kept.append(name)
    return sorted(kept, key=_natural_key)


def _split_around_excluded(name: str, module: nn.Module, excluded: set[str]) -> Iterator[Region]:
    if not any(_is_inside(e, name) for e in excluded):
        yield Region(name, module)
        return
    for child_name, child in module.named_children():
        full = f"{name}.{child_name}"
        if full not in excluded and not is_metric(child) and has_params(child):
            yield from _split_around_excluded(full, child, excluded)


def _is_inside(name: str, outer: str) -> bool:
    return name.startswith(outer + ".")


def _is_repeated_container(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
        return False
    first = type(module[0])
    return all(type(child) is first for child in module) and has_params(module)


def has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def is_metric(module: nn.Module) -> bool:
    # torchmetrics metrics are nn.Modules with state, never something to compile
    return any(cls.__module__.startswith("torchmetrics") for cls in type(module).__mro__)


def _natural_key(name: str) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def _human(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)
