"""The plans: ways to run the network, each a small object that installs itself on the model and uninstalls itself.

A plan is one of: ``eager``; ``regions`` (the selected submodules compiled in place); ``regions+graph`` (those
regions plus one CUDA graph over the network's forward and backward); ``graph`` (that graph over the eager
network); ``reduce-overhead`` (the whole network compiled with torch's CUDA graphs); ``regions+graphs`` (the regions
with a CUDA graph of FuseCallback's own each), ``regions+trees`` (the regions with torch's CUDA graphs each) and
``compile+graph`` (one graph over the whole network compiled), all tried where the graph over the regions failed;
``compile`` (the whole network compiled, no graph). :func:`candidates` lists, most promising first, those that make
sense for the device and the number of processes; :func:`fit_setting` is what they are all built from. The one plan
explicit settings force, and the two of a network the user compiled before the fit (``user-compiled``, their
compile as it is, and ``user-compiled+graph``, one CUDA graph over it), are chosen in :mod:`~lightning_fuse.start`.
Which candidate runs is measured (:mod:`lightning_fuse.search`).

Example::

    >>> import torch
    >>> from lightning_fuse.regions import Region
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> setting = Setting([Region("0", net[0])], ("net", net), CompileOptions(backend="eager"), torch.device("cpu"))
    >>> [plan.name for plan in candidates(setting)]
    ['eager', 'regions', 'compile']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_fuse import compat
from lightning_fuse.compiler import (
    CompiledRegion,
    CompileOptions,
    RegionPolicy,
    RepeatedSizes,
    plain_eager,
    uncompile_regions,
)
from lightning_fuse.graphs import GraphedModule, describe_graphs, graph_target
from lightning_fuse.held_outputs import OutputWatch
from lightning_fuse.host_syncs import syncs_between_regions, syncs_when_compiled
from lightning_fuse.options import GRAPHING_MODES, FuseOptions
from lightning_fuse.regions import Region, resolve_regions
from lightning_fuse.shapes import CompileTracker

if TYPE_CHECKING:
    import lightning.pytorch as pl

WITHOUT_GRAPHS = {"reduce-overhead": ("compile", "regions"), "regions+trees": ("regions",)}
"""The plan under torch's cudagraph trees -> the candidates that compile the same without CUDA graphs, the first
among the fit's candidates taken (where the regions are the whole network, ``regions`` is its compile and no
``compile`` candidate is made: :func:`candidates`). Where the trees free outputs the fit still holds, or fail, the
fit hands over to it (:meth:`~lightning_fuse.fit.FitState.hand_over`, compiled then); where they met more sizes than
they record, the plan stops them instead (:meth:`Plan.stop_trees`, nothing compiled again)."""


@dataclass
class Setting:
    """What every plan is built from: the regions, the network (the graph target), the compile arguments.

    Example::

        >>> net = torch.nn.Linear(2, 2)
        >>> Setting([], ("net", net), CompileOptions(), torch.device("cpu")).max_graphs
        1
    """

    regions: list[Region]
    target: tuple[str, nn.Module]
    options: CompileOptions
    device: torch.device
    tracker: CompileTracker = field(default_factory=CompileTracker)
    policy: RegionPolicy = field(default_factory=RegionPolicy)
    world_size: int = 1
    ddp: bool = False
    """With several processes, whether they run DDP: each holds the whole network, and DDP's reducer all-reduces the
    gradients autograd accumulates, so a CUDA graph over the network's forward and backward can run there (the
    all-reduce after its backward, outside it). FSDP gathers and frees parameters inside the forward: no graph."""
    max_graphs: int = 1
    """CUDA graphs a graph plan may capture, one per batch signature (one per bucket with ``pad_buckets``)."""
    graphs_off: bool = False
    """The user's ``cuda_graph=False``: no plan captures CUDA graphs, neither FuseCallback's nor torch's."""

    @property
    def processes_allow_graphs(self) -> bool:
        """Whether the processes leave room for a CUDA graph over the network: one process, or DDP's (:attr:`ddp`)."""
        return self.world_size == 1 or self.ddp

    @property
    def cuda_graphs(self) -> bool:
        """Whether a plan may capture CUDA graphs: on a CUDA device, where the processes allow them, unless the user
        turned them off (:attr:`graphs_off`)."""
        return self.device.type == "cuda" and self.processes_allow_graphs and not self.graphs_off


