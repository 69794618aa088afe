from contextlib import contextmanager

import pytest
import torch
from torch import nn

from lightning_fuse import compat, replay
from lightning_fuse.compiler import CompiledRegion, CompileOptions, RegionPolicy, compilable_call, uncompile_regions
from lightning_fuse.regions import Region, resolve_regions
from lightning_fuse.shapes import CompileTracker
from tests.toy import FunctionalDropoutBlock, Net


def failing_backend(gm, example_inputs):
    raise RuntimeError("backend exploded")


def wrong_backend(gm, example_inputs):
    """Compiles to code that is silently wrong: every output is off by one."""

    def run(*args):
        return [out + 1 if isinstance(out, torch.Tensor) else out for out in gm(*args)]

    return run


def flipping_backend(elements):
    """Compiles to code whose every output has its first ``elements`` elements changed wholesale, as when
    low-precision rounding tips a router's argmax the other way for a few rows."""

    def backend(gm, example_inputs):
        def run(*args):
            outs = [out.clone() if isinstance(out, torch.Tensor) else out for out in gm(*args)]
            for out in outs:
                if isinstance(out, torch.Tensor):
                    out.view(-1)[:elements] += 10.0
            return outs

        return run

    return backend


def compiled(net, backend="eager", mode=None, **policy):
    tracker = CompileTracker()
    tracker.install()
    runners = [CompiledRegion(region, CompileOptions(mode=mode, backend=backend), tracker, RegionPolicy(**policy))
               for region in resolve_regions(net, "auto")]  # fmt: skip
    for runner in runners:
        runner.install()
    return runners, tracker


@pytest.mark.parametrize(("elements", "kept"), [(8, True), (80, False)], ids=["0.025%-kept", "0.25%-falls-back"])
def test_a_compiled_output_off_in_a_few_elements_only_is_kept(elements, kept, recwarn):
    net = Net().eval()
    x = torch.randn(2000, 8)  # 32,000 elements a block's output: 0.1% of them is 32
    expected = net(x)
    runners, tracker = compiled(net, backend=flipping_backend(elements))
    out = net(x)
    assert [r.is_compiled for r in runners] == [kept] * 3
    assert any("differs from eager on the first batch" in str(w.message) for w in recwarn) is not kept
    if kept:  # the compiled output, its few changed elements included
        assert not torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected)
    tracker.remove()


def test_in_place_compile_keeps_state_dict_keys_class_and_hooks():
    net = Net()
    keys = list(net.state_dict())
    calls = []
    net.blocks[0].register_forward_hook(lambda *a: calls.append(1))
    runners, tracker = compiled(net)
    assert list(net.state_dict()) == keys
    assert type(net.blocks[0]).__name__ == "Block"
    net(torch.randn(3, 8))
    assert calls == [1]
    assert all(r.is_compiled for r in runners)
    assert tracker.stats("blocks.0").compiles >= 1 and tracker.total_recompiles == 0
    uncompile_regions(runners)
    tracker.remove()
    assert all(b._compiled_call_impl is None for b in net.blocks)


def test_compiled_output_matches_eager():
    net = Net().eval()
    x = torch.randn(5, 8)
    expected = net(x)
    runners, tracker = compiled(net, backend="aot_eager")
    torch.testing.assert_close(net(x), expected)
    assert all(r.is_compiled for r in runners) and tracker.stats("blocks.0").compiles >= 1  # the compiled code ran
    tracker.remove()


@pytest.mark.parametrize(
    ("backend", "warning"),
    [
        (failing_backend, r"region 'blocks.0' falls back to eager.*backend exploded"),
        (wrong_backend, "differs from eager on the first batch"),  # caught by verifying the first output
    ],
    ids=["backend-raises", "output-wrong"],
)
def test_a_region_whose_compiled_code_fails_falls_back_to_eager_with_one_warning(backend, warning):
    net = Net()
    x = torch.randn(4, 8)
    expected = net(x)
    runners, tracker = compiled(net, backend=backend)
    with pytest.warns(UserWarning, match=warning) as record:
        out = net(x)
    torch.testing.assert_close(out, expected)
    assert [r.fallback_reason is not None for r in runners] == [True, True, True]
    assert not any(r.is_compiled for r in runners)
    assert len([w for w in record if "blocks.0" in str(w.message)]) == 1
    tracker.remove()


