"""The fallback that reaches backward and the rescue of a call eager refuses (lightning_fuse.guard), and the truth
about what ran (FitState.what_ran)."""

import sys
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch

from lightning_fuse import FuseCallback, compat
from lightning_fuse import plan as plan_module
from lightning_fuse.compiler import CompileOptions
from lightning_fuse.decision import Decision
from lightning_fuse.fit import FitState
from lightning_fuse.graphs import graph_target
from lightning_fuse.guard import EagerRescue
from lightning_fuse.measurement import epoch_extras, verdict
from lightning_fuse.meters import cudagraph_trees
from lightning_fuse.plan import Regions, RegionTrees, Setting, Whole
from lightning_fuse.regions import resolve_regions
from tests.faults import messages, raise_as_torchs_trees
from tests.test_running_guard import PlanPerStep, regions_win_on_a_fake_clock
from tests.toy import ToyTask, trainer


class Boom(torch.autograd.Function):
    """Identity forward; its backward raises, as compiled code failing in backward (checkpoint recomputation, say)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("Unexpected state: target_frame.early_stop is set")


def backward_breaking_backend(gm, example_inputs):
    def run(*args):
        out = gm(*args)
        return type(out)(Boom.apply(o) if isinstance(o, torch.Tensor) and o.requires_grad else o for o in out)

    return run


class Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def losses_of(callbacks, manual=False):
    pl.seed_everything(0, verbose=False)
    recorder = Losses()
    task = ToyTask(samples=64)
    trainer(callbacks + [recorder], max_epochs=2, limit_val_batches=0).fit(task)
    return recorder.losses, task


def test_a_fault_in_a_compiled_backward_on_the_first_compiled_step_costs_the_plan_not_the_run():
    eager_losses, eager_task = losses_of([])
    fuse = FuseCallback(mode="default", backend=backward_breaking_backend, cache_dir=False, eager_steps=2,
                        verify=False)  # fmt: skip
    with pytest.warns(UserWarning, match="dropped, the rest of the fit trains eagerly: backward raised"):
        fused_losses, fused_task = losses_of([fuse])
    assert len(fused_losses) == len(eager_losses)
    torch.testing.assert_close(fused_losses, eager_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(eager_task.parameters(), fused_task.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fuse.fit.hooks.guard is not None and fuse.fit.hooks.guard.redone_steps == 1
    assert fuse.plan.name == "eager" and "backward raised" in fuse.fit.dropped
    assert fuse.history[-1]["fuse/plan_dropped"] == 1.0


def test_the_search_catches_a_backward_fault_before_any_training_step_sees_it():
    eager_losses, _ = losses_of([])
    fuse = FuseCallback(backend=backward_breaking_backend, cache_dir=False, eager_steps=2, verify=False)
    fused_losses, _ = losses_of([fuse])
    outcomes = {t.name: t.outcome for t in fuse.decision.trials}
    assert outcomes["regions"].startswith("failed: AssertionError: Unexpected state")
    assert fuse.plan.name == "eager" and fuse.fit.hooks.guard.redone_steps == 0
    torch.testing.assert_close(fused_losses, eager_losses, rtol=1e-5, atol=1e-6)


class FailsUnder(ToyTask):
    """Its loss's backward raises at step ``at`` while FuseCallback runs a plan named in ``plans`` (``plan()``: the
    plan's name), as torch's cudagraph trees did in Bloom's backward on an H200 ("graph recording observed an input
    tensor deallocate during graph recording that did not occur during replay")."""

    def __init__(self, plan: Callable[[], str], plans: tuple[str, ...], at: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.plan, self.plans, self.at = plan, plans, at

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        if self.global_step == self.at and self.plan() in self.plans:
            logits = Boom.apply(logits)
        return torch.nn.functional.cross_entropy(logits, y)


def fit_failing_under(monkeypatch, plans: tuple[str, ...], cache_dir) -> tuple[FuseCallback, list[str], list[float]]:
    """A fit whose search picks ``compile``, a plan under torch's trees as far as the fit knows (its candidate
    without them: ``regions``), and whose backward fails at step 8 under ``plans``: FuseCallback, the plan at each
    step's end, the losses."""
    regions_win_on_a_fake_clock(monkeypatch, winner="compile")
    monkeypatch.setitem(plan_module.WITHOUT_GRAPHS, "compile", ("regions",))
    fuse = FuseCallback(backend="aot_eager", cache_dir=cache_dir, eager_steps=0)
    probe, losses = PlanPerStep(fuse), Losses()
    pl.seed_everything(0, verbose=False)
    task = FailsUnder(lambda: fuse.plan.name if fuse.plan is not None else "-", plans, at=8, samples=16 * 12)
    trainer([fuse, probe, losses], max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0).fit(task)
    return fuse, probe.plans, losses.losses


def eager_fit_losses() -> list[float]:
    """The losses of :func:`fit_failing_under`'s fit without FuseCallback."""
    eager = Losses()
    pl.seed_everything(0, verbose=False)
    trainer([eager], max_epochs=1, limit_val_batches=0).fit(ToyTask(samples=16 * 12))
    return eager.losses


def test_a_backward_failing_under_torchs_trees_hands_over_to_the_same_compile_without_them(monkeypatch, tmp_path):
    eager_losses = eager_fit_losses()
    with pytest.warns(UserWarning, match=r"under 'compile' failed \(backward raised AssertionError: Unexpected state"):
        fuse, plans, losses = fit_failing_under(monkeypatch, ("compile",), tmp_path)
    assert plans[fuse.fit.activation_step:8] == ["compile"] * (8 - fuse.fit.activation_step)
    assert plans[8:] == ["regions"] * 4, "the failed step redone under the successor, which runs to the end"
    assert fuse.fit.dropped is None and fuse.fit.hooks.guard.redone_steps == 1
    assert fuse.plan.reason.startswith("handed over from 'compile' at step 8: under torch's CUDA graphs, backward "
                                       "raised AssertionError")
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    stored = fuse.fit.decision_file.load(["compile", "regions"])
    assert stored.winner == "regions", "the next run starts without the trees"
    outcomes = {trial.name: trial.outcome for trial in stored.trials}
    assert outcomes["compile"].startswith("handed over at step 8: under torch's CUDA graphs, backward raised")


def fit_whose_forward_fails(monkeypatch, fail: Callable[[], None],
                            cache_dir) -> tuple[FuseCallback, list[str], list[float], list[str]]:  # fmt: skip
    """:func:`fit_failing_under`'s fit, its plan ``compile`` as if under torch's trees, whose compiled forward raises
    at step 8 (``fail()``): FuseCallback, the plan at each step's end, the losses, the warnings."""
    regions_win_on_a_fake_clock(monkeypatch, winner="compile")
    monkeypatch.setitem(plan_module.WITHOUT_GRAPHS, "compile", ("regions",))
    step = [-1]

    def failing_at_step_8(gm, example_inputs):
        def run(*args):
            if step[0] == 8 and torch.is_grad_enabled():
                fail()
            return gm(*args)

        return run

    class Steps(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step[0] = trainer.global_step

    fuse = FuseCallback(backend=failing_at_step_8, cache_dir=cache_dir, eager_steps=0, verify=False)
    probe, losses = PlanPerStep(fuse), Losses()
    pl.seed_everything(0, verbose=False)
    with pytest.warns(UserWarning) as record:
        trainer([fuse, Steps(), probe, losses], max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0).fit(
            ToyTask(samples=16 * 12))
    return fuse, probe.plans, losses.losses, [str(w.message) for w in record]


def test_a_forward_failing_in_torchs_trees_hands_over_at_the_next_step(monkeypatch, tmp_path):
    eager_losses = eager_fit_losses()
    fuse, plans, losses, warned = fit_whose_forward_fails(
        monkeypatch, lambda: raise_as_torchs_trees("CUDA error: operation not permitted when stream is capturing"),
        tmp_path)
    assert plans[fuse.fit.activation_step:9] == ["compile"] * (9 - fuse.fit.activation_step), "step 8 ends eagerly"
    assert plans[9:] == ["regions"] * 3, "the same compile without the trees from the next step to the end"
    handover = [w for w in warned if "under 'compile' failed" in w]
    assert len(handover) == 1 and "(region 'model' raised RuntimeError: CUDA error: operation not permitted" in (
        handover[0]) and "from step 9 the fit runs 'regions'" in handover[0]
    assert not [w for w in warned if "falls back to eager for the rest of the run" in w], "the handover says it all"
    assert fuse.fit.dropped is None and fuse.fit.hooks.guard.redone_steps == 0, "the forward ran on eagerly"
    assert fuse.plan.reason.startswith("handed over from 'compile' at step 9: under torch's CUDA graphs, region "
                                       "'model' raised RuntimeError")
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    assert fuse.fit.decision_file.load(["compile", "regions"]).winner == "regions", "the next run starts there"


def test_a_forward_failing_in_the_compiled_code_costs_its_region_and_keeps_the_plan(monkeypatch):
    # not the trees' failure (an input inductor cannot lower, say): the same compile without them would fail too
    def fail():
        raise RuntimeError("LoweringException: an input inductor cannot lower")

    fuse, plans, _, warned = fit_whose_forward_fails(monkeypatch, fail, cache_dir=False)
    assert plans[fuse.fit.activation_step:] == ["compile"] * (12 - fuse.fit.activation_step)
    assert [w for w in warned if "region 'model' falls back to eager for the rest of the run: RuntimeError: "
            "LoweringException" in w]  # fmt: skip
    assert not [w for w in warned if "failed" in w and "CUDA graphs" in w]
    assert fuse.plan.trees_failure is None


def test_a_plan_handed_over_for_a_failure_is_dropped_when_it_fails_too(monkeypatch):
    with pytest.warns(UserWarning) as record:
        fuse, plans, losses = fit_failing_under(monkeypatch, ("compile", "regions"), cache_dir=False)
    assert len(messages(record, "under 'compile' failed (backward raised")) == 1
    assert len(messages(record, "plan 'regions' dropped, the rest of the fit trains eagerly: backward raised")) == 1
    assert plans[8:] == ["eager"] * 4 and fuse.fit.hooks.guard.redone_steps == 2
    torch.testing.assert_close(losses, eager_fit_losses(), rtol=1e-5, atol=1e-6)


def test_the_summary_says_a_graph_that_was_not_captured_was_not_captured():
    task = ToyTask()
    setting = Setting(resolve_regions(task, "auto", ()), graph_target(task), CompileOptions(backend="eager"),
                      torch.device("cuda", 0))  # fmt: skip
    plan = Regions(setting, graph=True)
    plan.graph.disabled_reason = "its output holds a DynamicCache, which a graph replay cannot rebuild"
    fit = FitState(candidates=[plan], plan=plan)
    ran = fit.what_ran()
    assert ran == ("regions+graph; graph: not captured (its output holds a DynamicCache, which a graph replay "
                   "cannot rebuild)")
    assert "graph: captured" not in ran  # what_ran's words for a graph that was captured
    assert plan.failure.startswith("no graph:")
    assert fit.plan_shortfall() == "its graph not captured"  # and the verdict says it beside the plan's name
    plan.graph.replays = 191  # it was captured, then dropped: captured again over a changed model, it failed
    assert "graph: 191 replays, then none (its output holds" in fit.what_ran()
    assert fit.plan_shortfall() == "its graph dropped after its replays"


def test_the_verdict_says_a_plan_that_ran_eagerly_did_not_run_as_named():
    # On an H200, a 16-mixed DeiT fit from a bf16 run's cache: its whole-network region fell back (bf16 outputs) and
    # its graph's capture failed; the verdict said "no clear difference from eager with compile+graph"
    task = ToyTask()
    setting = Setting(resolve_regions(task, "auto", ()), graph_target(task), CompileOptions(backend="eager"),
                      torch.device("cuda", 0))  # fmt: skip
    plan = Regions(setting, graph=True)
    plan.install()
    try:
        fit = FitState(setting=setting, candidates=[plan], plan=plan)
        assert fit.plan_shortfall() is None
        for runner in plan.runners:
            runner.fallback_reason = "its compiled output differs from eager on the first batch"
        plan.graph.disabled_reason = "the capture failed"
        assert fit.plan_shortfall() == "its graph not captured, its regions fell back to eager"
        rows = [{"epoch": 0, "fuse/speedup": 1.02, "fuse/speedup_low": 0.92, "fuse/speedup_high": 1.11}]
        line = verdict(fit, rows)
        assert "with regions+graph (its graph not captured, its regions fell back to eager);" in line
    finally:
        plan.uninstall()


def test_the_summary_says_what_torchs_cudagraph_trees_recorded_in_the_fit(monkeypatch):
    task = ToyTask()
    setting = Setting(resolve_regions(task, "auto", ()), graph_target(task), CompileOptions(backend="eager"),
                      torch.device("cuda", 0))  # fmt: skip
    trees = {0: (17, 1)}  # the process's graphs and skips on each device now; at fit start (3, 1)
    monkeypatch.setattr(compat, "cudagraph_tree_stats", lambda index: trees[index])
    plan = RegionTrees(setting)
    fit = FitState(setting=setting, candidates=[plan], plan=plan, trees_at_start=(3, 1))
    assert fit.what_ran() == "regions+trees; graphs: 14 recorded by torch's cudagraph trees"
    assert epoch_extras(fit, torch.device("cpu"))["graphs_recorded"] == 14.0
    fit.decision = Decision("regions+trees")  # measured now: the trials recorded into the same trees
    assert fit.what_ran().endswith("graphs: 14 recorded by torch's cudagraph trees, the plan search's trials included")
    fit.plan, trees[0] = Whole(setting, "reduce-overhead"), (3, 3)
    fit.decision.cached = True
    assert fit.what_ran() == ("reduce-overhead; graphs: none recorded by torch's cudagraph trees (inductor skipped "
                              'cudagraphs 2 time(s): see its "skipping cudagraphs due to ..." warnings)')  # fmt: skip


def test_the_summary_says_nothing_of_cudagraph_trees_for_other_plans_or_on_a_cpu(monkeypatch):
    monkeypatch.setattr(compat, "cudagraph_tree_stats", lambda index: pytest.fail("no trees to count"))
    task = ToyTask()
    cuda = Setting(resolve_regions(task, "auto", ()), graph_target(task), CompileOptions(backend="eager"),
                   torch.device("cuda", 0))  # fmt: skip
    cpu = Setting(resolve_regions(task, "auto", ()), graph_target(task), CompileOptions(backend="eager"),
                  torch.device("cpu"))  # fmt: skip
    for setting, plan in [(cuda, Regions(cuda, graph=False)), (cuda, Whole(cuda, None)), (cpu, RegionTrees(cpu))]:
        fit = FitState(setting=setting, candidates=[plan], plan=plan)
        assert "cudagraph trees" not in fit.what_ran() and fit.trees_recorded() is None
        assert "graphs_recorded" not in epoch_extras(fit, torch.device("cpu"))
    assert cudagraph_trees(torch.device("cpu")) == (0, 0)  # a CPU fit's baseline: nothing looked up


class RefusedWhenEager(torch.nn.Module):
    """A batch norm, then ``message`` raised unless it runs compiled: an eager kernel refusing an input too large for
    it (HF SegFormer at 64 images of 512 px on an H200), or any other error."""

    def __init__(self, message: str = "input tensor must fit into 32-bit index math") -> None:
        super().__init__()
        self.norm, self.message = torch.nn.BatchNorm1d(2), message

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        if not torch.compiler.is_compiling():
            raise RuntimeError(self.message)
        return x


def test_a_call_eager_refuses_for_its_size_runs_compiled_and_counts_once():
    from torch.utils.flop_counter import FlopCounterMode

    net = RefusedWhenEager()
    rescue = EagerRescue(net, {"backend": "aot_eager"})
    rescue.install()
    batch = torch.randn(4, 2) + 3
    with torch.compiler.set_stance("force_eager"), FlopCounterMode(display=False):  # as FuseCallback's eager steps
        assert net(batch).shape == (4, 2)
    assert "32-bit index" in rescue.reason
    once = torch.nn.BatchNorm1d(2)
    once(batch)
    assert net.norm.num_batches_tracked.item() == 1  # the refused call's update was put back
    torch.testing.assert_close(net.norm.running_mean, once.running_mean)
    net(batch)
    assert net.norm.num_batches_tracked.item() == 2  # a later call runs compiled straight away
    rescue.uninstall()
    assert compat.compiled_call_impl(net) is None


def test_in_a_reference_step_the_rescue_copies_no_statistics_and_is_taken_off_after_it():
    net = RefusedWhenEager()
    rescue = EagerRescue(net, {"backend": "aot_eager"})
    with rescue.installed():  # as an eager reference step enters it
        assert compat.compiled_call_impl(net) is not None
        net(torch.randn(4, 2) + 3)
    assert compat.compiled_call_impl(net) is None and "32-bit index" in rescue.reason
    assert net.norm.num_batches_tracked.item() == 2, "no copy before the timed call: the refused call's update stays"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes came in Python 3.11")
def test_an_error_of_the_compiled_call_says_eager_had_refused_one():
    net = RefusedWhenEager()
    rescue = EagerRescue(net, {"backend": "aot_eager"})
    rescue.install()
    net(torch.randn(4, 2))  # refused eagerly, run compiled
    with pytest.raises(RuntimeError) as raised:
        net(torch.randn(4, 3))  # the wrong width for the batch norm: compiled, it raises too
    notes = "".join(raised.value.__notes__)
    assert "eager had refused one: RuntimeError: input tensor must fit into 32-bit index math" in notes
    rescue.uninstall()


def test_an_error_that_is_not_a_size_limit_passes_the_rescue():
    net = RefusedWhenEager("mat1 and mat2 shapes cannot be multiplied")
    rescue = EagerRescue(net, {"backend": "aot_eager"})
    rescue.install()
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        net(torch.randn(4, 2))
    assert rescue.reason is None
    rescue.uninstall()