def fit_setting(options: FuseOptions, pl_module: pl.LightningModule, world_size: int, ddp: bool = False) -> Setting:
    """What the fit's plans are built from: its regions, its network, the compile arguments, the device, the
    processes (``ddp``: several, under DDP)."""
    regions = resolve_regions(pl_module, options.targets, options.exclude)
    policy = RegionPolicy(verify=options.verify, recompile_limit=options.recompile_limit,
                          on_recompile_limit=options.on_recompile_limit)  # fmt: skip
    compile_options = CompileOptions(backend=options.backend, fullgraph=options.fullgraph, dynamic=options.dynamic,
                                     options=dict(options.options) if options.options else None)  # fmt: skip
    return Setting(regions, graph_target(pl_module), compile_options, pl_module.device, policy=policy,
                   world_size=world_size, ddp=ddp, max_graphs=len(options.pad_buckets or [1]),
                   graphs_off=options.cuda_graph is False)  # fmt: skip


class Plan:
    """A way to run the network. Subclasses install themselves on the model and uninstall themselves.

    Example::

        >>> plan = Plan(); plan.install(); plan.name, plan.failure, plan.modules()
        ('eager', None, [])
    """

    name = "eager"
    reason = ""
    """Why this plan runs, for the plan line (e.g. "chosen by measurement", "mode='default'")."""
    dominated_by: tuple[str, ...] = ()
    """Plans that do all this one does and more: once one of them ran faster than eager, this one is not tried."""
    same_kernels_as: tuple[str, ...] = ()
    """Plans that run this one's kernels under graphs too: once one was timed, at any speed, this one is not tried."""
    owned = True
    """False for code FuseCallback did not install (the user's own compile): never dropped nor guarded."""
    tried_after: str | None = None
    """A fallback: this plan is tried only where the plan of this name failed."""
    records_graphs = False
    """Whether it runs CUDA graphs, which are shape-specific (one recorded per input shape; the first steps record
    them, so they are kept out of the timing)."""
    cudagraph_trees = False
    """Whether it runs torch's own CUDA graphs (inductor's cudagraph trees): on CUDA, in a :data:`GRAPHING_MODES`
    mode."""
    graph: GraphedModule | None = None
    """Its one CUDA graph over the network's forward and backward, if it has one."""
    region_graphs: Sequence[GraphedModule] = ()
    """Its CUDA graphs, one per region, where it has no graph over the network (``regions+graphs``)."""
    trees_failure: str | None = None
    """Why a region's call failed in torch's cudagraph trees, once the plan watches for it
    (:meth:`watch_trees_failures`)."""

    def install(self) -> None:
        """Put the plan on the model."""

    def uninstall(self) -> None:
        """Take it off (the work it compiled or captured is kept, for a later :meth:`install`)."""

    def step_begin(self) -> None:
        """Called before the first forward of every training iteration that runs this plan (under gradient
        accumulation, before its first micro-batch only)."""

    def set_evaluating(self, evaluating: bool) -> None:
        """Whether the calls from now are evaluation's (a validation batch's, before each) rather than training's."""

    def unfit(self, forward_backward: Callable[[], None]) -> str | None:
        """Why this plan cannot work here, found cheaply before it is compiled (``None``: try it).
        ``forward_backward()`` is one forward and backward of the network on the search's inputs, unsynchronised."""

    def watch_trees_failures(self) -> None:
        """From now on a region whose call fails in torch's cudagraph trees runs eagerly without a warning of its own,
        and :attr:`trees_failure` says why: the fit hands the plan over to the same compile without the trees at the
        next step (:meth:`~lightning_fuse.fit.FitState.fail_plan`), as for a failure in backward."""

    def release(self) -> None:
        """Free what the plan holds but will not run again (a losing candidate's CUDA graphs and their memory)."""

    def stop_trees(self) -> None:
        """From now on its calls run inductor's code without torch's cudagraph trees: none records or replays a
        graph (a plan that runs no trees runs as before)."""

    def modules(self) -> list[nn.Module]:
        """The modules carrying something of this plan (bypassed by the eager reference steps)."""
        return []

    def graphs(self) -> list[GraphedModule]:
        """Its CUDA graphs of FuseCallback's own: :attr:`graph`, or :attr:`region_graphs`."""
        return [self.graph] if self.graph is not None else list(self.region_graphs)

    def graphs_line(self) -> str | None:
        """What became of its CUDA graphs of FuseCallback's own, for the fit's summary (``None``: it has none)."""
        return describe_graphs(graphs) if (graphs := self.graphs()) else None

    def bypassed(self) -> AbstractContextManager[None]:
        """Inside it, :meth:`modules` run their plain eager call, as the user's own code (an eager reference step)."""
        return plain_eager(self.modules())

    @property
    def failure(self) -> str | None:
        """Why the plan is not what it claims (its graph was not captured, every region fell back), else None."""
        return None

    @property
    def shortfall(self) -> list[str]:
        """What of the plan did not happen, for the verdict (:attr:`failure` says why); empty where it runs as
        named."""
        return []

    @property
    def sizes_full(self) -> bool:
        """Whether torch's cudagraph trees under this plan met a size past the most they record in one fit."""
        return False

    @property
    def outputs_held(self) -> bool:
        """Whether an output of torch's cudagraph trees under this plan, from its last training iteration, is still
        held (:mod:`~lightning_fuse.held_outputs`): the next :meth:`step_begin` would free it."""
        return False

    @property
    def compiled_regions(self) -> list[str]:
        return []

    @property
    def runners(self) -> list[CompiledRegion]:
        return []

    def describe(self) -> str:
        return f"{self.name} ({self.reason})" if self.reason else self.name