@pytest.mark.parametrize("mode", ["reduce-overhead", None])
def test_a_region_under_torchs_graphs_that_fails_undoes_the_capture_before_it_runs_eagerly(monkeypatch, mode):
    """torch's cudagraph trees (``reduce-overhead``) may fail a capture inside the compiled call, leaving its side
    stream current and the CUDA generators counting it as under way: the eager rerun's dropout would raise
    (replay.capture_failure_undone). A region compiled without the trees captures nothing, so its calls do not pay
    for looking the stream up."""
    order = []

    @contextmanager
    def undone():
        try:
            yield
        except Exception:
            order.append("undone")
            raise

    monkeypatch.setattr(replay, "capture_failure_undone", undone)
    net = Net()
    net.blocks[0].register_forward_pre_hook(lambda *_: order.append("call"))  # the compiled call's, then eager's
    runners, tracker = compiled(net, backend=failing_backend, mode=mode)
    with pytest.warns(UserWarning, match="falls back to eager"):
        net(torch.randn(4, 8))
    if mode:
        assert order[:3] == ["call", "undone", "call"] and order.count("undone") == len(runners)
    else:
        assert order[:2] == ["call", "call"] and "undone" not in order
    tracker.remove()


def test_a_first_output_that_cannot_be_checked_costs_the_region_never_the_run(recwarn):
    """The check runs a block's forward alone, after its hooks ran once; where only the hooks make the call runnable
    (FSDP2's mixed-precision cast, here a hook that casts to float64), the check's error drops the region: the
    compiled output stands, and every later call runs eagerly."""
    net = Net().eval()
    net.blocks[1].double()  # in float64 between its hooks
    net.blocks[1].register_forward_pre_hook(lambda module, args: (args[0].double(),))
    net.blocks[1].register_forward_hook(lambda module, args, out: out.float())
    runners, tracker = compiled(net)
    x = torch.randn(4, 8)
    with torch.compiler.set_stance("force_eager"):
        expected = net(x)
    torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)  # the first call: its compiled output
    assert [r.is_compiled for r in runners] == [True, False, True]
    assert "could not be checked against eager" in runners[1].fallback_reason
    torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)  # and on, eagerly
    assert len([w for w in recwarn if "'blocks.1' falls back" in str(w.message)]) == 1
    tracker.remove()


@pytest.mark.parametrize("backend", ["eager", wrong_backend], ids=["right", "wrong"])
def test_a_region_whose_dropout_is_a_function_is_checked_in_eval_not_dropped_for_its_masks(backend, recwarn):
    """A compiled training call of such a region draws other masks than any eager call: its output is not held to
    eager's (the region stays compiled), and the check waits for its first eval call, where a wrong compile is
    still caught."""
    net = Net(block=FunctionalDropoutBlock)
    runners, tracker = compiled(net, backend=backend)
    net(torch.randn(4, 8))
    assert all(r.is_compiled for r in runners), [r.fallback_reason for r in runners]
    net.eval()
    x = torch.randn(4, 8)
    with torch.compiler.set_stance("force_eager"):
        expected = net(x)
    torch.testing.assert_close(net(x), expected)
    right = backend == "eager"
    assert [r.is_compiled for r in runners] == [right] * 3
    assert any("differs from eager on the first batch" in str(w.message) for w in recwarn) is not right
    tracker.remove()


def test_without_verify_a_wrong_backend_goes_unnoticed():
    net = Net()
    runners, tracker = compiled(net, backend=wrong_backend, verify=False)
    x = torch.randn(4, 8)
    with torch.compiler.set_stance("force_eager"):
        expected = net(x)
    assert not torch.allclose(net(x), expected)
    tracker.remove()


