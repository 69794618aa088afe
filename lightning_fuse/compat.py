r"""Every private torch API that lightning_fuse uses, in one place, each one checked before it is used.

torch has no public API for some of what FuseCallback does: installing a callable where
:meth:`torch.nn.Module.compile` installs its own, reading the active compile stance, counting dynamo's
compiles and graph breaks. Each such use is one function here, with a comment saying why no public API serves.

Every private attribute is listed in :data:`PRIVATE_APIS` with the torch versions lightning_fuse was tested
with (:data:`TESTED_TORCH`). A function looks its attribute up when it is called:

- if torch no longer has it, the function raises :class:`TorchAPIChanged`, naming the attribute, this torch and
  the tested versions;
- if the feature only reports something (graph-break counts, cache hits, recompile reasons), it warns once
  instead and degrades, for example by counting zero;
- if torch has it but is outside the tested versions, one warning says so the first time.

Nothing fails silently.

Example::

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> set_compiled_call_impl(lin, lambda x: "installed")  # what Module.compile does, with our own callable
    >>> lin(torch.zeros(2))
    'installed'
    >>> set_compiled_call_impl(lin, None)
    >>> compiled_call_impl(lin) is None, active_stance()
    (True, 'default')
"""

from __future__ import annotations

import functools
import importlib
from collections import Counter, defaultdict
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from types import CodeType, MethodType
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn

TESTED_TORCH = SpecifierSet(">=2.11,<2.16")
"""The torch versions whose private APIs below were checked (keep in step with pyproject.toml)."""
TORCH_VERSION = Version(Version(torch.__version__).base_version)
"""This torch's release, without local tags (``2.14.1+cu130`` -> ``2.14.1``)."""


class TorchAPIChanged(RuntimeError):
    """A private torch API that lightning_fuse relies on is gone or behaves differently in this torch.

    Example::

        >>> str(TorchAPIChanged("torch.x", "a reason")).startswith("lightning_fuse needs torch.x (a reason)")
        True
    """

    def __init__(self, path: str, why: str, detail: str = "") -> None:
        tested = "" if torch_is_tested() else ", which lightning_fuse was never tested with"
        super().__init__(f"lightning_fuse needs {path} ({why}), but torch {torch.__version__}{tested} "
                         f"{detail or 'does not have it'}. lightning_fuse is tested with torch{TESTED_TORCH}: install "
                         f"one of those (pip install 'torch{TESTED_TORCH}') or a lightning_fuse release that supports "
                         "this torch.")  # fmt: skip


@dataclass(frozen=True)
class PrivateAPI:
    """One private torch attribute: its dotted path, what we need it for, and the torch versions it was checked on.

    Example::

        >>> PRIVATE_APIS["torch._dynamo.config.recompile_limit"].required
        True
    """

    path: str
    why: str
    required: bool = True
    """``False``: without it a report degrades (with one warning) and training goes on."""
    tested: SpecifierSet = TESTED_TORCH