class Regions(Plan):
    """The regions compiled in place, and optionally one CUDA graph over the network's forward and backward.

    Args:
        setting: The regions, the network, the compile arguments.
        graph: Also capture one CUDA graph over the network (CUDA only).

    Example::

        >>> from lightning_fuse.regions import Region
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> plan = Regions(Setting([Region("0", net[0])], ("net", net), CompileOptions(backend="eager"),
        ...                        torch.device("cpu")), graph=False)
        >>> plan.install(); plan.compiled_regions
        ['0']
        >>> plan.uninstall(); plan.compiled_regions
        []
    """

    per_region_graphs = False
    """Whether each region gets a CUDA graph of its own (:class:`RegionGraphs`)."""

    def __init__(self, setting: Setting, graph: bool) -> None:
        self.setting = setting
        self.name = "regions+graph" if graph else "regions"
        self.dominated_by = () if graph else ("regions+graph", "compile+graph", "reduce-overhead", "regions+graphs")
        self.records_graphs = graph or setting.options.mode in GRAPHING_MODES
        self.cudagraph_trees = setting.options.mode in GRAPHING_MODES and setting.device.type == "cuda"
        self._tree_sizes = RepeatedSizes()  # the trees' sizes, capped while installed under the trees
        self._restore_tree_sizes: Callable[[], None] | None = None
        options = setting.options
        if (graph or self.per_region_graphs) and options.dynamic is None:  # a graph's shapes: no dim made dynamic
            options = replace(options, dynamic=False)
        self._runners = [CompiledRegion(region, options, setting.tracker, setting.policy) for region in setting.regions]
        self.watch = OutputWatch() if self.cudagraph_trees else None
        """What the trees' training calls returned since the iteration began: the next one's start frees it."""
        for runner in self._runners:
            runner.on_return = self.watch
        self._graphed = partial(GraphedModule, compiles=lambda: setting.tracker.total_compiles,
                                max_graphs=setting.max_graphs)  # fmt: skip
        self.graph = self._graphed(*setting.target) if graph else None

    def unfit(self, forward_backward: Callable[[], None]) -> str | None:
        if self.graph is None:
            return None
        regions = [runner.region.module for runner in self._runners]
        sync = syncs_between_regions(regions, forward_backward, on_cuda=self.setting.device.type == "cuda")
        return f"it syncs with the host outside its regions, which no capture survives ({sync})" if sync else None

    def install(self) -> None:
        for runner in self._runners:
            runner.install()
        if self.watch is not None:
            self.watch.clear()  # the search's trial calls are not the fit's
        if self.cudagraph_trees and self._restore_tree_sizes is None:
            self._restore_tree_sizes = compat.cap_cudagraph_sizes(self._tree_sizes)
        for graph in self.graphs():
            graph.install()
            graph.capture_allowed = True

    def uninstall(self) -> None:
        for graph in self.graphs():
            graph.uninstall()
        if self._restore_tree_sizes is not None:
            self._restore_tree_sizes()
            self._restore_tree_sizes = None
        uncompile_regions(self._runners)

    def step_begin(self) -> None:
        if self.setting.options.mode in GRAPHING_MODES:
            # cudagraph trees: a new training iteration begins, so last step's graph outputs may be overwritten.
            # Not between micro-batches: their gradients, outputs of the trees' backward, are still being summed
            # (marking each one fails with "accessing tensor output of CUDAGraphs that has been overwritten")
            torch.compiler.cudagraph_mark_step_begin()
        if self.watch is not None:
            self.watch.clear()
        self._tree_sizes.next_step()

    def set_evaluating(self, evaluating: bool) -> None:
        self._tree_sizes.set_evaluating(evaluating)  # evaluation's sizes are capped apart, each batch a step

    def watch_trees_failures(self) -> None:
        def note(reason: str) -> None:
            self.trees_failure = self.trees_failure or reason

        for runner in self._runners:
            runner.on_trees_failure = note

    def release(self) -> None:
        for graph in self.graphs():
            graph.release()

    def stop_trees(self) -> None:
        self._tree_sizes.stop()
        for runner in self._runners:
            runner.on_return = None  # its compiled code's outputs are the caller's: nothing left to watch

    def modules(self) -> list[nn.Module]:
        modules = [runner.region.module for runner in self._runners]
        return modules + [self.graph.module] if self.graph is not None else modules

    @property
    def runners(self) -> list[CompiledRegion]:
        return self._runners

    @property
    def sizes_full(self) -> bool:
        return self.cudagraph_trees and self._tree_sizes.full and not self._tree_sizes.stopped

    @property
    def outputs_held(self) -> bool:
        return self.watch is not None and not self._tree_sizes.stopped and self.watch.held()

    @property
    def compiled_regions(self) -> list[str]:
        return [runner.name for runner in self._runners if runner.is_compiled]

    @property
    def failure(self) -> str | None:
        if self._graph_refused():
            return f"no graph: {self.graphs()[0].disabled_reason}"
        if self._regions_fell_back():
            return f"every region fell back: {self._runners[0].fallback_reason}"
        return None

    @property
    def shortfall(self) -> list[str]:
        replayed = any(graph.replays for graph in self.graphs())
        refused = "its graph dropped after its replays" if replayed else "its graph not captured"
        missing = {refused: self._graph_refused(),
                   "its regions fell back to eager": self._regions_fell_back()}  # fmt: skip
        return [what for what, happened in missing.items() if happened]

    def _graph_refused(self) -> bool:
        graphs = self.graphs()
        return bool(graphs) and all(graph.disabled_reason is not None for graph in graphs)

    def _regions_fell_back(self) -> bool:
        return bool(self._runners) and all(runner.fallback_reason is not None for runner in self._runners)