def test_a_call_forced_eager_before_the_first_compile_makes_that_compile_no_recompile(recwarn):
    """An eager reference step runs the regions under ``force_eager``, which compiles nothing. Where such a call came
    before a plan's first compiled call, it marked the region's mode as seen, and that first compile counted as a
    recompile, with a warning that read "a guard failed (dynamo recorded no reason)" (a test of this file did)."""
    net = Net()
    runners, tracker = compiled(net, verify=False)
    with torch.compiler.set_stance("force_eager"):
        net(torch.randn(4, 8))
    net(torch.randn(4, 8))
    assert tracker.stats("blocks.0").compiles == 1 and tracker.stats("blocks.0").recompiles == 0
    assert not [w for w in recwarn if "recompiled" in str(w.message)]
    tracker.remove()


def test_a_bug_in_user_code_is_raised_not_hidden():
    class Broken(nn.Module):
        def forward(self, x):
            return x @ torch.ones(3, 3)  # wrong shape for x: a user bug

    holder = nn.Module()
    holder.blocks = nn.ModuleList([Broken(), Broken()])
    runners, tracker = compiled(holder)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied|size mismatch|mat1 and mat2"):
        holder.blocks[0](torch.randn(2, 4))
    tracker.remove()


def test_past_the_recompile_limit_a_region_runs_new_kinds_of_input_eagerly_and_known_ones_compiled():
    net = Net()
    runners, tracker = compiled(net, recompile_limit=2, verify=False)
    torch._dynamo.config.automatic_dynamic_shapes = False  # force one recompile per new batch size
    try:
        with pytest.warns(UserWarning) as record:
            for batch in range(2, 9):
                net(torch.randn(batch, 8))
        messages = " ".join(str(w.message) for w in record)
        assert "recompiled" in messages and "recompile_limit=2" in messages and "eagerly for new kinds" in messages
        assert runners[0].is_compiled and "recompile_limit=2" in runners[0].closed_reason
        assert tracker.stats("blocks.0").recompiles == 3  # the limit, plus the one that crossed it
        compiles = tracker.stats("blocks.0").compiles
        net(torch.randn(3, 8))  # a size it compiled for: its compiled code
        net(torch.randn(40, 8))  # a new size: eager, nothing compiled
        assert tracker.stats("blocks.0").compiles == compiles
    finally:
        torch._dynamo.config.automatic_dynamic_shapes = True
        tracker.remove()


def test_recompile_limit_dynamic_recompiles_once_with_dynamic_shapes():
    net = Net()
    runners, tracker = compiled(net, recompile_limit=1, on_recompile_limit="dynamic", verify=False)
    torch._dynamo.config.automatic_dynamic_shapes = False
    try:
        with pytest.warns(UserWarning, match="dynamic=True"):
            for batch in range(2, 6):
                net(torch.randn(batch, 8))
    finally:
        torch._dynamo.config.automatic_dynamic_shapes = True
    assert runners[0].is_compiled
    tracker.remove()


