"""Tests for lightning_fuse.compat: each guard passes on this torch, and fails loudly when torch lacks its attribute.

"Loudly" means :class:`TorchAPIChanged` naming the attribute for what training depends on, and exactly one warning
(then a harmless fallback) for what only reports. Attributes are taken away with ``monkeypatch``.
"""

from __future__ import annotations

import warnings
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from packaging.version import Version
from torch import nn

from lightning_fuse import compat
from lightning_fuse.compat import TorchAPIChanged


@pytest.fixture(autouse=True)
def fresh_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no warning given yet and the compiled-slot probe not yet run."""
    monkeypatch.setattr(compat, "_warned", set())
    compat._check_compiled_call_impl.cache_clear()
    compat._pytree.cache_clear()


def test_this_torch_is_tested_and_every_private_api_is_there() -> None:
    assert compat.torch_is_tested(), f"torch {torch.__version__} is outside {compat.TESTED_TORCH}: update pyproject"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even an optional one is missing
        compat.check_private_apis()


def test_the_tested_range_is_the_one_pyproject_allows() -> None:
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    torch_pin = next(dep for dep in project["dependencies"] if dep.startswith("torch>="))
    assert compat.TESTED_TORCH == compat.SpecifierSet(torch_pin.removeprefix("torch"))


def test_compiled_call_impl_installs_and_undoes_a_callable() -> None:
    lin = nn.Linear(2, 2)
    compat.set_compiled_call_impl(lin, lambda x: "installed")
    assert lin(torch.zeros(2)) == "installed" and compat.compiled_call_impl(lin) is not None
    assert compat.call_uncompiled(lin, torch.zeros(2)).shape == (2,)  # the plain code, slot bypassed
    compat.set_compiled_call_impl(lin, None)
    assert compat.compiled_call_impl(lin) is None and lin(torch.zeros(2)).shape == (2,)
    # as built: torch 2.11's dynamo guards a network compiled whole on its blocks' __dict__ not holding the slot
    assert "_compiled_call_impl" not in vars(lin)


def test_compiled_call_impl_raises_when_the_slot_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(nn.Module, "_compiled_call_impl")
    for call in (lambda: compat.compiled_call_impl(nn.Linear(2, 2)), compat.check_private_apis):
        with pytest.raises(TorchAPIChanged, match=r"torch\.nn\.Module\._compiled_call_impl .*pip install 'torch"):
            call()


def test_compiled_call_impl_raises_when_module_calls_stop_using_the_slot(monkeypatch) -> None:
    monkeypatch.setattr(nn.Module, "__call__", nn.Module._call_impl)  # a torch that ignores the slot
    with pytest.raises(TorchAPIChanged, match="no longer calls what is installed there"):
        compat.set_compiled_call_impl(nn.Linear(2, 2), print)


def test_active_stance_reads_set_stance_and_raises_when_torch_moves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compat.active_stance() == "default"
    with torch.compiler.set_stance("force_eager"):
        assert compat.active_stance() == "force_eager"
    monkeypatch.delattr(torch._dynamo.eval_frame, "_stance")
    with pytest.raises(TorchAPIChanged, match=r"_stance \(reading the active torch.compiler.set_stance\)"):
        compat.active_stance()


def test_recompile_limit_round_trips_and_raises_when_changed() -> None:
    before = compat.dynamo_recompile_limit()
    compat.set_dynamo_recompile_limit(before + 3)
    try:
        assert torch._dynamo.config.recompile_limit == before + 3
    finally:
        compat.set_dynamo_recompile_limit(before)
    torch._dynamo.config.recompile_limit = "eight"  # a torch that changed its meaning (monkeypatch would delete it)
    try:
        with pytest.raises(TorchAPIChanged, match="holds 'eight' there, not an int"):
            compat.dynamo_recompile_limit()
    finally:
        torch._dynamo.config.recompile_limit = before


def test_compile_callbacks_fire_and_raise_when_the_handler_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    start, end = (lambda *_: events.append("start")), (lambda *_: events.append("end"))
    compat.register_compile_callbacks(start, end)
    try:
        torch.compile(lambda x: x + 1, backend="eager")(torch.zeros(2))
    finally:
        compat.remove_compile_callbacks(start, end)
    assert events[:2] == ["start", "end"]
    monkeypatch.delattr(torch._dynamo.callback, "callback_handler")
    with pytest.raises(TorchAPIChanged, match="callback_handler"):
        compat.register_compile_callbacks(start, end)


def _remove_inductor_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.delattr(torch._inductor, "config")
    monkeypatch.setitem(sys.modules, "torch._inductor.config", None)  # importing it again fails too


@pytest.mark.parametrize(
    ("owner", "attribute", "call", "fallback"),
    [
        ("torch._dynamo.utils", "counters", lambda: compat.dynamo_counters()["graph_break"], Counter()),
        ("torch._dynamo.utils", "get_compilation_metrics", compat.compilation_metrics, []),
        ("torch._dynamo", "maybe_mark_dynamic", lambda: compat.maybe_mark_dynamic(torch.zeros(4, 2), 0), None),
        ("torch._dynamo", "lookup_backend", lambda: compat.is_backend("no-such-backend"), True),
        ("torch._inductor", "config", compat.inductor_options, None),
        ("torch._inductor", "list_mode_options", lambda: compat.mode_options("reduce-overhead"), None),
        ("torch.cuda", "_get_nvml_device_index", lambda: compat.nvml_device_index(3), 3),
        ("torch._inductor.cudagraph_trees", "get_manager", lambda: compat.cudagraph_tree_stats(0)[0], 0),
    ],
)
def test_reporting_apis_degrade_with_exactly_one_warning(monkeypatch, owner, attribute, call, fallback) -> None:
    import importlib

    if attribute == "config":
        _remove_inductor_config(monkeypatch)
    else:
        monkeypatch.delattr(importlib.import_module(owner), attribute)
    with pytest.warns(UserWarning, match=attribute) as record:
        assert call() == fallback
        assert call() == fallback  # the second call is quiet
    assert len(record) == 1


def test_reporting_apis_work_on_this_torch() -> None:
    graph_breaks_before = sum(compat.dynamo_counters()["graph_break"].values())

    def breaks(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x + 1

    torch.compile(breaks, backend="eager")(torch.zeros(2))
    assert sum(compat.dynamo_counters()["graph_break"].values()) > graph_breaks_before
    assert compat.compilation_metrics(), "dynamo recorded the compiles"
    tensor = torch.zeros(4, 2)
    compat.maybe_mark_dynamic(tensor, 0)
    assert compat.is_backend("inductor") and not compat.is_backend("inductr")
    assert compat.inductor_option_type("max_autotune") is bool
    assert compat.nvml_device_index(0) >= 0
    assert compat.cudagraph_tree_stats(0)[0] == 0  # no CUDA graphs on this machine


def test_a_changed_flop_counter_is_left_as_torch_made_it_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "_warned", set())
    counter = SimpleNamespace(flop_registry={"mm": "formula"})  # a torch whose counter has no mod_tracker
    with pytest.warns(UserWarning, match="FlopCounterMode changed"):
        compat.count_flops_as_a_total(counter, "tracker", lambda op, formula: "wrapped")
    assert counter.flop_registry == {"mm": "formula"} and not hasattr(counter, "mod_tracker")
    counter.mod_tracker = None
    compat.count_flops_as_a_total(counter, "tracker", lambda op, formula: f"wrapped {formula}")
    assert counter.flop_registry == {"mm": "wrapped formula"} and counter.mod_tracker == "tracker"


def test_cudagraph_tree_stats_counts_every_node_of_the_trees_and_the_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.cudagraph_trees as trees

    def node(*children: SimpleNamespace) -> SimpleNamespace:  # a recorded graph, its children by function id
        return SimpleNamespace(children={0: list(children[:1]), 1: list(children[1:])})

    def get_manager(index: int, create_if_none_exists: bool = True) -> SimpleNamespace | None:
        assert not create_if_none_exists, "counting never makes a manager (that synchronises and captures on the GPU)"
        return {3: manager}.get(index)

    manager = SimpleNamespace(roots={0: [node(node(), node(node()))], 1: [node()]})
    monkeypatch.setattr(trees, "get_manager", get_manager)
    monkeypatch.setitem(compat.dynamo_counters()["inductor"], "cudagraph_skips", 2)
    assert compat.cudagraph_tree_stats(3) == (5, 2)
    assert compat.cudagraph_tree_stats(0) == (0, 2)  # no trees on that device
    manager.roots = None  # what shutdown leaves
    assert compat.cudagraph_tree_stats(3) == (0, 2)
    del manager.roots  # a torch that keeps its trees elsewhere
    with pytest.warns(UserWarning, match="cudagraph trees are laid out otherwise") as record:
        assert compat.cudagraph_tree_stats(3) == (0, 2)
        assert compat.cudagraph_tree_stats(3) == (0, 2)  # the second call is quiet
    assert len(record) == 1


def test_is_view_and_tree_flatten(monkeypatch: pytest.MonkeyPatch) -> None:
    base = torch.zeros(4)
    assert not compat.is_view(base) and compat.is_view(base[:2])
    leaves, spec = compat.tree_flatten({"a": [1, 2], "b": (3,)})
    assert leaves == [1, 2, 3] and compat.tree_unflatten([4, 5, 6], spec) == {"a": [4, 5], "b": (6,)}
    assert compat.tree_leaves([1, (2,)]) == [1, 2] and compat.tree_map(str, [1]) == ["1"]
    monkeypatch.setattr(torch, "Tensor", type("Tensor", (), {}))  # a Tensor without it (a C type can't lose one)
    with pytest.raises(TorchAPIChanged, match=r"torch\.Tensor\._is_view"):
        compat.is_view(base)


def test_tree_flatten_prefers_a_public_pytree_and_raises_without_either(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    public = types.ModuleType("torch.utils.pytree")
    public.tree_flatten = lambda tree: (["public"], None)
    monkeypatch.setitem(sys.modules, "torch.utils.pytree", public)
    assert compat.tree_flatten([1])[0] == ["public"]
    compat._pytree.cache_clear()
    monkeypatch.setitem(sys.modules, "torch.utils.pytree", None)  # no public module, as in torch 2.11-2.15
    for name in ("tree_flatten", "tree_leaves", "tree_map"):
        monkeypatch.delattr(torch.utils._pytree, name)
    for call in (lambda: compat.tree_flatten([1]), lambda: compat.tree_leaves([1]), lambda: compat.tree_map(str, [1])):
        with pytest.raises(TorchAPIChanged, match=r"torch\.utils\._pytree\.tree_"):
            call()
    compat._pytree.cache_clear()


def test_fsdp_wrapped_module_unwraps_fsdp_only_and_raises_when_fsdp_moved_it(monkeypatch) -> None:
    class FakeFSDP(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self._fsdp_wrapped_module = inner

    inner = nn.Linear(2, 2)
    assert compat.fsdp_wrapped_module(inner) is inner
    from torch.distributed import fsdp

    monkeypatch.setattr(fsdp, "FullyShardedDataParallel", FakeFSDP)  # what the wrapper's class is looked up as
    assert compat.fsdp_wrapped_module(FakeFSDP(inner)) is inner
    moved = FakeFSDP(inner)
    del moved._fsdp_wrapped_module
    with pytest.raises(TorchAPIChanged, match="_fsdp_wrapped_module"):
        compat.fsdp_wrapped_module(moved)


def test_a_torch_outside_the_tested_range_warns_once_but_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "TORCH_VERSION", Version("2.16.0"))
    with pytest.warns(UserWarning, match=r"outside the versions its private torch APIs were checked") as record:
        assert compat.active_stance() == "default"
        compat.dynamo_recompile_limit()
    assert len(record) == 1
    monkeypatch.delattr(torch._dynamo.eval_frame, "_stance")
    with pytest.raises(TorchAPIChanged, match="which lightning_fuse was never tested with"):
        compat.active_stance()


def test_the_package_uses_private_torch_apis_only_through_compat() -> None:
    """Every private torch name in lightning_fuse/ is in compat.py, or in a module that has yet to move to it."""
    import re
    from pathlib import Path

    package = Path(compat.__file__).parent
    private = re.compile(r"torch\._[a-z]|\._compiled_call_impl\b|torch\.utils\._pytree|\._call_impl\(|\._is_view\(")
    for path in sorted(package.glob("*.py")):
        if path.name == "compat.py":
            continue
        code = [line.split("#")[0] for line in path.read_text().splitlines()]  # comments may name them
        uses = [line for line in code if private.search(line) and '"' not in line and "`" not in line]
        assert not uses, f"{path.name} uses a private torch API outside lightning_fuse.compat: {uses}"