class Graph(Regions):
    """One CUDA graph over the eager network's forward and backward: no compile, captured in about a second.

    Example::

        >>> net = torch.nn.Linear(2, 2)
        >>> Graph(Setting([], ("net", net), CompileOptions(), torch.device("cuda"))).name
        'graph'
    """

    def __init__(self, setting: Setting) -> None:
        super().__init__(replace(setting, regions=[]), graph=True)
        self.name, self.dominated_by = "graph", ("regions+graph", "compile+graph")


class Whole(Regions):
    """The whole network compiled as one region: ``mode="reduce-overhead"`` (torch's CUDA graphs) or default, and
    optionally one CUDA graph over it (``compile+graph``: the fallback where the graph over the compiled regions
    failed on a host sync in the eager code between them, which the whole network's compile traces away).

    ``reduce-overhead`` is not tried once ``compile+graph`` was timed, at any speed: it runs the same kernels, under
    torch's graphs rather than one of FuseCallback's own. On an H200, ViT at 128 timed them at 55.03 and 55.32 ms a
    call, both slower than eager's 49.85, and the second trial took 31.5 s of the fit's 84.8 s cold setup, against
    the one line's 40.8 s (at 9f1973c).

    Example::

        >>> net = torch.nn.Linear(2, 2)
        >>> setting = Setting([], ("net", net), CompileOptions(backend="eager"), torch.device("cpu"))
        >>> Whole(setting, "reduce-overhead").name, Whole(setting, None).name, Whole(setting, None, graph=True).name
        ('reduce-overhead', 'compile', 'compile+graph')
    """

    def __init__(self, setting: Setting, mode: str | None, graph: bool = False) -> None:
        name, module = setting.target
        options = replace(setting.options, mode=mode)
        super().__init__(replace(setting, regions=[Region(name, module)], options=options), graph=graph)
        if graph:
            self.name, self.tried_after, self.dominated_by = "compile+graph", "regions+graph", ()
        elif mode in GRAPHING_MODES:
            self.name, self.same_kernels_as = mode, ("compile+graph",)
        else:
            self.name, self.dominated_by = "compile", ("reduce-overhead", "regions", "compile+graph", "regions+graphs")

    def unfit(self, forward_backward: Callable[[], None]) -> str | None:
        on_cuda = self.setting.device.type == "cuda"
        sync = self.graph is not None and syncs_when_compiled(self.setting.target[1], forward_backward, on_cuda)
        return f"it syncs with the host even compiled, which no capture survives ({sync})" if sync else None


