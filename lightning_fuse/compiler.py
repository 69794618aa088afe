"""Compile regions in place, check them against eager, fall back per region, and undo it all.

In-place means the same mechanism as :meth:`torch.nn.Module.compile`: the module's ``_compiled_call_impl`` is set,
so its class, hooks, parameter names and ``state_dict`` keys never change. We install a small callable there
(:class:`CompiledRegion`) that adds what ``Module.compile`` lacks: compile accounting, a first-call check against
eager, and a per-region fallback to eager on failure.

Example::

    >>> import torch
    >>> from lightning_fuse.regions import Region
    >>> block = torch.nn.Linear(4, 4)
    >>> from lightning_fuse.shapes import CompileTracker
    >>> runner = CompiledRegion(Region("block", block), CompileOptions(backend="eager"), CompileTracker(),
    ...                         RegionPolicy())
    >>> runner.install(); block(torch.randn(2, 4)).shape
    torch.Size([2, 4])
    >>> uncompile_regions([runner])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_fuse import compat, replay, sharding
from lightning_fuse.options import GRAPHING_MODES, RECOMPILE_LIMIT
from lightning_fuse.randomness import RandomDraws, call_device
from lightning_fuse.regions import Region
from lightning_fuse.shapes import CompileTracker, ModeKey, mark_region_inputs, warn_recompile

PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
"""Values that carry no state: a call's leaves of these types (beside tensors) can be kept, compared and replayed."""
TREE_SIZES = 32
"""Input sizes torch's cudagraph trees may record graphs for in one fit (:class:`RepeatedSizes`)."""
DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
"""torch's dropout layers (their common base, ``_DropoutNd``, is private)."""

# (rtol, atol) for comparing a compiled region with eager; compilers reorder float math.
TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-3, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}
FEW_ELEMENTS = 1e-3
"""The share of a compiled output's elements that may lie beyond :data:`TOLERANCES` where the rest match: a
data-dependent choice (a router's argmax, a top-k) that low-precision rounding tips the other way changes a few rows
wholesale, which no elementwise tolerance covers (a top-1 mixture of experts in bf16: 0.01-0.09% of the elements on
an H100), while a miscompile is rarely that local."""