PRIVATE_APIS: dict[str, PrivateAPI] = {api.path: api for api in (
        PrivateAPI("torch.nn.Module._compiled_call_impl", "installing compiled regions in place, as Module.compile"),
        PrivateAPI("torch.nn.Module._call_impl", "calling a region's plain eager code, hooks included"),
        PrivateAPI("torch._dynamo.eval_frame._stance", "reading the active torch.compiler.set_stance"),
        PrivateAPI("torch.utils._python_dispatch._disable_current_modes", "running compiled under a dispatch mode"),
        PrivateAPI("torch._dynamo.config.recompile_limit", "raising dynamo's per-code recompile limit"),
        PrivateAPI("torch._dynamo.callback.callback_handler", "timing each compile and bounding recompiles"),
        PrivateAPI("torch._dynamo.lookup_backend", "checking a backend name before fit", required=False),
        PrivateAPI("torch._dynamo.exc.InvalidBackend", "checking a backend name before fit", required=False),
        PrivateAPI("torch._inductor.config", "checking inductor options before fit", required=False),
        PrivateAPI("torch._inductor.list_mode_options", "keeping inductor options beside a mode", required=False),
        PrivateAPI("torch._dynamo.utils.counters", "counting graph breaks and cache hits", required=False),
        PrivateAPI("torch._dynamo.utils.get_compilation_metrics", "reading recompile reasons", required=False),
        PrivateAPI("torch._dynamo.eval_frame._debug_get_cache_entry_list", "counting compiled entries", required=False),
        PrivateAPI("torch._inductor.cudagraph_trees.get_manager", "counting cudagraph trees' graphs, telling their "
                   "errors", required=False),
        PrivateAPI("torch._dynamo.maybe_mark_dynamic", "marking varying batch dims", required=False),
        PrivateAPI("torch._inductor.config.triton.cudagraph_capture_sizes", "capping graph sizes", required=False),
        PrivateAPI("torch._dynamo.eval_frame.OptimizedModule", "recognising a user-compiled network", required=False),
        PrivateAPI("torch.Tensor._is_view", "releasing a CUDA graph capture's autograd graph"),
        PrivateAPI("torch.utils.checkpoint._StopRecomputationError", "checkpointing's early stop", required=False),
        PrivateAPI("torch.cuda._get_nvml_device_index", "NVML's index of a CUDA device", required=False),
        PrivateAPI("torch._foreach_copy_", "copying the gradients into a captured update's buffers in one launch"),
        PrivateAPI("torch._foreach_add_", "adding a replayed backward's gradients to those held, in one launch"),
        PrivateAPI("torch._C._cuda_clearCublasWorkspaces", "private cuBLAS workspaces per CUDA graph", required=False),
        PrivateAPI("torch._C._storage_Use_Count", "telling whether a CUDA graph's last outputs are still held"),
        PrivateAPI("torch.multiprocessing.reductions.StorageWeakRef", "watching graph outputs without holding them"),
        *(PrivateAPI(f"torch.Tensor.{name}", "telling whether anything watches a parameter's gradient arrive",
                     required=False) for name in ("_backward_hooks", "_post_accumulate_grad_hooks")),
        *(PrivateAPI(f"torch.optim.optimizer.{name}", "telling a captured optimizer update from one with step hooks",
                     required=False) for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")),
        *(PrivateAPI(f"torch.utils._pytree.{name}", "flattening inputs and outputs (no public torch.utils.pytree)")
          for name in ("tree_flatten", "tree_unflatten", "tree_leaves", "tree_map")),
)}
_warned: set[str] = set()


def torch_is_tested() -> bool:
    """Whether this torch is one lightning_fuse was tested with (:data:`TESTED_TORCH`).

    Example::

        >>> isinstance(torch_is_tested(), bool)
        True
    """
    return TORCH_VERSION in TESTED_TORCH


def check_private_apis() -> None:
    """Look up every required private API now, so a changed torch fails before training, naming all of them.

    Raises:
        TorchAPIChanged: If any required attribute is missing; a missing optional one warns once.

    Example::

        >>> check_private_apis()
    """
    missing = []
    for path, api in PRIVATE_APIS.items():
        try:
            _get(path)
        except TorchAPIChanged:
            if api.required:
                missing.append(path)
            else:
                _warn_once(path, f"FuseCallback: torch {torch.__version__} has no {path}; {api.why} is skipped.")
    if missing:
        raise TorchAPIChanged(", ".join(missing), "FuseCallback's in-place compile and its accounting")
    _check_compiled_call_impl()


def _get(path: str) -> Any:
    """The object at ``path``, importing submodules on the way; :class:`TorchAPIChanged` if torch lacks it.

    Looked up anew at every call (a per-step hot path: plain attribute reads, an import only for a submodule not
    imported yet), so a torch that moves or deletes the attribute is caught whenever it happens.
    """
    api = PRIVATE_APIS[path]
    parts = path.split(".")
    obj: Any = torch
    for i, part in enumerate(parts[1:], start=2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                raise TorchAPIChanged(path, api.why) from None
    if not _tested(TORCH_VERSION, api.tested):
        _warn_once(f"version {api.tested}", f"lightning_fuse: torch {torch.__version__} is outside the versions its "
                   f"private torch APIs were checked with (torch{api.tested}). They are still looked up as they are "
                   "used, and lightning_fuse raises where one is gone (lightning_fuse.compat lists them).")
    return obj


_tested_answers: dict[tuple[int, int], bool] = {}


def _tested(version: Version, tested: SpecifierSet) -> bool:
    """``version in tested``, remembered by identity: the check runs at every compiled region's call, and a
    ``SpecifierSet`` test (or hash) costs microseconds."""
    key = (id(version), id(tested))
    if key not in _tested_answers:
        _tested_answers[key] = version in tested
    return _tested_answers[key]


def _optional(path: str, fallback: Any) -> Any:
    """``_get(path)``, or ``fallback`` with one warning saying what is lost."""
    try:
        return _get(path)
    except TorchAPIChanged as err:
        _warn_once(path, f"FuseCallback: {PRIVATE_APIS[path].why} is skipped for the rest of the run: {err}")
        return fallback


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        rank_zero_warn(message)


# ---------------------------------------------------------------------------------------------------------------
# Module.compile's mechanism. Why private: Module.compile() installs torch.compile(self._call_impl) in the
# `_compiled_call_impl` slot, which `Module.__call__` calls instead of `_call_impl`. No public API installs another
# callable there, and only that slot keeps the module's class, hooks and state_dict keys unchanged (an
# OptimizedModule wrapper changes all three).


def compiled_call_impl(module: nn.Module) -> Callable[..., Any] | None:
    """What ``module(...)`` calls instead of its plain code: ``None`` when nothing is installed.

    Raises:
        TorchAPIChanged: If torch no longer routes module calls through ``_compiled_call_impl``.

    Example::

        >>> compiled_call_impl(torch.nn.Linear(2, 2)) is None
        True
    """
    _check_compiled_call_impl()
    return module._compiled_call_impl


def set_compiled_call_impl(module: nn.Module, fn: Callable[..., Any] | None) -> None:
    """Make ``module(...)`` call ``fn`` (with the call's arguments) instead of its plain code; ``None`` undoes it.

    Undoing leaves the module as it was built, without an attribute of its own (the class's ``None`` shows): torch
    2.11's dynamo guards a network compiled whole on its blocks' ``__dict__`` not holding one, and a block left with
    its own ``None`` (a losing candidate's regions, uninstalled) recompiled the whole network (HF BLOOM on an H200).

    Raises:
        TorchAPIChanged: If torch no longer routes module calls through ``_compiled_call_impl``.

    Example::

        >>> lin = torch.nn.Linear(2, 2)
        >>> set_compiled_call_impl(lin, lambda x: x + 1)
        >>> lin(torch.zeros(1)).item()
        1.0
    """
    _check_compiled_call_impl()
    vars(module).pop("_compiled_call_impl", None)  # as built: the class's None shows
    if fn is not None:
        module._compiled_call_impl = fn


def call_uncompiled(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call ``module``'s plain eager code with its hooks, bypassing whatever is installed in its slot.

    Why private: ``Module._call_impl`` is the only entry that runs the hooks without the compiled slot.

    Example::

        >>> lin = torch.nn.Linear(2, 2)
        >>> set_compiled_call_impl(lin, print)
        >>> call_uncompiled(lin, torch.zeros(2)).shape
        torch.Size([2])
    """
    return plain_call(module)(*args, **kwargs)


def plain_call(module: nn.Module) -> Callable[..., Any]:
    """``module``'s plain eager call (hooks included) as a bound method: what ``Module.compile`` compiles.

    Why private: as :func:`call_uncompiled`; ``torch.compile`` needs the callable itself.

    Example::

        >>> lin = torch.nn.Linear(2, 2)
        >>> plain_call(lin)(torch.zeros(2)).shape
        torch.Size([2])
    """
    _check_compiled_call_impl()
    return module._call_impl


def control_flow_errors() -> tuple[type[BaseException], ...]:
    """Exceptions torch raises on purpose through user code, which a fallback must let pass, never catch.

    Why private: non-reentrant activation checkpointing stops its recomputation early by raising
    ``torch.utils.checkpoint._StopRecomputationError`` through the recomputed forward (compiled regions included);
    caught, it reads as a compiler failure, and re-running the region eagerly trips torch's own assertion
    ("target_frame.early_stop is set"). Without it (one warning) nothing is let through.

    Example::

        >>> [error.__name__ for error in control_flow_errors()]
        ['_StopRecomputationError']
    """
    return tuple(filter(None, [_optional("torch.utils.checkpoint._StopRecomputationError", None)]))


@functools.cache
def _check_compiled_call_impl() -> None:
    """Once per process (again after a failure): the slot exists and ``Module.__call__`` really calls what is
    installed there."""
    path = "torch.nn.Module._compiled_call_impl"
    _get("torch.nn.Module._call_impl")
    _get(path)
    probe, marker = nn.Identity(), object()
    probe._compiled_call_impl = lambda *args, **kwargs: marker
    if probe(0) is not marker:
        raise TorchAPIChanged(path, PRIVATE_APIS[path].why, "no longer calls what is installed there")


# ---------------------------------------------------------------------------------------------------------------
# Dynamo's settings and state.


def active_stance() -> str:
    """The stance set by :func:`torch.compiler.set_stance` around this call (``"default"`` outside any).

    Why private: ``set_stance`` has no getter; torch keeps the active stance in ``eval_frame._stance``.

    Raises:
        TorchAPIChanged: If torch keeps the stance elsewhere.

    Example::

        >>> with torch.compiler.set_stance("force_eager"):
        ...     active_stance()
        'force_eager'
    """
    path = "torch._dynamo.eval_frame._stance"
    stance = getattr(_get(path), "stance", None)
    if not isinstance(stance, str):
        raise TorchAPIChanged(path, PRIVATE_APIS[path].why, f"keeps no `.stance` string there (got {stance!r})")
    return stance


def without_dispatch_modes() -> Any:
    """A context in which no ``TorchDispatchMode`` is active (those active outside are back after it).

    Dynamo runs a compiled function's plain code while one is active (a ``FlopCounterMode`` counting an eager step),
    so a call that must run compiled leaves them. Why private: only ``torch.utils._python_dispatch`` pops them.

    Example::

        >>> from torch.utils.flop_counter import FlopCounterMode
        >>> with FlopCounterMode(display=False) as counter, without_dispatch_modes():
        ...     _ = torch.ones(2, 2) @ torch.ones(2, 2)
        >>> counter.get_total_flops()
        0
    """
    return _get("torch.utils._python_dispatch._disable_current_modes")()


def dynamo_recompile_limit() -> int:
    """Dynamo's limit of recompiles per code object (``torch._dynamo.config.recompile_limit``).

    Why private: ``torch.compiler.config`` does not expose it; only ``torch._dynamo.config`` does.

    Example::

        >>> dynamo_recompile_limit() >= 1
        True
    """
    path = "torch._dynamo.config.recompile_limit"
    limit = _get(path)
    if not isinstance(limit, int):
        raise TorchAPIChanged(path, PRIVATE_APIS[path].why, f"holds {limit!r} there, not an int")
    return limit


def set_dynamo_recompile_limit(limit: int) -> None:
    """Set dynamo's limit of recompiles per code object; read the old one first to restore it.

    Why private: as :func:`dynamo_recompile_limit`. The limit must stay raised from fit start to teardown, across
    hooks, so ``torch._dynamo.config.patch`` (a context manager) does not fit.

    Example::

        >>> before = dynamo_recompile_limit()
        >>> set_dynamo_recompile_limit(before + 1); dynamo_recompile_limit() == before + 1
        True
        >>> set_dynamo_recompile_limit(before)
    """
    dynamo_recompile_limit()  # raises if torch moved it
    torch._dynamo.config.recompile_limit = limit


def register_compile_callbacks(on_start: Callable[..., Any], on_end: Callable[..., Any]) -> None:
    """Call ``on_start``/``on_end`` around every dynamo compile in this process.

    Why private: dynamo's compile start/end hooks exist only as ``torch._dynamo.callback.callback_handler``;
    ``torch.compiler`` offers no callback. Required: recompiles are counted, and bounded, through them.

    Example::

        >>> noop = lambda *args: None
        >>> register_compile_callbacks(noop, noop); remove_compile_callbacks(noop, noop)
    """
    handler = _compile_callback_handler()
    handler.register_start_callback(on_start)
    handler.register_end_callback(on_end)


def remove_compile_callbacks(on_start: Callable[..., Any], on_end: Callable[..., Any]) -> None:
    """Undo :func:`register_compile_callbacks`.

    Example::

        >>> remove_compile_callbacks  # doctest: +ELLIPSIS
        <function remove_compile_callbacks at ...>
    """
    handler = _compile_callback_handler()
    handler.remove_start_callback(on_start)
    handler.remove_end_callback(on_end)


def _compile_callback_handler() -> Any:
    path = "torch._dynamo.callback.callback_handler"
    handler = _get(path)
    needed = ("register_start_callback", "register_end_callback", "remove_start_callback", "remove_end_callback")
    lacking = [name for name in needed if not callable(getattr(handler, name, None))]
    if lacking:
        raise TorchAPIChanged(path, PRIVATE_APIS[path].why, f"has no {', '.join(lacking)} there")
    return handler


def compile_event(callback_args: Any) -> tuple[str, str]:
    """What a dynamo compile callback was called for, and the code object it concerns.

    The first is the trigger's name: ``"DYNAMO"`` (a frame traced and compiled), ``"LAZY_BACKWARD"`` (a compiled
    graph's backward, compiled at its first call), ``"CUDAGRAPH_RECORDING"`` (torch's cudagraph trees recording a
    graph), or another of torch's ``CallbackTrigger`` names. The second is dynamo's compile id less its compile
    count: "3/1" (the second compile of frame 3) gives "3", "!0/3/1" (under compiled autograd) "!0/3".

    Why private: both come in the ``CallbackArgs`` handed to the callbacks of :func:`register_compile_callbacks`,
    the id laid out by dynamo's ``CompileId.__str__``. Without them a callback reads as ``("DYNAMO", "")``: a
    compile, and one code object for all.

    Example::

        >>> from types import SimpleNamespace
        >>> from enum import Enum
        >>> compile_event(SimpleNamespace(callback_trigger=Enum("T", "LAZY_BACKWARD").LAZY_BACKWARD, compile_id="3/1"))
        ('LAZY_BACKWARD', '3')
        >>> compile_event(SimpleNamespace(compile_id="!0/3/1")), compile_event(None)
        (('DYNAMO', '!0/3'), ('DYNAMO', ''))
    """
    trigger = getattr(getattr(callback_args, "callback_trigger", None), "name", "DYNAMO")
    return trigger, str(getattr(callback_args, "compile_id", "")).rpartition("/")[0]


def dynamo_counters() -> Mapping[str, Counter]:
    """Dynamo's process-wide event counters (``counters["graph_break"]``, ``counters["inductor"]``, ...).

    Why private: torch only prints these (``TORCH_LOGS``); there is no public API to read them. Without them the
    graph-break and cache-hit counts read 0, after one warning.

    Example::

        >>> isinstance(dynamo_counters()["graph_break"], Counter)
        True
    """
    return _optional("torch._dynamo.utils.counters", defaultdict(Counter))


def cache_entries(code: CodeType) -> int:
    """How many compiled entries dynamo keeps on ``code`` (0 where this torch cannot say).

    Why private: only ``torch._dynamo.eval_frame._debug_get_cache_entry_list`` lists them. Entries stay for the
    process's life, and dynamo's recompile limit counts them: HF's forwards share one decorator's code, so every
    model class compiled before in a process (a sweep over models in a notebook) takes one from the limit.

    Example::

        >>> cache_entries((lambda: None).__code__)
        0
    """
    return len(_optional("torch._dynamo.eval_frame._debug_get_cache_entry_list", lambda code: [])(code))


def compilation_metrics() -> list[Any]:
    """Dynamo's record of each compile so far (each with a ``recompile_reason``), oldest first.

    Why private: the reasons are otherwise only printed (``TORCH_LOGS=recompiles``). Without it the reasons read
    "unknown", after one warning.

    Example::

        >>> isinstance(compilation_metrics(), list)
        True
    """
    return list(_optional("torch._dynamo.utils.get_compilation_metrics", list)())


def cap_cudagraph_sizes(sizes: Container[Any]) -> Callable[[], None]:
    """Let torch's cudagraph trees record graphs only for the input sizes in ``sizes``, unless the user set sizes
    of their own; return the function that puts the setting back.

    Inductor compiles a dynamic shape once and records one CUDA graph per size it meets; a size it may not record
    runs the same compiled code without a graph. Why private: the setting is inductor's
    ``config.triton.cudagraph_capture_sizes``, read at every call of a compiled graph (``size in sizes``; the key
    is the graph's integer inputs, the forward's and backward's apart). Without it every size records, after one
    warning.

    Example::

        >>> restore = cap_cudagraph_sizes((8, 16))
        >>> restore()
    """
    if _optional("torch._inductor.config.triton.cudagraph_capture_sizes", ...) is not None:  # ...: torch lacks it
        return lambda: None  # torch lacks the setting, or the user's own sizes stand
    torch._inductor.config.triton.cudagraph_capture_sizes = sizes
    return lambda: setattr(torch._inductor.config.triton, "cudagraph_capture_sizes", None)


def cudagraph_tree_stats(device_index: int) -> tuple[int, int]:
    """The CUDA graphs torch's cudagraph trees hold on CUDA device ``device_index``, and the times inductor skipped
    cudagraphs: both so far in this process.

    Inductor's CUDA graphs (``mode="reduce-overhead"``) are recorded per compiled piece, each recording a node of the
    device's trees, kept until the trees are shut down; a skipped piece runs without graphs, and inductor warns why
    ("skipping cudagraphs due to ..."). Neither counts replays. Why private: the trees exist only in
    ``torch._inductor.cudagraph_trees`` (its manager's ``roots``, each node's ``children``), the skips only in
    ``counters["inductor"]["cudagraph_skips"]``. No trees (none made yet, or shut down) hold 0 graphs. Without the
    manager's lookup, or with trees laid out otherwise, the graphs read 0 after one warning.

    Example::

        >>> graphs, skips = cudagraph_tree_stats(0)
        >>> graphs >= 0 and skips >= 0
        True
    """
    get_manager = _optional("torch._inductor.cudagraph_trees.get_manager", lambda *args, **kwargs: None)
    manager = get_manager(device_index, create_if_none_exists=False)
    try:
        graphs = _tree_nodes(manager.roots) if manager is not None else 0
    except AttributeError as err:
        message = f"FuseCallback: torch's cudagraph trees are laid out otherwise ({err}); their graphs are not counted."
        _warn_once("cudagraph trees", message)
        graphs = 0
    return graphs, dynamo_counters()["inductor"]["cudagraph_skips"]


def cudagraph_trees_module() -> str | None:
    """The name of torch's cudagraph trees' module, whose frames in a traceback tell an error of theirs from one of
    the compiled code (:func:`~lightning_fuse.replay.raised_in_cudagraph_trees`); ``None`` where torch moved them.

    Why private: the trees raise plain errors (``RuntimeError``, ``AssertionError``); only their module,
    ``torch._inductor.cudagraph_trees`` (its ``get_manager``'s), tells where one came from. Without it (one warning)
    no error is told apart.

    Example::

        >>> cudagraph_trees_module()
        'torch._inductor.cudagraph_trees'
    """
    return getattr(_optional("torch._inductor.cudagraph_trees.get_manager", None), "__module__", None)


def _tree_nodes(roots: Mapping[Any, list[Any]] | None) -> int:
    """The nodes of the trees under ``roots`` (lists of nodes, each with ``children`` alike); ``None`` (trees shut
    down) has none."""
    return sum(1 + _tree_nodes(node.children) for group in (roots or {}).values() for node in group)


def maybe_mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Ask dynamo to compile ``dim`` of ``tensor`` as a symbol (it may still specialise).

    Why private: ``torch._dynamo.maybe_mark_dynamic`` is the documented way but lives under ``torch._dynamo``.
    Without it the dim is not marked (one warning): dynamo recompiles once for a new size, then goes dynamic.

    Example::

        >>> maybe_mark_dynamic(torch.zeros(4, 2), 0)
    """
    _optional("torch._dynamo.maybe_mark_dynamic", lambda tensor, dim: None)(tensor, dim)


# ---------------------------------------------------------------------------------------------------------------
# Checks made before fit, so that a typo fails at construction rather than at the first compile.


def is_backend(name: str) -> bool:
    """Whether torch.compile resolves ``name`` (registered and entry-point backends, as torch.compile does).

    Why private: :func:`torch.compiler.list_backends` omits backends that only resolve on lookup (entry points
    loaded lazily); ``torch._dynamo.lookup_backend`` is what torch.compile itself calls. Without it the name is
    taken as valid (one warning) and torch.compile checks it at the first compile.

    Example::

        >>> is_backend("inductor"), is_backend("inductr")
        (True, False)
    """
    lookup = _optional("torch._dynamo.lookup_backend", None)
    invalid = _optional("torch._dynamo.exc.InvalidBackend", None)
    if lookup is not None and invalid is not None:
        try:
            lookup(name)
        except invalid:
            return False
    return True


def inductor_options() -> dict[str, Any] | None:
    """Inductor's option names with their current values; ``None`` (one warning) if torch moved them.

    Why private: the list and types of inductor options live only in ``torch._inductor.config``
    (``torch._inductor.list_options()`` is private too).

    Example::

        >>> "max_autotune" in inductor_options()
        True
    """
    config = _optional("torch._inductor.config", None)  # warns if it is gone
    if config is None:
        return None
    if not callable(getattr(config, "get_config_copy", None)):
        message = "FuseCallback: torch._inductor.config has no get_config_copy; `options` is not checked."
        _warn_once("get_config_copy", message)
        return None
    return config.get_config_copy()


def mode_options(mode: str) -> dict[str, Any] | None:
    """The inductor options that ``torch.compile``'s ``mode`` stands for; ``None`` (one warning) if torch moved them.

    Why private: the table lives only in ``torch._inductor.list_mode_options``. torch.compile refuses a mode and
    options together, so a plan with a mode passes the mode as these options beside the user's.

    Example::

        >>> mode_options("reduce-overhead")
        {'triton.cudagraphs': True}
    """
    return _optional("torch._inductor.list_mode_options", lambda mode: None)(mode)


def inductor_option_type(name: str) -> Any:
    """The declared type of inductor option ``name`` (may be a generic such as ``list[str]``); ``None`` if unknown.

    Example::

        >>> inductor_option_type("max_autotune")
        <class 'bool'>
    """
    get_type = getattr(_get("torch._inductor.config"), "get_type", None)
    if not callable(get_type):
        _warn_once("inductor types", "FuseCallback: cannot read inductor option types; their values are not checked.")
        return None
    return get_type(name)


# ---------------------------------------------------------------------------------------------------------------
# Small helpers for compiler.py, graphs.py and gpu.py.


def is_compile_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns: a wrapper holding the original network.

    Why private: torch has no public class for it; ``OptimizedModule`` is what ``torch.compile`` returns for a module.
    Without it, the wrapper is recognised by the original it holds (``_orig_mod``).

    Example::

        >>> net = torch.nn.Linear(2, 2)
        >>> is_compile_wrapper(torch.compile(net, backend="eager")), is_compile_wrapper(net)
        (True, False)
    """
    wrapper = _optional("torch._dynamo.eval_frame.OptimizedModule", None)
    return isinstance(module, wrapper) if wrapper is not None else hasattr(module, "_orig_mod")


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor (its autograd history belongs to its base).

    Why private: torch has no public view test; ``Tensor._is_view`` is what autograd itself checks.

    Example::

        >>> base = torch.zeros(4)
        >>> is_view(base), is_view(base[:2])
        (False, True)
    """
    return _get("torch.Tensor._is_view")(tensor)


def count_flops_as_a_total(counter: Any, tracker: Any, wrap: Callable[[Any, Any], Any]) -> None:
    """Make a ``torch.utils.flop_counter.FlopCounterMode`` count one total: ``tracker`` stands in for its module
    tracker, and ``wrap(op, formula)`` for each of its FLOP formulas (on its own copy of torch's registry).

    Why private: both are undocumented attributes of the counter (``mod_tracker``, ``flop_registry``), and torch
    offers no other way to count without its module tracker, whose hooks break ``torch.autograd.grad`` over a
    module's leaf input (pytorch#131753). Without them the counter is left as torch made it (one warning).

    Example::

        >>> from torch.utils.flop_counter import FlopCounterMode
        >>> counter = FlopCounterMode(display=False)
        >>> count_flops_as_a_total(counter, None, lambda op, formula: formula)
        >>> counter.mod_tracker is None
        True
    """
    if not all(hasattr(counter, name) for name in ("mod_tracker", "flop_registry")):
        _warn_once("flop counter", "FuseCallback: torch's FlopCounterMode changed; MFU counts with its module tracker.")
        return
    counter.flop_registry = {op: wrap(op, formula) for op, formula in counter.flop_registry.items()}
    counter.mod_tracker = tracker


def nvml_device_index(cuda_index: int) -> int:
    """NVML's index of CUDA device ``cuda_index`` (``CUDA_VISIBLE_DEVICES`` renumbers devices for torch only).

    Why private: ``torch.cuda._get_nvml_device_index`` is what ``torch.cuda.utilization`` uses; no public mapping.
    Without it the CUDA index is used (one warning), right unless ``CUDA_VISIBLE_DEVICES`` reorders devices.

    Example::

        >>> nvml_device_index  # doctest: +ELLIPSIS
        <function nvml_device_index at ...>
    """
    mapping = _optional("torch.cuda._get_nvml_device_index", None)
    return cuda_index if mapping is None else mapping(cuda_index)


def fsdp_wrapped_module(module: nn.Module) -> nn.Module:
    """The module a ``FullyShardedDataParallel`` (FSDP1) wrapper holds; any other ``module`` unchanged.

    Compiling what FSDP wraps keeps its all-gathers and reshards outside the compiled region. Why private: FSDP's
    public ``.module`` skips an activation-checkpoint wrapper inside it, which must stay inside the region; only
    ``_fsdp_wrapped_module`` is the direct child.

    Raises:
        TorchAPIChanged: If an FSDP wrapper no longer keeps its module in ``_fsdp_wrapped_module``.

    Example::

        >>> lin = torch.nn.Linear(2, 2)
        >>> fsdp_wrapped_module(lin) is lin
        True
    """
    if not torch.distributed.is_available():
        return module
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(module, FullyShardedDataParallel):
        return module
    inner = getattr(module, "_fsdp_wrapped_module", None)
    if not isinstance(inner, nn.Module):
        raise TorchAPIChanged("FullyShardedDataParallel._fsdp_wrapped_module",
                              "compiling the module inside an FSDP wrapper", "keeps the wrapped module elsewhere")
    return inner


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """Flatten nested lists, tuples, dicts and dataclasses into leaves and a spec, as torch does for its ops.

    Why private: torch 2.11-2.15 have no public pytree module; ``torch.utils.pytree`` is preferred when it exists.

    Example::

        >>> tree_flatten({"a": [1, 2], "b": 3})[0]
        [1, 2, 3]
    """
    return _pytree("tree_flatten")(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """The inverse of :func:`tree_flatten`.

    Example::

        >>> leaves, spec = tree_flatten(({"a": 1}, None))
        >>> tree_unflatten([5, None], spec)
        ({'a': 5}, None)
    """
    return _pytree("tree_unflatten")(leaves, spec)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree``, in :func:`tree_flatten`'s order.

    Example::

        >>> tree_leaves([1, (2, {"c": 3})])
        [1, 2, 3]
    """
    return _pytree("tree_leaves")(tree)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every leaf.

    Example::

        >>> tree_map(lambda x: x * 2, {"a": [1, 2]})
        {'a': [2, 4]}
    """
    return _pytree("tree_map")(fn, tree)


@functools.cache
def _pytree(name: str) -> Callable[..., Any]:
    """``torch.utils.pytree.<name>`` where torch has the public module, else the private one (same functions)."""
    try:
        return getattr(importlib.import_module("torch.utils.pytree"), name)
    except (ImportError, AttributeError):
        return _get(f"torch.utils._pytree.{name}")  # TorchAPIChanged if torch moved it


# ---------------------------------------------------------------------- the optimizer's step (optimizer_graph.py)
# Lightning calls the torch optimizer's ``step(closure=...)`` from its precision plugin, and offers no public point
# between the closure and the update; torch's LR schedulers wrap ``step`` on the instance the same way, marking it
# ``_wrapped_by_lr_sched`` and setting ``optimizer._opt_called`` when it runs (the check behind their "called before
# optimizer.step()" warning). tests/test_optimizer_graph.py fails where either changes.


def replace_optimizer_step(optimizer: torch.optim.Optimizer, step: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``step`` the optimizer's ``step`` (on the instance, a method bound to it) and return the one it
    replaces, which :func:`restore_method` puts back. An LR scheduler's mark on the replaced one is kept; a scheduler
    made later wraps the replacement as it wraps any bound ``step`` (Lightning's StochasticWeightAveraging makes one
    mid-fit: a plain function there raised "'function' object has no attribute '__func__'").

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
        >>> before = replace_optimizer_step(opt, lambda closure=None: "mine")
        >>> opt.step(), restore_method(opt, "step", before), opt.step()
        ('mine', None, None)
    """
    previous = optimizer.step

    def replacement(_optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return step(*args, **kwargs)

    if getattr(previous, "_wrapped_by_lr_sched", False):
        replacement._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = MethodType(replacement, optimizer)  # type: ignore[method-assign]
    return previous


def restore_method(owner: Any, name: str, previous: Callable[..., Any]) -> None:
    """Undo a method replaced on an instance (:func:`replace_optimizer_step`, a precision plugin's
    ``clip_gradients``): the class's method again where ``previous`` was it, else ``previous``."""
    if previous == getattr(type(owner), name).__get__(owner):  # the class's own method, bound to ``owner``
        vars(owner).pop(name, None)
    else:
        setattr(owner, name, previous)


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell the optimizer's LR scheduler that ``step`` ran (as its wrapper of ``step`` does)."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def silence_uncaptured_warning(optimizer: torch.optim.Optimizer) -> None:
    """Spare the user torch's warning that a ``capturable`` optimizer steps outside a capture: FuseCallback's eager
    reference steps do on purpose."""
    optimizer._warned_capturable_if_run_uncaptured = True  # type: ignore[attr-defined]


def has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any step pre- or post-hook would run around ``optimizer``'s step, its own or global ones (where
    torch no longer says, assume so).

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
        >>> has_step_hooks(opt), has_step_hooks(opt.register_step_post_hook(lambda *a: None) and opt)
        (False, True)
    """
    own = [getattr(optimizer, f"_optimizer_step_{when}_hooks", None) for when in ("pre", "post")]
    shared = [_optional(f"torch.optim.optimizer._global_optimizer_{when}_hooks", None) for when in ("pre", "post")]
    return any(hooks is None or len(hooks) for hooks in own + shared)


def copy_tensors(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source into its destination, one launch per chunk of tensors (``torch._foreach_copy_``: torch has
    no public multi-tensor copy).

    Example::

        >>> dst = [torch.zeros(2)]; copy_tensors(dst, [torch.ones(2)]); dst[0].tolist()
        [1.0, 1.0]
    """
    _get("torch._foreach_copy_")(destinations, sources)


def add_tensors(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Add each source to its destination in place, as :func:`copy_tensors` copies (``torch._foreach_add_``).

    Example::

        >>> dst = [torch.ones(2)]; add_tensors(dst, [torch.ones(2)]); dst[0].tolist()
        [2.0, 2.0]
    """
    _get("torch._foreach_add_")(destinations, sources)


def has_gradient_hooks(param: torch.Tensor) -> bool:
    """Whether a hook runs on ``param``'s gradient as autograd accumulates it (``register_hook``,
    ``register_post_accumulate_grad_hook``); where torch no longer says, assume so.

    Why private: torch has no public way to list a tensor's hooks.

    Example::

        >>> p = torch.nn.Parameter(torch.ones(1))
        >>> has_gradient_hooks(p), has_gradient_hooks(p.register_post_accumulate_grad_hook(print) and p)
        (False, True)
    """
    return any(getattr(param, name, True) for name in ("_backward_hooks", "_post_accumulate_grad_hooks"))


def clear_cublas_workspaces() -> None:
    """Drop the cuBLAS workspaces torch keeps per stream, so that the next matrix product allocates its own.

    A CUDA graph's matrix products write the workspace of the stream it was captured on. Allocated before the
    capture, that workspace is ordinary memory: torch's cudagraph trees drop every workspace around their
    recordings (``reduce-overhead``), the next ``empty_cache`` returns it to the driver, and the graph's next replay
    faults ("unspecified launch failure"). Dropped just before a capture, the workspace is allocated in the graph's
    own memory pool, which lives as long as the graph; dropped again after it, no later work shares that memory.
    cudagraph trees do the same (``torch._inductor.cudagraph_trees.clear_cublass_cache``).

    Why private: torch has no public call that drops them.

    Example::

        >>> clear_cublas_workspaces()  # on a CUDA build of torch; nothing to drop before a matrix product ran
    """
    _get("torch._C._cuda_clearCublasWorkspaces")()


def memory_of(tensor: torch.Tensor) -> Any:
    """A weak reference to ``tensor``'s memory, for :func:`storage_users`: it keeps nothing alive.

    Why private: torch's cudagraph trees watch their outputs' memory through
    ``torch.multiprocessing.reductions.StorageWeakRef``, which torch does not document.

    Example::

        >>> base = torch.zeros(4)
        >>> memory = memory_of(base)
        >>> alone = storage_users(memory)
        >>> half = base[:2]; storage_users(memory) - alone  # a view shares it
        1
        >>> del base, half; storage_users(memory)
        0
    """
    return _get("torch.multiprocessing.reductions.StorageWeakRef")(tensor.untyped_storage())


def storage_users(memory: Any) -> int:
    """How many tensors share the memory that ``memory`` (:func:`memory_of`) refers to (and torch's Python handle on
    it, once made): ``0`` once it is freed.

    Why private: torch has no public count of a storage's users; its cudagraph trees read
    ``torch._C._storage_Use_Count`` to tell whether a graph's output is still held, and so does
    :mod:`~lightning_fuse.held_outputs`.
    """
    return _get("torch._C._storage_Use_Count")(memory.cdata)