class RegionTrees(Regions):
    """The regions under ``mode="reduce-overhead"``: torch's CUDA graphs per region, forward and backward
    (cudagraph trees), with the eager glue between them. The fallback where one graph over the whole network
    cannot be captured (a host sync outside the regions, checkpointing's recomputation): the regions' launches are
    still replayed, what syncs runs eagerly between them.

    ``reduce-overhead`` does not rule it out: where a graph over the network fails, the whole network's compile
    breaks at the same sync, into pieces cut where dynamo stopped rather than at the repeated blocks, and its warm
    start compiles each piece again. An H100's Mixtral MoE ran 67.4 ms a step under this plan, warm-started in
    12.8 s; under ``reduce-overhead`` it ran 71.4 ms and warm-started in 63.8 s (``benchmarks/RESULTS.md``). Not
    even where ``reduce-overhead`` ran clearly faster than eager: two H200 Mixtral searches timed it at 0.80x and
    0.89x of eager, and with this plan skipped there (tried at 21ca481, reverted) one fit ran ``reduce-overhead`` at
    64.3 ms a step and warm-started in 56.5 s, 0.82 of its cold start.

    Example::

        >>> from lightning_fuse.regions import Region
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> plan = RegionTrees(Setting([Region("0", net[0])], ("net", net), CompileOptions(), torch.device("cuda")))
        >>> plan.name, plan.tried_after, plan.records_graphs, plan.cudagraph_trees
        ('regions+trees', 'regions+graph', True, True)
    """

    tried_after = "regions+graph"

    def __init__(self, setting: Setting) -> None:
        options = replace(setting.options, mode="reduce-overhead")
        super().__init__(replace(setting, options=options), graph=False)
        self.name, self.dominated_by = "regions+trees", ("compile+graph", "regions+graphs")