class RepeatedSizes:
    """The input sizes torch's cudagraph trees may record CUDA graphs for: those met again, the first ``sizes`` such.

    Under a mode of :data:`~lightning_fuse.options.GRAPHING_MODES`, inductor records one graph per input size of a
    dynamic shape (a size met again replays its graph). A graph pays only for a size that comes again: where each batch
    has its own length, the trees' first run of every size (a warm-up run in their memory pool) costs more than compiled
    code alone, and its graph is never replayed. So a size runs the compiled code without a graph in the step it is
    first met, its next step starts the trees' recording, and past the first ``sizes`` sizes met again (memory for
    every graph) none records. Inductor asks ``key in sizes`` at each call, the key being a compiled graph's integer
    inputs (``None``: it has none, one graph); a size's forward and backward may ask two keys, so ``2 * sizes`` keys
    record. "Met again" counts in steps (:meth:`next_step`), not calls: a step's calls often share a key (on an H200,
    a Llama's and a DeBERTa's forward and backward both asked ``(length,)``, and a network broken into several graphs
    asks once per graph); counted in calls, the backward recorded a graph in the first step of every new size, and
    DeBERTa's steps before the handover below ran 1.44x those after it, 1.18x once counted in steps
    (``benchmarks/RESULTS.md``). Installed by :func:`compat.cap_cudagraph_sizes` while a plan under the trees is
    installed.

    Once the training calls have met more keys than record (:attr:`full`), most of their sizes will run without a
    graph, and steps under the trees then ran slower than without them; the fit then stops them (:meth:`stop`,
    :data:`~lightning_fuse.fit.SIZES_FULL`): every call runs the same compiled code without a graph, as fast as the
    compile without the trees and with nothing compiled again. On an H200, a Llama whose every batch had its own
    length ran 44.5 ms a step under trees kept past their cap, 22.5 handed over to ``compile`` (compiled then), and
    22.2 with its trees stopped (23.1 handed over in the same call, whose fit compiled 97 s against 47); a DeBERTa ran
    46.3 stopped against 63.9 handed over (``benchmarks/RESULTS.md``).
    Evaluation calls (:attr:`evaluating`: a validation loop's, each batch a step) have ``sizes`` of their own and
    never make it full: on an H200, Bloom generating 80 tokens in its validation (before ``generate`` ran eagerly,
    :class:`~lightning_fuse.kv_cache.EagerGeneration`) filled the training calls' cap, so that the fit handed its
    training steps, of one size throughout, over to the compile without graphs.

    Example::

        >>> sizes = RepeatedSizes(sizes=1)
        >>> [key in sizes for key in (64, 64)]  # a forward and its backward, in the step 64 is first met
        [False, False]
        >>> sizes.next_step()
        >>> [key in sizes for key in (64, 64, None)]
        [True, True, True]
        >>> sizes.stop()
        >>> [key in sizes for key in (64, None)]  # no graph recorded nor replayed: the compiled code runs alone
        [False, False]
    """

    def __init__(self, sizes: int = TREE_SIZES) -> None:
        self.sizes = sizes
        self.full = False
        """Whether the training calls met more keys than record graphs."""
        self.stopped = False
        """Whether no call records or replays a graph any more (:meth:`stop`)."""
        self.evaluating = False
        """Whether the calls from now are evaluation's rather than training's (:meth:`set_evaluating`)."""
        self._steps = {False: 0, True: 0}  # evaluating -> steps begun
        self._met: dict[bool, dict[Any, int]] = {False: {}, True: {}}  # evaluating -> key -> the step it was met in
        self._recorded: dict[bool, set[Any]] = {False: set(), True: set()}

    def set_evaluating(self, evaluating: bool) -> None:
        """The calls from now are evaluation's, or training's again; called before each evaluation batch, it begins
        a step of evaluation's (:meth:`next_step`)."""
        self.evaluating = evaluating
        self.next_step()

    def next_step(self) -> None:
        """A new step begins (a training iteration, or an evaluation batch while :attr:`evaluating`): the sizes met
        so far count as met again when they come."""
        self._steps[self.evaluating] += 1

    def stop(self) -> None:
        """From now on no call records a graph or replays one: every call runs inductor's code without a graph."""
        self.stopped = True

    def __contains__(self, key: Any) -> bool:
        if self.stopped:
            return False
        met, recorded = self._met[self.evaluating], self._recorded[self.evaluating]
        if key is None or key in recorded:
            return True
        step = self._steps[self.evaluating]
        met_now = met.setdefault(key, step) == step  # first met in this step
        if not self.evaluating and not self.full and len(met) > 2 * self.sizes:
            self.full = True
            rank_zero_info("FuseCallback: the training steps met more input sizes than torch's CUDA graphs record in "
                           "one fit: most run compiled, without a graph. Pad the lengths to a few sizes with "
                           "`pad_buckets` to keep every step in a graph.")  # fmt: skip
        if met_now or len(recorded) >= 2 * self.sizes:
            return False
        recorded.add(key)
        return True

    def __reduce__(self) -> tuple[type, tuple[int]]:
        # inductor keys its compile cache by its pickled config: the sizes met so far must not change the key
        return RepeatedSizes, (self.sizes,)


@dataclass
class CompileOptions:
    """The arguments passed through to :func:`torch.compile` for every region. torch.compile refuses a mode and
    options together: with both, inductor gets the options the mode stands for with the user's over them, as
    torch.compile itself applies them (:func:`~lightning_fuse.compat.mode_options`).

    Example::

        >>> CompileOptions(mode="max-autotune").kwargs()["mode"]
        'max-autotune'
        >>> CompileOptions(mode="reduce-overhead", options={"fallback_random": True}).kwargs()["options"]
        {'triton.cudagraphs': True, 'fallback_random': True}
    """

    mode: str | None = None
    backend: str | Callable[..., Any] = "inductor"
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict[str, Any] | None = None

    def kwargs(self, **overrides: Any) -> dict[str, Any]:
        return {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic,
                **self._mode_or_options(), **overrides}  # fmt: skip

    def _mode_or_options(self) -> dict[str, Any]:
        if not self.options:
            return {"mode": self.mode}
        if self.mode in (None, "default"):
            return {"options": self.options}
        implied = compat.mode_options(self.mode) if self.backend == "inductor" else None
        return {"mode": self.mode} if implied is None else {"options": {**implied, **self.options}}