class TwoFrames(nn.Module):
    """A network whose code breaks into two frames: a new input size recompiles each of them once."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


def test_the_recompile_limit_counts_per_code_object_as_torch_does():
    net = TwoFrames()
    tracker = CompileTracker()
    tracker.install()
    runner = CompiledRegion(Region("net", net), CompileOptions(backend="eager"), tracker,
                            RegionPolicy(recompile_limit=2, verify=False))  # fmt: skip
    runner.install()
    torch._dynamo.config.automatic_dynamic_shapes = False  # one recompile of each frame per new batch size
    try:
        with pytest.warns(UserWarning, match="recompiled"):
            [net(torch.randn(batch, 8)) for batch in (2, 3, 4)]
        stats = tracker.stats(runner.name)
        assert stats.recompiles == 4 and stats.most_recompiles_of_one_code == 2  # 2 frames x 2 new sizes
        assert runner.is_compiled, "within the limit for each code object"
        with pytest.warns(UserWarning, match="recompile_limit=2"):
            net(torch.randn(5, 8))
        assert runner.closed_reason and stats.most_recompiles_of_one_code == 3
    finally:
        torch._dynamo.config.automatic_dynamic_shapes = True
        runner.uninstall()
        tracker.remove()


def test_a_mode_joins_the_users_inductor_options_as_the_options_it_stands_for(monkeypatch):
    both = CompileOptions(mode="reduce-overhead", options={"fallback_random": True}).kwargs()
    assert both["options"] == {"triton.cudagraphs": True, "fallback_random": True} and "mode" not in both
    overridden = CompileOptions(mode="reduce-overhead", options={"triton.cudagraphs": False}).kwargs()
    assert overridden["options"] == {"triton.cudagraphs": False}  # the user's win, as in torch.compile
    other_backend = CompileOptions(backend="aot_eager", mode="reduce-overhead", options={"a": 1}).kwargs()
    assert other_backend["mode"] == "reduce-overhead" and "options" not in other_backend  # inductor's table only
    monkeypatch.setattr("lightning_fuse.compat.mode_options", lambda mode: None)  # a torch without the table
    assert CompileOptions(mode="reduce-overhead", options={"fallback_random": True}).kwargs()["mode"] == (
        "reduce-overhead")  # fmt: skip


def test_plans_that_compile_a_region_with_other_settings_spend_none_of_its_recompile_limit(recwarn):
    """The search compiles each region once per candidate's settings (inductor's modes, eager-backend checks), and
    torch compiles the same code anew for each (dynamo's BACKEND_MATCH). Those are the plans' compiles, not a
    recompile for a new kind of input: they neither warn nor count against the chosen plan's ``recompile_limit``."""
    net = Net()
    tracker = CompileTracker()
    tracker.install()
    policy = RegionPolicy(recompile_limit=1, verify=False)
    try:
        for backend in ("eager", "aot_eager", "eager", "aot_eager"):  # four candidates, two settings between them
            runner = CompiledRegion(Region("net", net), CompileOptions(backend=backend), tracker, policy)
            runner.install()
            net(torch.randn(4, 8))
            runner.uninstall()
        stats = tracker.stats("net")
        assert stats.compiles == 2 and stats.recompiles == 0 and runner.closed_reason is None
        assert not [w for w in recwarn if "recompiled" in str(w.message)]
        torch._dynamo.config.automatic_dynamic_shapes = False
        runner.install()
        with pytest.warns(UserWarning, match=r"recompiled \(1x so far\). Reason: .*size mismatch"):
            net(torch.randn(5, 8))  # a new kind of input: the chosen plan's first recompile, its reason dynamo's own
        assert stats.recompiles == 1 and runner.closed_reason is None, "within recompile_limit=1"
    finally:
        torch._dynamo.config.automatic_dynamic_shapes = True
        runner.uninstall()
        tracker.remove()


def test_a_recompile_in_an_evaluation_call_does_not_ask_the_user_to_declare_a_dim():
    """A validation loop's batches may differ from the training steps' (on CPU, a Llama generating 40 tokens in
    validation, before ``generate`` ran eagerly: 3 recompiles a region): the region recompiles in eval mode, which no
    ``dynamic_dims`` of the training batch changes."""
    net = Net().eval()
    tracker = CompileTracker()
    tracker.install()
    runner = CompiledRegion(Region("net", net), CompileOptions(backend="eager"), tracker, RegionPolicy(verify=False))
    torch._dynamo.config.automatic_dynamic_shapes = False
    runner.install()
    try:
        with torch.no_grad():
            net(torch.randn(4, 8))
            with pytest.warns(UserWarning, match=r"recompiled \(1x so far\)") as caught:
                net(torch.randn(5, 8))
        message = str(caught[0].message)
        assert "in an evaluation call" in message and "declare it with `dynamic_dims`" not in message
    finally:
        torch._dynamo.config.automatic_dynamic_shapes = True
        runner.uninstall()
        tracker.remove()


def test_a_module_of_torchs_own_is_compiled_through_a_function_of_ours():
    """torch 2.11 compiled nothing of an ``nn.Sequential`` region through its ``_call_impl`` (an H200 probe's CNN
    "compiled" in 0.0 s); called from a function of ours, dynamo traces it, hooks included."""
    from torch._dynamo.utils import counters

    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    seen = []
    seq.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(compilable_call(seq), backend="eager")(torch.ones(4, 2))
    assert counters["frames"]["ok"] == 1 and seen == [(4, 3)]
    torch.testing.assert_close(out, compat.plain_call(seq)(torch.ones(4, 2)))