class RegionGraphs(Regions):
    """The regions compiled, each with a CUDA graph of FuseCallback's own over its forward and backward, replayed
    between the eager glue around them: the fallback where one graph over the network cannot be captured because
    the code between the regions syncs with the host, or takes another path at each step. HF Wav2Vec2 skips each
    encoder layer at random in training (``layerdrop``: a host sync per layer) and selects its CTC labels by a
    mask; its one graph failed, and torch's cudagraph trees, which record one path of calls at a time, recorded
    again at most steps (``regions+trees`` ran 6-12x of eager on an H200). A region's own graph replays whatever
    ran before it. A region whose own call syncs or varies runs compiled without a graph (each graph says why).
    Where ``reduce-overhead`` ran faster than eager, it is not tried: on an H200 its capture failed on the layers of
    DeBERTa-v2 and BLOOM, whose ``reduce-overhead`` won, at 14.1 and 3.7 s of their cold searches (at e29d9a4);
    Wav2Vec2's ``reduce-overhead`` ran 11x of eager in its search, and this plan won at 0.34x. Where it runs faster
    than eager, ``regions+trees``, ``regions`` and ``compile`` are not tried, as where ``regions`` does: Wav2Vec2's
    ``compile`` trial, which ran no faster than eager, took 9.3-15.1 s of cold setups of 52.9-63.4 s (four
    searches on an H200, at 5832f66-342e7a3).

    Example::

        >>> from lightning_fuse.regions import Region
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> regions = [Region("0", net[0]), Region("1", net[1])]
        >>> plan = RegionGraphs(Setting(regions, ("net", net), CompileOptions(), torch.device("cuda")))
        >>> plan.name, plan.tried_after, [graph.name for graph in plan.graphs()]
        ('regions+graphs', 'regions+graph', ['0', '1'])
    """

    tried_after = "regions+graph"
    per_region_graphs = True

    def __init__(self, setting: Setting) -> None:
        super().__init__(setting, graph=False)
        self.name, self.records_graphs, self.dominated_by = "regions+graphs", True, ("compile+graph", "reduce-overhead")
        self.region_graphs = [self._graphed(runner.name, runner.region.module, on_capture_failure=self._fails_alike)
                              for runner in self._runners]  # fmt: skip

    def _fails_alike(self, failed: GraphedModule) -> None:
        """A region's capture failed: those of its class not captured yet would fail alike, and are not tried (on
        an H200 each of DeBERTa-v2's 12 layers failed in turn, in a trial of 21 s)."""
        why = f"its capture would fail as {failed.name!r}'s, a region of its class ({failed.disabled_reason})"
        for graph in self.region_graphs:
            if type(graph.module) is type(failed.module) and not graph.captured:
                graph.disable(why, warn=False)


class UserCompiled(Plan):
    """The user compiled the network before the fit (``model.compile()``): nothing is compiled twice; the eager
    reference steps bypass the user's compiled code, so ``fuse/speedup`` measures the user's compile. The baseline
    of :func:`~lightning_fuse.start.user_compiled_candidates`.

    Example::

        >>> net = torch.nn.Linear(2, 2)
        >>> net.compile(backend="eager")
        >>> UserCompiled([net]).describe()
        'user-compiled (1 module(s) already compiled before the fit; FuseCallback only measures)'
    """

    name = "user-compiled"
    owned = False

    def __init__(self, modules: list[nn.Module]) -> None:
        self._modules = modules
        self.reason = f"{len(modules)} module(s) already compiled before the fit; FuseCallback only measures"

    def modules(self) -> list[nn.Module]:
        return self._modules