@dataclass
class RegionPolicy:
    """How each region behaves after compiling: verification and the recompile limit.

    Example::

        >>> RegionPolicy(recompile_limit=2).on_recompile_limit
        'eager'
    """

    verify: bool = True
    recompile_limit: int = RECOMPILE_LIMIT
    on_recompile_limit: str = "eager"
    dynamic_sizes: set[tuple[int, int]] = field(default_factory=set)
    """The batch's ``(dim, size)`` pairs marked dynamic this step; carried onto region inputs."""
    as_called: Callable[[nn.Module, tuple, dict], tuple[tuple, dict]] = field(default=lambda module, *call: call)
    """``(module, args, kwargs) -> (args, kwargs)``: a call as the module's forward receives it, after the forward
    pre-hooks FuseCallback installs (``use_cache=False``: :class:`~lightning_fuse.kv_cache.NoCacheInTraining`). The
    verification's eager reference runs the forward alone, so it must be handed what the hooks made of the call."""


class CompiledRegion:
    """The callable installed as a region's ``_compiled_call_impl``.

    Args:
        region: The region to compile.
        options: torch.compile arguments.
        tracker: Where compiles are counted.
        policy: Verification and recompile-limit settings, shared by all regions of one callback.

    Example::

        >>> import torch
        >>> from lightning_fuse.regions import Region
        >>> lin = torch.nn.Linear(2, 2)
        >>> runner = CompiledRegion(Region("lin", lin), CompileOptions(backend="eager"), CompileTracker(),
        ...                         RegionPolicy())
        >>> runner.install(); runner.is_compiled
        True
        >>> runner.uninstall(); compat.compiled_call_impl(lin) is None
        True
    """

    def __init__(self, region: Region, options: CompileOptions, tracker: CompileTracker, policy: RegionPolicy):
        self.region, self.options, self.tracker, self.policy = region, options, tracker, policy
        self.fallback_reason: str | None = None
        self.closed_reason: str | None = None
        """Why the region compiles nothing new: past ``recompile_limit`` its compiled code still runs the kinds of
        input it was compiled for, and a new kind runs eagerly (torch's ``eager_on_recompile`` stance)."""
        self._compiled = torch.compile(compilable_call(region.module), **options.kwargs())
        self._settings = repr(options.kwargs())  # another plan's settings compile anew: a compile, not a recompile
        self._verified: set[ModeKey] = set()
        self._capture_undone = replay.capture_failure_undone if options.mode in GRAPHING_MODES else nullcontext
        self._warned_recompile = self._made_dynamic = False
        self._recompiles_allowed = policy.recompile_limit
        self._installed = False
        self.on_return: Callable[[Any], Any] | None = None
        """Called with what each call that trains returned, which it returns in its stead (a plan under torch's
        cudagraph trees watches them: :class:`~lightning_fuse.held_outputs.OutputWatch`)."""
        self.on_trees_failure: Callable[[str], None] | None = None
        """Called, in place of the fallback's warning, with why a call failed in torch's cudagraph trees
        (:func:`~lightning_fuse.replay.raised_in_cudagraph_trees`): the fit's plan hands over to the same compile
        without them (:meth:`~lightning_fuse.plan.Plan.watch_trees_failures`); till then the region runs eagerly."""

    @property
    def name(self) -> str:
        return self.region.name

    @property
    def is_compiled(self) -> bool:
        return self.fallback_reason is None and self._installed

    def install(self) -> None:
        compat.set_compiled_call_impl(self.region.module, self)
        self._installed = True

    def uninstall(self) -> None:
        if compat.compiled_call_impl(self.region.module) is self:
            compat.set_compiled_call_impl(self.region.module, None)
        self._installed = False

    def fall_back(self, reason: str, err: BaseException | None = None) -> None:
        """Run this region eagerly for the rest of the run, with one warning naming it and why; where ``err`` (the
        compiled call's) came from torch's cudagraph trees, :attr:`on_trees_failure` is told instead, if set."""
        if self.fallback_reason is not None:
            return
        self.fallback_reason = reason
        if err is not None and self.on_trees_failure is not None and replay.raised_in_cudagraph_trees(err):
            self.on_trees_failure(f"region {self.name!r} raised {reason}")
        else:
            rank_zero_warn(f"FuseCallback: region {self.name!r} falls back to eager for the rest of the run: {reason}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.region.module
        if self.fallback_reason is not None:
            return compat.call_uncompiled(module, *args, **kwargs)
        if self.policy.dynamic_sizes:
            mark_region_inputs((*args, *kwargs.values()), self.policy.dynamic_sizes)
        mode = (module.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        if self.policy.verify and mode not in self._verified and not forced_eager():
            return self._verified_call(mode, args, kwargs)
        return self._guarded_call(mode, args, kwargs)

    def _guarded_call(self, mode: ModeKey, args: tuple, kwargs: dict) -> Any:
        module = self.region.module
        before = self.tracker.total_compiles
        try:
            with self._capture_undone(), self._tracked(mode), self._stance():  # a tree's capture may fail
                out = self._compiled(*args, **kwargs)
        except compat.control_flow_errors():
            raise  # torch's own signal through user code (checkpointing's early stop), not a failure
        except Exception as err:  # noqa: BLE001 - any compiler failure; a user bug re-raises from eager below
            out = compat.call_uncompiled(module, *args, **kwargs)  # raises here if the code itself is wrong
            self.fall_back(describe_error(err), err)
            return out
        if self.tracker.total_compiles != before:
            self._check_recompiles(evaluating=not (mode[0] and mode[1]))
        if self.on_return is not None and torch.is_grad_enabled() and not forced_eager():
            return self.on_return(out)
        return out

    def _tracked(self, mode: ModeKey) -> AbstractContextManager[None]:
        """The call's compiles, attributed to the region (:class:`CompileTracker`); a call forced eager compiles
        nothing, and does not make the region's first compile in ``mode`` count as a recompile."""
        return nullcontext() if forced_eager() else self.tracker.calling(self.name, mode, self._settings)

    def _verified_call(self, mode: ModeKey, args: tuple, kwargs: dict) -> Any:
        module = self.region.module
        if module.training and torch.is_grad_enabled() and changes_in_training(module):
            # dropout draws other random numbers when compiled, and running batch-norm twice would update its
            # statistics twice: such regions are checked on their first eval call instead
            return self._guarded_call(mode, args, kwargs)
        if not _pure_inputs(args, kwargs):
            # an input object the call may change (a KV cache it appends to): running the call twice is not the same
            self._verified.add(mode)
            return self._guarded_call(mode, args, kwargs)
        out = self._guarded_call(mode, args, kwargs)
        if self.fallback_reason is not None:
            return out
        draws = RandomDraws()
        try:
            with draws.around(call_device(module, args, kwargs)):
                reference = self._eager_reference(args, kwargs)
        except compat.control_flow_errors():
            raise
        except Exception as err:  # noqa: BLE001 - the check's own failure costs the region, never the run
            self.fall_back(f"its first output could not be checked against eager ({describe_error(err)})")
            return out
        self._verified.add(mode)
        if draws.drew:  # random (dropout written as a function, say): checked in eval, as an nn.Dropout region is
            return out
        mismatch = _compare(out, reference)
        if mismatch is None:
            return out
        self.fall_back(f"its compiled output differs from eager on the first batch ({mismatch})")
        return compat.call_uncompiled(module, *args, **kwargs)  # its hooks make the call as they made it before

    def _eager_reference(self, args: tuple, kwargs: dict) -> Any:
        """The region's eager output for the call it just ran compiled: its forward alone, on the call as its hooks
        made it (they ran once already); a module FSDP2 shards runs its whole plain call, hooks included, since
        only its hooks gather its parameters and cast its inputs (handed the call as FuseCallback's own hooks made
        it: under ``no_grad`` they would leave it as it was)."""
        module = self.region.module
        args, kwargs = self.policy.as_called(module, args, kwargs)  # not under no_grad: as the hooks saw it
        with torch.no_grad():
            if sharding.is_sharded(module):
                return compat.call_uncompiled(module, *args, **kwargs)
            return module.forward(*args, **kwargs)

    def _check_recompiles(self, evaluating: bool) -> None:
        stats = self.tracker.stats(self.name)
        if stats.recompiles and not self._warned_recompile:
            self._warned_recompile = True
            warn_recompile(self.name, stats, marked={dim for dim, _ in self.policy.dynamic_sizes},
                           evaluating=evaluating)  # fmt: skip
        recompiles = stats.most_recompiles_of_one_code  # as torch's own limit counts: per code object
        if recompiles <= self._recompiles_allowed:
            return
        if self.policy.on_recompile_limit == "dynamic" and not self._made_dynamic:
            self._made_dynamic = True
            self._recompiles_allowed = recompiles + 1 + self.policy.recompile_limit  # the dynamic one is free
            self._compiled = torch.compile(compilable_call(self.region.module), **self.options.kwargs(dynamic=True))
            rank_zero_warn(
                f"FuseCallback: region {self.name!r} recompiled {recompiles} times (limit "
                f"{self.policy.recompile_limit}); compiling it with dynamic=True from now on."
            )
            return
        if self.closed_reason is None:
            last = stats.recompile_reasons[-1] if stats.recompile_reasons else "unknown"
            self.closed_reason = f"it recompiled {recompiles} times (recompile_limit={self.policy.recompile_limit})"
            rank_zero_warn(
                f"FuseCallback: region {self.name!r} {self.closed_reason}; from now on it runs compiled for the "
                f"inputs it was compiled for and eagerly for new kinds. Last reason: {last}. Declare varying dims "
                "with `dynamic_dims` or raise `recompile_limit`."
            )

    def _stance(self) -> AbstractContextManager[Any]:
        return torch.compiler.set_stance("eager_on_recompile") if self.closed_reason else nullcontext()


def compilable_call(module: nn.Module) -> Callable[..., Any]:
    """``module``'s plain call (:func:`~lightning_fuse.compat.plain_call`, hooks included) in a form dynamo compiles.

    torch 2.11 compiles nothing of a module of torch's own (``nn.Sequential``, ``nn.TransformerEncoderLayer``)
    through ``Module.compile()`` or the slot FuseCallback installs into: dynamo leaves the frame alone, and the module
    runs eagerly without a word (on an H200, a network held as an ``nn.Sequential`` "compiled" in 0.0 s; torch 2.14
    compiles it). Called from a function of ours, it is traced as a user's module is.

    Example::

        >>> compilable_call(nn.Sequential(nn.Linear(2, 2))).__name__  # torch's own: called from ours
        'torch_module_call'
        >>> class Net(nn.Module):
        ...     def forward(self, x):
        ...         return x
        >>> net = Net()
        >>> compilable_call(net) == compat.plain_call(net)  # a user's module: as Module.compile compiles it
        True
    """
    call = compat.plain_call(module)
    if not type(module).__module__.startswith("torch."):
        return call

    def torch_module_call(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    return torch_module_call


def uncompile_regions(runners: Sequence[CompiledRegion]) -> None:
    """Restore plain eager modules, exactly as before the runners were installed."""
    for runner in runners:
        runner.uninstall()


@contextmanager
def plain_eager(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Inside the block, ``modules`` run their plain ``_call_impl``, bypassing whatever is installed on them.

    The eager reference steps use it, so they run exactly the user's eager code: no runner, no dynamo frame, no
    graph dispatch in between (``set_stance("force_eager")`` alone still routes every call through them).

    Example::

        >>> lin = torch.nn.Linear(2, 2)
        >>> compat.set_compiled_call_impl(lin, print)
        >>> with plain_eager([lin]):
        ...     compat.compiled_call_impl(lin) is None
        True
        >>> compat.compiled_call_impl(lin) is print
        True
    """
    saved = [(module, compat.compiled_call_impl(module)) for module in modules]
    for module, _ in saved:
        compat.set_compiled_call_impl(module, None)
    try:
        yield
    finally:
        for module, installed in saved:
            compat.set_compiled_call_impl(module, installed)


def forced_eager() -> bool:
    return torch.compiler.is_compiling() or compat.active_stance() == "force_eager"


def changes_in_training(module: nn.Module) -> bool:
    """Whether a training-mode call is random (dropout) or updates state (buffers such as batch-norm statistics)."""
    if next(module.buffers(), None) is not None:
        return True
    for sub in module.modules():
        if isinstance(sub, DROPOUTS) and sub.p > 0:
            return True
        if isinstance(sub, nn.MultiheadAttention) and sub.dropout > 0:
            return True
    return False


def _pure_inputs(args: tuple, kwargs: dict) -> bool:
    """Whether every input is a tensor or a plain value, so that calling twice computes the same thing twice."""
    return all(isinstance(leaf, (torch.Tensor, *PLAIN)) for leaf in compat.tree_leaves((args, kwargs)))


def _compare(out: Any, reference: Any) -> str | None:
    """None when ``out`` matches ``reference`` at a dtype-aware tolerance (all but :data:`FEW_ELEMENTS` of each
    output's elements), else a short description.

    Example::

        >>> want = torch.zeros(10_000)
        >>> got = want.clone(); got[:5] = 1.0  # 0.05%: a few rows a routing flip changed
        >>> _compare(got, want) is None
        True
        >>> got[:50] = 1.0  # 0.5%
        >>> _compare(got, want)[:40]
        'output 0: Tensor-likes are not close! Mi'
    """
    got, want = compat.tree_leaves(out), compat.tree_leaves(reference)
    if len(got) != len(want):
        return f"{len(got)} outputs against {len(want)} from eager"
    for index, (a, b) in enumerate(zip(got, want)):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and b.is_floating_point()):
            continue
        rtol, atol = TOLERANCES[effective_dtype(b)]
        try:
            torch.testing.assert_close(a.detach(), b, rtol=rtol, atol=atol)
        except AssertionError as err:
            if not _few_elements_differ(a.detach(), b, rtol, atol):
                return f"output {index}: " + " ".join(str(err).split())[:300]
    return None


def _few_elements_differ(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> bool:
    """Whether ``got`` differs from ``want`` beyond the tolerance in at most :data:`FEW_ELEMENTS` of its elements
    (same shape and dtype, and finite where ``want`` is)."""
    if got.shape != want.shape or got.dtype != want.dtype or not bool(torch.isfinite(got[torch.isfinite(want)]).all()):
        return False
    beyond = ~torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    return int(beyond.sum()) <= FEW_ELEMENTS * want.numel()


def effective_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The precision the math behind ``tensor`` actually ran in: autocast and TF32 lower it below the output's."""
    if not tensor.is_floating_point() or tensor.dtype not in TOLERANCES:
        return torch.float32
    device = tensor.device.type
    if torch.is_autocast_enabled(device):
        return lowest_precision([tensor.dtype, torch.get_autocast_dtype(device)])
    if tensor.dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return torch.float16  # TF32/bf16 matmuls carry about fp16's 10-bit mantissa
    return tensor.dtype


def lowest_precision(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The least precise of ``dtypes``, the one with the loosest :data:`TOLERANCES` (float32 where there are none).

    Example::

        >>> lowest_precision([torch.float32, torch.bfloat16]), lowest_precision([])
        (torch.bfloat16, torch.float32)
    """
    return max(dtypes, key=lambda dtype: TOLERANCES[dtype][0], default=torch.float32)


def describe_error(err: BaseException) -> str:
    """``Type: message`` of the innermost cause (torch wraps backend errors), first line only."""
    root = err
    while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
        root = inner
    lines = str(root).strip().splitlines()
    message = f"{type(root).__name__}: {lines[0][:300] if lines else '(no message)'}"
    return message if root is err else f"{type(err).__name__} ({message})"
