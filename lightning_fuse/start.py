"""A fit's start: its setting and candidate plans (the search's, the user's own compile, or the one plan explicit
settings force), its state with the timer and the reference schedule, the hooks it puts on the model and on torch
(:func:`start_fit`); its compile cache (:func:`start_cache`); the plan line that says what will happen
(:func:`plan_line`).

They take from the Trainer only what they need, as values: the number of processes, whether the strategy shards the
parameters, the precision plugin (its autocast context and loss scaler, which the backward guard's redone step
uses) and the strategy's barrier (every rank reads the compile cache rank zero saved).

Example::

    >>> import lightning.pytorch as pl, torch
    >>> from lightning.pytorch.plugins import Precision
    >>> from lightning_fuse.options import FuseOptions
    >>> class Task(pl.LightningModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.blocks = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    >>> task = Task()
    >>> fit = start_fit(FuseOptions(backend="eager", cache_dir=False), task, world_size=1,
    ...                 precision=Precision())
    >>> plan_line(fit, task).splitlines()[0]
    'FuseCallback: the plan will be chosen by measurement after step 3 among: eager, regions, compile'
    >>> fit.close()  # what the fit put on the model and on torch, taken off
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from lightning_fuse import compat
from lightning_fuse.cache import CompileCache, cache_key
from lightning_fuse.fit import FitState
from lightning_fuse.hooks import FitHooks
from lightning_fuse.measurement import start_measuring
from lightning_fuse.options import AUTO, COMPILED_FROM_THE_START, GRAPHING_MODES, FuseOptions
from lightning_fuse.plan import Plan, Regions, Setting, UserCompiled, UserCompiledGraph, candidates, fit_setting
from lightning_fuse.regions import format_plan

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins import Precision
    from torch import nn


SHAPE_STEPS = 3
"""Eager steps, at least, before the plan search: their network inputs tell whether the shapes vary."""


def start_fit(options: FuseOptions, pl_module: pl.LightningModule, *, world_size: int, precision: Precision,
              ddp: bool = False) -> FitState:  # fmt: skip
    """A fit's state at its start: the candidates built, the timer and schedule ready, inputs being recorded.
    First, the private torch APIs FuseCallback needs are checked (an error names what this torch lacks).

    Args:
        options: FuseCallback's options.
        pl_module: The LightningModule being fit.
        world_size: The number of processes.
        precision: The Trainer's precision plugin.
        ddp: Whether the processes run DDP (its wrapper around the LightningModule): graph plans compete there.
    """
    compat.check_private_apis()
    setting = fit_setting(options, pl_module, world_size, ddp)
    fit = _with_candidates(options, setting, pl_module)
    start_measuring(fit, options, pl_module, str(precision.precision))
    fit.activation_step = max(fit.schedule.start_length, SHAPE_STEPS if fit.searching else 0)
    graphs = any(plan.records_graphs for plan in fit.candidates)
    fit.warmup = options.warmup_steps if options.warmup_steps is not None else 3 if graphs else 1
    fit.optimizer_graph = options.optimizer_graph
    fit.tracker.install()
    rescue = replace(setting.options, mode=COMPILED_FROM_THE_START["mode"]).kwargs()  # the plan it hands over to
    fit.hooks = FitHooks.install(setting.target[1], pl_module, precision, fit.fail_plan, options.pad_buckets,
                                 rescue_compile=rescue if world_size == 1 else None)  # fmt: skip
    fit.hooks.raise_recompile_limit(len(setting.regions), options.recompile_limit,
                                    [region.module for region in setting.regions] + [setting.target[1]])
    setting.policy.as_called = fit.hooks.no_cache.as_called
    return fit


def _with_candidates(options: FuseOptions, setting: Setting, pl_module: pl.LightningModule) -> FitState:
    """A new fit's state with its candidate plans: the user's own compile (with a CUDA graph over it to measure,
    unless explicit settings say otherwise), the plans the search will measure (``cuda_graph=False`` leaves out
    those that capture graphs), or the one plan an explicit ``mode`` or ``targets`` or ``cuda_graph=True`` forces."""
    searching = options.mode == AUTO and options.cuda_graph in (AUTO, False) and options.targets in (AUTO, (AUTO,))
    precompiled = user_compiled(pl_module)
    if precompiled:
        own = user_compiled_candidates(setting, precompiled) if searching else [UserCompiled(precompiled)]
        return FitState(setting=setting, searching=len(own) > 1, tracker=setting.tracker, candidates=own)
    fit = FitState(setting=setting, searching=searching, tracker=setting.tracker)
    if fit.searching:
        fit.candidates = candidates(setting)
    else:
        fit.candidates = [forced_plan(setting, options.mode, options.cuda_graph)]
    return fit


def user_compiled(root: nn.Module) -> list[nn.Module]:
    """The submodules of ``root`` the user compiled before the fit (``Module.compile`` or ``torch.compile``)."""
    return [m for m in root.modules() if compat.compiled_call_impl(m) is not None or compat.is_compile_wrapper(m)]


def user_compiled_candidates(setting: Setting, modules: list[nn.Module]) -> list[Plan]:
    """The plans for a network the user compiled before the fit: their compile as it is, then, where graphs run
    (:attr:`Setting.cuda_graphs`), one CUDA graph over it, where every module they compiled lies within the graph's
    target (a compiled ancestor would trace through the graph's dispatch).

    Example::

        >>> import torch
        >>> from lightning_fuse.compiler import CompileOptions
        >>> net = torch.nn.Linear(2, 2)
        >>> net.compile(backend="eager")
        >>> on = lambda device: Setting([], ("net", net), CompileOptions(), torch.device(device))
        >>> [p.name for p in user_compiled_candidates(on("cuda"), [net])]
        ['user-compiled', 'user-compiled+graph']
        >>> [p.name for p in user_compiled_candidates(on("cpu"), [net])]
        ['user-compiled']
    """
    user = UserCompiled(modules)
    within = {id(module) for module in setting.target[1].modules()}
    if not setting.cuda_graphs or any(id(m) not in within for m in modules):
        return [user]
    return [user, UserCompiledGraph(setting, user)]


def forced_plan(setting: Setting, mode: str, cuda_graph: bool | str) -> Plan:
    """The one plan explicit settings ask for: the regions in ``mode``, with a graph unless it cannot or is off.

    Raises:
        ValueError: If ``cuda_graph=True`` is asked for with several processes other than DDP's (FSDP, say).
    """
    if cuda_graph is True and not setting.processes_allow_graphs:
        raise ValueError(
            f"cuda_graph=True runs in one process or under DDP, but this run has {setting.world_size} processes of "
            "another strategy (FSDP gathers parameters inside the forward, which no graph holds). Use "
            "cuda_graph='auto' (off there) or False."
        )
    compile_mode = None if mode in (AUTO, "default") else mode
    setting = replace(setting, options=replace(setting.options, mode=compile_mode))
    graph = setting.cuda_graphs and cuda_graph is not False and compile_mode not in GRAPHING_MODES
    plan = Regions(setting, graph=graph) if setting.regions or graph else Plan()
    plan.reason = f"mode={mode!r}, cuda_graph={cuda_graph!r}" if plan.modules() else "nothing selected: measure only"
    return plan


def start_cache(options: FuseOptions, fit: FitState, barrier: Callable[[], None], precision: str
                ) -> CompileCache | None:  # fmt: skip
    """Point torch's compile caches into ``cache_dir`` and load last run's artifacts (``None``: no cache).

    The directory is one per ``precision`` (the Trainer's, e.g. ``"bf16-mixed"``) as well: a plan's speed depends on
    it, and torch 2.11's AOTAutograd cache keys whether autocast is on but not its dtype, so a graph traced under bf16
    autocast is found again under fp16 (pytorch/pytorch#181564): on an H200, DeiT's `16-mixed` fit after a
    `bf16-mixed` one got bf16 outputs from its compiled network, which the first call's check sent back to eager."""
    if options.cache_dir is False:
        return None
    backend = getattr(options.backend, "__qualname__", options.backend)  # a callable: by name
    what = (options.mode, options.cuda_graph, options.dynamic, backend, options.fullgraph,
            sorted((options.options or {}).items()), precision)  # fmt: skip
    modules = [region.module for region in fit.setting.regions] + [fit.setting.target[1]]
    cache = CompileCache(options.cache_dir, [cache_key(modules, fit.setting.device, [repr(what)])])
    cache.activate()
    barrier()  # rank zero saved last; everyone reads the same file
    cache.load()
    return cache


def plan_line(fit: FitState, pl_module: pl.LightningModule) -> str:
    """The plan line at fit start: what will be chosen from, or what is forced, and the regions (none for a network
    the user compiled: FuseCallback compiles nothing of it)."""
    user = fit.candidates[0]
    if isinstance(user, UserCompiled) and not fit.searching:
        return f"FuseCallback: no compile of its own: {user.reason}"
    if isinstance(user, UserCompiled):
        others = ", ".join(plan.name for plan in fit.candidates[1:])
        return (f"FuseCallback: no compile of its own ({len(user.modules())} module(s) already compiled before the "
                f"fit); after step {fit.activation_step} the user's compile is measured against: {others}")
    if fit.searching:
        names = ", ".join(plan.name for plan in fit.candidates)
        intent = f"the plan will be chosen by measurement after step {fit.activation_step} among: {names}"
    else:
        intent = f"plan forced by explicit settings: {fit.candidates[0].describe()}"
    return f"FuseCallback: {intent}\n{format_plan(fit.setting.regions, pl_module)}"