class UserCompiledGraph(Graph):
    """One CUDA graph over the network the user compiled (``model.compile()``): their compiled code runs in the
    capture and is compiled no second time. It competes with their compile alone, the baseline it must beat; the
    eager reference steps bypass both. Dropped, it leaves their compile as they made it.

    Example::

        >>> net = torch.nn.Linear(2, 2)
        >>> net.compile(backend="eager")
        >>> setting = Setting([], ("net", net), CompileOptions(), torch.device("cuda"))
        >>> plan = UserCompiledGraph(setting, UserCompiled([net]))
        >>> plan.name, plan.modules() == [net]
        ('user-compiled+graph', True)
    """

    def __init__(self, setting: Setting, user: UserCompiled) -> None:
        super().__init__(setting)
        self.name, self.dominated_by, self._user = "user-compiled+graph", (), user

    def modules(self) -> list[nn.Module]:
        return list(dict.fromkeys([*self._user.modules(), *super().modules()]))


def plan_graphs(plan: Plan | None) -> list[GraphedModule]:
    """``plan``'s CUDA graphs of FuseCallback's own (:meth:`Plan.graphs`), if there is a plan.

    Example::

        >>> plan_graphs(None), plan_graphs(Plan())
        ([], [])
    """
    return plan.graphs() if plan is not None else []


def candidates(setting: Setting) -> list[Plan]:
    """The plans worth measuring for this device and process count, most promising first (eager always first).

    CUDA graphs need a CUDA device, and one process or DDP (:attr:`Setting.cuda_graphs`). With several processes
    ``compile`` is always measured: it is the one plan that also compiles what lies between and around the regions
    (embeddings, the head, the loss), and where no graph plan runs none stands in for it.
    """
    plans: list[Plan] = [Plan()]
    graphs = setting.cuda_graphs
    whole_is_regions = [r.module for r in setting.regions] == [setting.target[1]]
    if graphs:
        plans.append(Regions(setting, graph=True))
        if not whole_is_regions:
            plans.append(Whole(setting, None, graph=True))
        reduce_overhead = Whole(setting, "reduce-overhead")
        if whole_is_regions:  # then regions+graph is compile+graph: one graph over the whole network compiled
            reduce_overhead.same_kernels_as += ("regions+graph",)
        plans += [reduce_overhead, Graph(setting)]
        if setting.regions and not whole_is_regions:
            plans += [RegionGraphs(setting), RegionTrees(setting)]
    if setting.regions:
        plans.append(Regions(setting, graph=False))
    if not whole_is_regions:
        plans.append(Whole(setting, None))
        if setting.world_size > 1:
            plans[-1].dominated_by = ()
    return plans


def for_varying_shapes(plans: Sequence[Plan], buckets: int) -> list[Plan]:
    """The plans that hold when the network's input shapes vary between steps. A graph of FuseCallback's own is
    captured for one shape, so those plans compete only where the lengths are padded to ``buckets`` sizes (``0``:
    none; one graph per bucket, capped by :attr:`Setting.max_graphs`). torch's cudagraph trees compile the varying
    dims once, as dynamic, and record a graph for a size that comes again (the first
    :data:`~lightning_fuse.compiler.TREE_SIZES` such; other sizes run compiled without a graph): they always compete.

    Example::

        >>> net = torch.nn.Linear(2, 2)
        >>> plans = candidates(Setting([], ("net", net), CompileOptions(), torch.device("cuda")))
        >>> [plan.name for plan in for_varying_shapes(plans, buckets=0)]
        ['eager', 'reduce-overhead', 'compile']
    """
    return [plan for plan in plans if buckets or not plan.records_graphs or plan.cudagraph_trees]
