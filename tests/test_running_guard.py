"""Plans that crawl in training: shapes that vary keep one-shape graphs out of the search, a slow plan is dropped
mid-epoch, and torch's own CUDA graphs record for a bounded number of sizes."""

import logging
import pickle
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback

import lightning_fuse.fit as fit_module
import lightning_fuse.running_guard as running_guard
from lightning_fuse import FuseCallback, choice
from lightning_fuse import plan as plan_module
from lightning_fuse.buckets import PadToBuckets, suggest_buckets
from lightning_fuse.call_shapes import CallShapes, NoCudnnAttention
from lightning_fuse.compiler import TREE_SIZES, CompiledRegion, CompileOptions, RepeatedSizes
from lightning_fuse.fit import FitState
from lightning_fuse.graphs import graph_target
from lightning_fuse.hooks import FitHooks
from lightning_fuse.plan import Plan, Setting, Whole, candidates, for_varying_shapes
from lightning_fuse.regions import resolve_regions
from lightning_fuse.running_guard import BEFORE, EAGER, PLAN, RunningGuard, Window, window_speedup
from lightning_fuse.search import TIMED_CALLS, PlanSearch
from lightning_fuse.timing import StepTimer
from tests.toy import ToyTask, trainer

CUDA = torch.device("cuda", 0)
GRAPH_PLANS = {"regions+graph", "compile+graph", "reduce-overhead", "graph", "regions+graphs", "regions+trees"}


# ---------------------------------------------------------------------------------------------- varying shapes
def lengths_seen(*lengths: int) -> CallShapes:
    shapes = CallShapes()
    for length in lengths:  # an HF-style call: keyword tensors with the length in dim 1, and a plain flag
        ids = torch.zeros(4, length, dtype=torch.long)
        shapes.add((), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False})
    return shapes


def test_the_shapes_of_the_first_calls_tell_which_dims_vary():
    assert not lengths_seen(128, 128, 128).varies and lengths_seen(128, 128).varying_dims == set()
    shapes = lengths_seen(64, 200, 97)
    assert shapes.varies and shapes.calls == 3
    assert shapes.varying_dims == {1} and shapes.sizes(1) == [64, 97, 200] and shapes.sizes(0) == []
    assert suggest_buckets(shapes.sizes(1)) == [64, 128, 192, 256]  # multiples of 64 covering 64..200


def test_with_varying_shapes_only_torch_graphs_per_size_compete_unless_lengths_are_bucketed():
    task = ToyTask()
    setting = Setting(resolve_regions(task, "auto", ()), graph_target(task), CompileOptions(backend="eager"), CUDA,
                      max_graphs=3)  # fmt: skip
    plans = candidates(setting)  # a (faked) CUDA device: every graph plan is a candidate
    assert GRAPH_PLANS <= {plan.name for plan in plans}
    assert {plan.name for plan in plans if plan.records_graphs} == GRAPH_PLANS
    kept = ["eager", "reduce-overhead", "regions+trees", "regions", "compile"]  # trees: a graph per size
    assert [plan.name for plan in for_varying_shapes(plans, buckets=0)] == kept
    assert for_varying_shapes(plans, buckets=3) == plans  # padded to 3 lengths: a graph per bucket, at most 3
    graphed = next(plan for plan in plans if plan.name == "regions+graph")
    assert graphed.graph.max_graphs == 3


@pytest.mark.parametrize(("device", "buckets", "applies"), [("cuda", None, True), ("cuda", (64, 128), False),
                                                        ("cpu", None, False)])  # fmt: skip
def test_varying_lengths_on_cuda_leave_cudnn_attention_out_of_fuses_steps_only(device, buckets, applies, caplog):
    hooks = FitHooks(shapes=lengths_seen(64, 200, 97), buckets=PadToBuckets(buckets) if buckets else None)
    fit = SimpleNamespace(hooks=hooks, searching=False, candidates=[],
                          setting=SimpleNamespace(device=torch.device(device)), varying_dims=set())  # fmt: skip
    with caplog.at_level("INFO"):
        choice._hold_over_varying_shapes(fit)
    assert fit.varying_dims == {1}
    assert fit.hooks.attention.applies is applies
    assert any("build a plan for each new length" in r.getMessage() for r in caplog.records) is applies
    try:
        fit.hooks.set_plan_step(False, reference=True)  # an eager reference step: as the plan's (and the search's)
        assert torch.backends.cuda.cudnn_sdp_enabled() is not applies
        fit.hooks.set_plan_step(True)
        assert torch.backends.cuda.cudnn_sdp_enabled() is not applies
        fit.hooks.set_plan_step(False)  # an eager step of a fit whose plan was dropped: the user's setting
        assert torch.backends.cuda.cudnn_sdp_enabled()
        fit.hooks.attention.enabled = True
    finally:
        fit.hooks.attention.restore()  # at the fit's end, whatever the last step was
    assert torch.backends.cuda.cudnn_sdp_enabled() and not fit.hooks.attention.applies


def test_a_user_who_turned_cudnn_attention_off_keeps_it_off():
    attention = NoCudnnAttention()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        attention.apply()
        attention.enabled = False  # an eager step would otherwise turn it on
        assert not attention.applies and not torch.backends.cuda.cudnn_sdp_enabled()
        attention.restore()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def test_torch_cuda_graphs_record_for_sizes_met_again_in_a_later_step_up_to_a_cap(caplog):
    """On an H200 a Llama's and a DeBERTa's forward and backward asked the same key, ``(length,)``: counted in calls,
    the backward recorded a graph in the first step of every size."""
    sizes = RepeatedSizes(sizes=1)  # 2 keys
    with caplog.at_level("INFO"):
        first = [key in sizes for key in ((64,), (64,), 96, (96, 3))]  # one step: each size's forward and backward
        assert first == [False] * 4, "a size's first step: compiled code alone (its graph might never replay)"
        assert sizes.full, "4 keys met, 2 record: most sizes would run without a graph"
        sizes.next_step()
        again = [key in sizes for key in ((64,), (64,), 96, (96, 3), (128,))]
        assert again == [True, True, True, False, False], "met again: recorded, up to 2 keys"
        sizes.next_step()
        assert None in sizes and (64,) in sizes, "a graph without dynamic sizes is one graph; a recorded size replays"
    assert caplog.text.count("met more input sizes than torch's CUDA graphs record") == 1, "said once"
    assert not pickle.loads(pickle.dumps(sizes)).full  # inductor's cache key sees the cap, not the sizes met


def test_sizes_that_come_again_within_the_cap_never_fill_it():
    sizes = RepeatedSizes(sizes=2)
    epochs = []
    for _epoch in range(3):
        epochs.append([])
        for length in (16, 32, 48):  # three lengths, forward and backward asking one key each
            epochs[-1] += [(length,) in sizes, (length,) in sizes]
            sizes.next_step()
    assert epochs == [[False] * 6, [True] * 6, [True] * 6], "recorded in the second epoch, replayed in the third"
    assert not sizes.full  # 3 of 4 keys


def test_evaluation_calls_have_a_cap_of_sizes_of_their_own_and_never_fill_the_training_calls_cap():
    """On an H200 Bloom, under ``reduce-overhead`` chosen by measurement, generated 80 tokens in its validation (an HF
    model's ``generate`` meets a new cache length at every token): those sizes filled the cap, and the fit handed its
    training steps, of one size throughout, over to the compile without graphs."""
    sizes = RepeatedSizes(sizes=1)  # 2 keys
    sizes.set_evaluating(True)
    generated = []
    for _batch in range(2):
        generated.append([(length,) in sizes for length in (32, 33, 34)])
        sizes.next_step()
    assert generated == [[False] * 3, [True, True, False]], "met again in a later batch, up to evaluation's cap"
    assert not sizes.full
    sizes.set_evaluating(False)
    training = [(64,) in sizes]
    sizes.next_step()
    training += [(64,) in sizes]
    assert training == [False, True], "training's cap, untouched by evaluation's sizes"
    sizes.set_evaluating(True)
    assert (33,) in sizes, "evaluation's recorded sizes still replay"


def test_the_callback_tells_the_plan_that_a_validation_loop_calls_it_and_that_training_calls_it_again(monkeypatch):
    regions_win_on_a_fake_clock(monkeypatch)
    told = []
    monkeypatch.setattr(plan_module.Regions, "set_evaluating", lambda plan, evaluating: told.append(evaluating))
    fuse = FuseCallback(backend="aot_eager", cache_dir=False, eager_steps=0)
    trainer([fuse], max_epochs=2, limit_val_batches=2).fit(ToyTask(samples=16 * 8))
    loop = [True, True, False]  # before each validation batch: a step of its own for the trees' sizes
    assert fuse.plan.name == "regions" and told == loop * 2, "the sanity check ran before the plan"
    setting = Setting([], graph_target(ToyTask()), CompileOptions(backend="eager"), CUDA)
    monkeypatch.undo()
    plan = Whole(setting, "reduce-overhead")  # its trees' cap, made for a (faked) CUDA device
    plan.set_evaluating(True)
    assert plan._tree_sizes.evaluating
    assert (8,) not in plan._tree_sizes
    plan.set_evaluating(True)
    assert (8,) in plan._tree_sizes, "a size met again in the next evaluation batch records"
    plan.set_evaluating(False)
    assert (8,) not in plan._tree_sizes
    plan.step_begin()
    assert (8,) in plan._tree_sizes, "and in the next training iteration"


def test_a_plan_under_torch_graphs_caps_their_sizes_while_installed_and_gives_the_setting_back():
    task = ToyTask()
    setting = Setting([], graph_target(task), CompileOptions(backend="eager"), CUDA)
    plan = Whole(setting, "reduce-overhead")  # installing compiles nothing: a (faked) CUDA device is enough
    before = torch._inductor.config.triton.cudagraph_capture_sizes
    plan.install()
    try:
        capped = torch._inductor.config.triton.cudagraph_capture_sizes
        assert isinstance(capped, RepeatedSizes) and capped.sizes == TREE_SIZES
        plan.install()  # installed again (after an eager reference step): one cap, one setting to give back
    finally:
        plan.uninstall()
    assert torch._inductor.config.triton.cudagraph_capture_sizes is before
    compile_only = Whole(setting, None)
    compile_only.install()
    assert torch._inductor.config.triton.cudagraph_capture_sizes is before  # no torch graphs: nothing capped
    compile_only.uninstall()


# ---------------------------------------------------------------------------------------------- the running guard
def test_a_window_closes_every_window_steps_and_eager_steps_are_kept_apart():
    ticks = iter(range(1000))
    guard = RunningGuard(window=4, clock=lambda: next(ticks) / 1e3 * 2)  # every step lasts 2 ms
    closed = []
    for kind in (PLAN, EAGER, None, PLAN, PLAN, PLAN, PLAN, PLAN):
        if kind == PLAN and guard.in_eager_run:
            guard.close_run()  # where the caller waited for the device to run the eager steps
        guard.begin(kind)
        closed.append(guard.end())
    assert [c is not None for c in closed] == [False, False, False, True] * 2
    assert closed[3].steady == pytest.approx([2.0, 2.0]) and len(closed[7].steady) == 4
    assert guard.eager_ms() == pytest.approx(4.0), "the run: from its first step's start to its close, 2 steps"
    assert not guard.in_eager_run
    assert window_speedup(Window([4.0, 5.0, 6.0], []), eager_ms=2.5) == pytest.approx(0.5)
    assert window_speedup(Window([4.0], []), eager_ms=2.5, least=2) is None
    assert window_speedup(Window([4.0], []), eager_ms=None) is None


def test_the_steps_before_the_plan_are_timed_outside_every_window_the_first_left_out():
    durations = iter([900.0, 30.0, 20.0, 5.0, 5.0])  # ms: the first step creates the optimizer's state
    now = [0.0]
    guard = RunningGuard(window=2, clock=lambda: now[0])
    closed = []
    for kind in (BEFORE, BEFORE, BEFORE, PLAN, PLAN):
        guard.begin(kind)
        now[0] += next(durations) / 1e3
        closed.append(guard.end())
    assert closed[:4] == [None] * 4 and closed[4].steady == pytest.approx([5.0, 5.0]), "windows count from the plan"
    assert guard.before_ms() == pytest.approx(25.0) and guard.eager_ms() is None


def test_a_step_that_recorded_a_graph_counts_in_its_window_without_its_time():
    now = [0.0]
    guard = RunningGuard(window=4, clock=lambda: now[0])
    closed = []
    for kind, ms, recorded in [(PLAN, 200.0, True), (PLAN, 5.0, False), (EAGER, 300.0, True), (PLAN, 5.0, False)]:
        guard.begin(kind)
        now[0] += ms / 1e3
        closed.append(guard.end(judged=not recorded))
    assert closed[:3] == [None] * 3 and closed[3] == Window(pytest.approx([5.0, 5.0]), []), "4 steps, 2 judged"
    guard.close_run()
    assert guard.eager_ms() is None, "a run of eager steps holding a recording is left out whole"


def test_steps_that_compiled_are_left_out_unless_half_the_window_compiled_or_the_rest_gained_nothing():
    """A compile or a capture is a one-time cost (a window's mean would read a 4 s compile among fast steps as a
    slow plan); a plan that compiles at every other step crawls, and those steps are its times; so they are where
    the steps between them ran no faster than eager: nothing ever pays the compiles back."""
    now = [0.0]
    guard = RunningGuard(window=4, clock=lambda: now[0])

    def window(steps: list[tuple[float, bool]]) -> Window | None:
        closed = None
        for ms, compiled in steps:
            guard.begin(PLAN)
            now[0] += ms / 1e3
            closed = guard.end(one_time=compiled)
        return closed

    paid_back = window([(4000.0, True), (5.0, False), (5.0, False), (5.0, False)])
    assert paid_back == Window(pytest.approx([5.0] * 3), pytest.approx([4000.0]))
    assert window_speedup(paid_back, eager_ms=10.0) == pytest.approx(2.0), "faster between compiles: left out"
    assert window_speedup(paid_back, eager_ms=4.0) == pytest.approx(4.0 / (4015.0 / 4)), "no gain: they count"
    crawl = window([(900.0, True), (5.0, False), (900.0, True), (5.0, False)])
    assert window_speedup(crawl, eager_ms=10.0) == pytest.approx(10.0 / (1810.0 / 4)), "half compiled: judged"


class PlanPerStep(Callback):
    """After FuseCallback: the plan in force at the end of every training step."""

    def __init__(self, fuse: FuseCallback) -> None:
        self.fuse = fuse
        self.plans: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.plans.append(self.fuse.plan.name if self.fuse.plan is not None else "-")


class FakeClock:
    """The running guard's clock: 1 ms passes at each reading, and 10 ms at each call of a compiled region."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


def regions_win_on_a_fake_clock(monkeypatch, winner: str = "regions") -> FakeClock:
    """The search picks ``winner`` (its forward+backward pinned at 1 ms, every other plan's at 10 ms), and the
    running guard reads the returned clock."""
    clock, plain_init = FakeClock(), RunningGuard.__init__

    def pinned_time(self, plan, call):
        call()
        return [1.0 if plan.name == winner else 10.0] * TIMED_CALLS

    monkeypatch.setattr(PlanSearch, "_time", pinned_time)
    monkeypatch.setattr(RunningGuard, "__init__", lambda self, window=None: plain_init(self, window, clock))
    return clock


def slow_regions_fit(monkeypatch, steps: int, broadcast=None) -> tuple[FuseCallback, PlanPerStep]:
    """A fit whose search picks ``regions`` though each compiled region's call takes 10 ms on the guard's clock:
    the plan crawls in training, the eager reference steps do not (they bypass the regions).
    ``broadcast(fuse)`` makes the strategy's broadcast."""
    clock, plain_call = regions_win_on_a_fake_clock(monkeypatch), CompiledRegion.__call__

    def slow_call(self, *args, **kwargs):
        clock.now += 0.01
        return plain_call(self, *args, **kwargs)

    monkeypatch.setattr(CompiledRegion, "__call__", slow_call)
    fuse = FuseCallback(backend="aot_eager", cache_dir=False)
    probe = PlanPerStep(fuse)
    t = trainer([fuse, probe], max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0)
    if broadcast is not None:
        monkeypatch.setattr(t.strategy, "broadcast", broadcast(fuse))
    t.fit(ToyTask(samples=16 * steps))
    return fuse, probe


def test_a_plan_slower_than_eager_is_dropped_within_the_guards_window_mid_epoch(monkeypatch):
    steps = 60
    dropped = (r"plan 'regions' dropped.*: it measured 0\.03x of eager over its last 30 steps in epoch 0 .*, "
               r"under the 0\.9x kept")
    with pytest.warns(UserWarning, match=dropped):
        fuse, probe = slow_regions_fit(monkeypatch, steps)
    activation, window = fuse.fit.activation_step, running_guard.GUARD_WINDOW
    dropped_at = probe.plans.index("eager")
    assert probe.plans[activation:dropped_at] == ["regions"] * (dropped_at - activation)  # it ran, then went
    assert activation < dropped_at <= activation + window and dropped_at < steps - 1  # mid-epoch, within a window
    assert fuse.decision.winner == "regions" and "over its last 30 steps" in fuse.fit.dropped
    assert fuse.fit.dropped_in_epoch == 0, "the verdict names the epoch the warning named"
    assert fuse.history[0]["fuse/plan_dropped"] == 1.0 and fuse.plan.name == "eager"
    assert fuse.verdict.startswith("FuseCallback: the plan was dropped, it measured ")


def test_graph_recordings_bunched_in_one_window_do_not_drop_a_plan_that_is_fast_after(monkeypatch):
    """The plan's first 60 compiled calls (its first 20 steps: 3 regions a step) each take 100 ms and record a CUDA
    graph, as torch's cudagraph trees do for lengths met close together; every later call is fast. Without leaving
    the recording steps out, the guard's first window would read 0.00x of eager."""
    clock, plain_call = regions_win_on_a_fake_clock(monkeypatch), CompiledRegion.__call__
    callbacks = torch._dynamo.callback.callback_handler
    recordings, plan_calls = 60, [0]

    def call(self, *args, **kwargs):
        fuse_plan = fuse.fit.plan
        if fuse_plan is None or fuse_plan.name != "regions" or plan_calls[0] >= recordings:
            return plain_call(self, *args, **kwargs)
        plan_calls[0] += 1
        with callbacks.install_callbacks(torch._dynamo.callback.CallbackTrigger.CUDAGRAPH_RECORDING, "0"):
            clock.now += 0.1
            return plain_call(self, *args, **kwargs)

    monkeypatch.setattr(CompiledRegion, "__call__", call)
    fuse = FuseCallback(backend="aot_eager", cache_dir=False, eager_steps=0)  # judged against the steps before
    t = trainer([fuse], max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0)
    t.fit(ToyTask(samples=16 * 70))
    assert plan_calls[0] == recordings and fuse.tracker.recordings == recordings
    assert fuse.decision.winner == "regions" and fuse.fit.dropped is None and fuse.plan.name == "regions"


def test_recordings_that_never_stop_count_once_the_fits_excused_ones_are_spent(monkeypatch):
    """Every third step of the plan records its CUDA graphs again (300 ms), for good, as torch's cudagraph trees did
    under HF Wav2Vec2 on an H200 (a median step 0.65x eager's, a mean 3.9x). The first
    ``EXCUSED_RECORDINGS`` recording steps are left out as a one-time cost; past them the guard sees the cost and
    drops the plan. Before, every recording step was left out, and the plan ran the whole fit."""
    clock, plain_call = regions_win_on_a_fake_clock(monkeypatch), CompiledRegion.__call__
    callbacks = torch._dynamo.callback.callback_handler
    plan_calls = [0]

    def call(self, *args, **kwargs):
        if fuse.fit.plan is None or fuse.fit.plan.name != "regions":
            return plain_call(self, *args, **kwargs)
        plan_calls[0] += 1
        if (plan_calls[0] - 1) // 3 % 3:  # 3 regions a step: two steps of three replay
            return plain_call(self, *args, **kwargs)
        with callbacks.install_callbacks(torch._dynamo.callback.CallbackTrigger.CUDAGRAPH_RECORDING, "0"):
            clock.now += 0.1
            return plain_call(self, *args, **kwargs)

    monkeypatch.setattr(CompiledRegion, "__call__", call)
    excused = 8  # 40 as shipped: a shorter fit
    monkeypatch.setattr(fit_module, "EXCUSED_RECORDINGS", excused)
    fuse = FuseCallback(backend="aot_eager", cache_dir=False, eager_steps=0)
    probe = PlanPerStep(fuse)
    t = trainer([fuse, probe], max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0)
    how = r"\(mean step, compiling steps and the slowest tenth left out\)"
    with pytest.warns(UserWarning, match=r"plan 'regions' dropped.*" + how):
        t.fit(ToyTask(samples=16 * 100))
    assert fuse.fit.recording_steps > excused, "the excused ones were spent first"
    dropped_at = probe.plans.index("eager", fuse.fit.activation_step)
    assert dropped_at - fuse.fit.activation_step <= 3 * excused + 2 * running_guard.GUARD_WINDOW
    assert fuse.plan.name == "eager" and "over its last 30 steps" in fuse.fit.dropped


def test_a_plan_that_keeps_compiling_and_gains_nothing_between_is_dropped_mid_epoch(monkeypatch):
    """The plan's steps run at eager's pace, and one in three compiles again (500 ms), as torchvision's Faster R-CNN
    did on an H200 (68 recompiles in 120 steps, its boxes a tensor an image). Left out as a one-time cost, the compiles
    would never show; the steps between them gain nothing that could pay them back, so they count."""
    clock, plain_call = regions_win_on_a_fake_clock(monkeypatch), CompiledRegion.__call__
    plan_calls = [0]

    def call(self, *args, **kwargs):
        if fuse.fit.plan is not None and fuse.fit.plan.name == "regions":
            plan_calls[0] += 1
            if plan_calls[0] % 9 == 1:  # 3 regions a step: the first call of every third step compiles
                fuse.tracker.total_compiles += 1
                clock.now += 0.5
        return plain_call(self, *args, **kwargs)

    monkeypatch.setattr(CompiledRegion, "__call__", call)
    fuse = FuseCallback(backend="aot_eager", cache_dir=False, eager_steps=0)  # judged against the steps before
    probe = PlanPerStep(fuse)
    t = trainer([fuse, probe], max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0)
    how = r"its compiling steps counted, as the steps between them ran no faster than eager"
    with pytest.warns(UserWarning, match=r"plan 'regions' dropped.*" + how):
        t.fit(ToyTask(samples=16 * 100))
    dropped_at = probe.plans.index("eager", fuse.fit.activation_step)
    assert dropped_at - fuse.fit.activation_step <= running_guard.GUARD_WINDOW + 1, "at the first window's end"
    assert fuse.plan.name == "eager" and "over its last 30 steps" in fuse.fit.dropped


class DeviceWork(Callback):
    """Placed before FuseCallback: each eager step queues 50 ms of device work, which the guard's clock sees only
    where the host waits for the device (``StepTimer.wait_for_device``); each plan step takes 20 ms on it, as a
    plan that keeps the GPU's queue full does on the host clock."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.queued, self.fuse = clock, 0.0, None

    def wait_for_device(self) -> None:
        self.clock.now, self.queued = self.clock.now + self.queued, 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        fit = self.fuse.fit
        if fit.plan is None or fit.schedule.is_eager(fit.steps):
            self.queued += 0.05
        else:
            self.clock.now += 0.02


def test_eager_steps_are_timed_to_where_the_device_ran_them(monkeypatch):
    """On the host clock alone, eager steps after an idle device read as their host work (a few ms here) and the
    2.5x plan as slower than eager: it was dropped so under FSDP2 on 2x H200. The steps before the plan and each
    reference chunk are timed up to where the device has run them."""
    device = DeviceWork(regions_win_on_a_fake_clock(monkeypatch))
    monkeypatch.setattr(StepTimer, "wait_for_device", lambda self: device.wait_for_device())
    fuse = device.fuse = FuseCallback(backend="aot_eager", cache_dir=False)
    trainer([device, fuse], max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0).fit(ToyTask(samples=16 * 90))
    pace = fuse.fit.pace
    assert pace.before_ms() >= 50.0 and pace.eager_ms() >= 50.0, (pace.before_ms(), pace.eager_ms())
    assert fuse.decision.winner == "regions" and "over its last" not in (fuse.fit.dropped or ""), fuse.fit.dropped


class SlowOptimizer(Callback):
    """Each optimizer step takes 50 ms on the guard's clock (a foreach AdamW with clipping, say)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.clock.now += 0.05


def test_a_slow_optimizer_step_is_not_taken_for_a_slow_plan(monkeypatch):
    """Without eager reference steps the guard compares the plan's whole steps with eager's whole steps before the
    plan, not with the search's eager forward+backward (10 ms here, beside steps of 50 ms)."""
    clock = regions_win_on_a_fake_clock(monkeypatch)
    fuse = FuseCallback(backend="aot_eager", cache_dir=False, eager_steps=0)
    t = trainer([fuse, SlowOptimizer(clock)], max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0)
    t.fit(ToyTask(samples=16 * 40))
    assert fuse.decision.winner == "regions" and fuse.fit.dropped is None and fuse.plan.name == "regions"


def test_rank_zeros_word_decides_once_per_window(monkeypatch):
    calls = []

    def rank_zero_says_fast(fuse):
        def broadcast(value, src=0):  # as if rank zero measured the plan faster than eager, wherever it is slow here
            calls.append((fuse.fit.steps, value))
            fast = lambda speedup: 2.0 if isinstance(speedup, float) and speedup < 1.0 else speedup
            return tuple(map(fast, value)) if isinstance(value, tuple) else fast(value)  # an epoch's end: a pair

        return broadcast

    fuse, probe = slow_regions_fit(monkeypatch, 70, broadcast=rank_zero_says_fast)
    activation, window = fuse.fit.activation_step, running_guard.GUARD_WINDOW
    after = [(step, value) for step, value in calls if step > activation]
    assert [step for step, _ in after] == [activation + window, activation + 2 * window, 70]  # 2 windows, epoch end
    assert all(value[0] < 0.9 for _, value in after[:2]), after  # this rank measured the plan slow at each window ...
    assert fuse.fit.dropped is None and set(probe.plans[activation:]) == {"regions"}  # ... rank zero's word kept it


def sizes_fill_at_step_10(monkeypatch, fits: list[FuseCallback]) -> None:
    """Faked on CPU: the trees under ``regions`` (standing in for ``reduce-overhead``) meet more sizes than they
    record from the newest fit of ``fits``' step 10 on, until the plan stops them."""
    full = property(lambda plan: plan.name == "regions" and fits[-1].fit.steps >= 10 and not plan._tree_sizes.stopped)
    monkeypatch.setattr(plan_module.Regions, "sizes_full", full)


def test_a_plan_whose_torch_graphs_met_more_sizes_than_they_record_stops_them_and_keeps_its_compiled_code(
        monkeypatch, caplog):  # fmt: skip
    """At the guard's window end after the sizes filled, the plan stops its trees, once: the same plan runs on,
    nothing compiled again, and the verdict says from which step it ran without graphs."""
    regions_win_on_a_fake_clock(monkeypatch)
    fuse = FuseCallback(backend="aot_eager", cache_dir=False, eager_steps=0)  # no epoch-end verdict on CPU's clock
    sizes_fill_at_step_10(monkeypatch, [fuse])
    probe = PlanPerStep(fuse)
    with caplog.at_level(logging.INFO):
        trainer([fuse, probe], max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0).fit(ToyTask(samples=16 * 80))
    activation, window = fuse.fit.activation_step, running_guard.GUARD_WINDOW
    assert set(probe.plans[activation:]) == {"regions"} and fuse.plan._tree_sizes.stopped
    assert fuse.fit.dropped is None and fuse.decision.winner == "regions"
    assert fuse.plan.reason == (f"chosen by measurement; no CUDA graphs from step {activation + window}: its graphs "
                                "reached their cap of sizes"), "at the first window's end, not before"
    assert fuse.fit.tracker.total_compiles == 1, "the regions compiled once, in the search"
    assert caplog.text.count("met more input sizes than one fit records") == 1
    assert "the plan runs its compiled code without graphs (nothing compiled again)" in caplog.text


def test_graphs_stopped_are_stored_in_the_cached_decision_so_the_next_run_runs_without_them(monkeypatch, tmp_path):
    """Faked on CPU as above, with a compile cache: the first fit stops the trees under ``regions`` and stores that;
    the second, on the same cache and inputs, runs ``regions`` without them from its plan's first step."""
    regions_win_on_a_fake_clock(monkeypatch)
    fits = [FuseCallback(backend="aot_eager", cache_dir=tmp_path, eager_steps=0)]
    sizes_fill_at_step_10(monkeypatch, fits)
    trainer(fits, max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0).fit(ToyTask(samples=16 * 40))
    assert fits[0].plan._tree_sizes.stopped and fits[0].decision.graphs_stopped is None, "stored, not in this fit's"
    fits.append(FuseCallback(backend="aot_eager", cache_dir=tmp_path, eager_steps=0))
    trainer(fits[1:], max_steps=8, limit_val_batches=0, num_sanity_val_steps=0).fit(ToyTask(samples=16 * 8))
    second = fits[1]
    assert second.decision.cached and second.decision.winner == "regions" and second.plan._tree_sizes.stopped
    assert second.decision.graphs_stopped.startswith("at step ")
    assert second.plan.reason.startswith("from the cached decision, without CUDA graphs (an earlier fit stopped them "
                                         "at step ")
    assert {t.name: t.outcome for t in second.decision.trials}["regions"].startswith("chosen; no CUDA graphs from")


def test_a_handover_is_stored_in_the_cached_decision_so_the_next_run_starts_with_the_successor(monkeypatch, tmp_path):
    """Faked on CPU: the trees under ``regions`` (for ``reduce-overhead``) free outputs the fit holds from step 10,
    so the first fit hands over to ``compile`` and stores that; the second, on the same cache and inputs, runs
    ``compile`` from its plan's first step."""
    regions_win_on_a_fake_clock(monkeypatch)
    monkeypatch.setitem(plan_module.WITHOUT_GRAPHS, "regions", ("compile",))
    first = FuseCallback(backend="aot_eager", cache_dir=tmp_path, eager_steps=0)
    held = property(lambda plan: plan.name == "regions" and first.fit.steps >= 10)
    monkeypatch.setattr(plan_module.Regions, "outputs_held", held)
    trainer([first], max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0).fit(ToyTask(samples=16 * 40))
    assert first.plan.name == "compile" and first.decision.winner == "regions", "the search chose, the fit handed over"
    second = FuseCallback(backend="aot_eager", cache_dir=tmp_path, eager_steps=0)
    probe = PlanPerStep(second)
    trainer([second, probe], max_steps=8, limit_val_batches=0, num_sanity_val_steps=0).fit(ToyTask(samples=16 * 8))
    assert second.decision.cached and second.decision.winner == "compile"
    assert set(probe.plans[second.fit.activation_step:]) == {"compile"}
    outcomes = {trial.name: trial.outcome for trial in second.decision.trials}
    assert outcomes["regions"].startswith("handed over at step") and outcomes["compile"].startswith(
        "chosen: handed over from 'regions' at step")


def test_a_handover_goes_to_the_first_graphless_candidate_the_fit_made():
    class Named(Plan):
        def __init__(self, name: str) -> None:
            self.name = name

    trees = Named("reduce-overhead")
    fit = FitState(candidates=[Plan(), trees, Named("regions")], plan=trees)  # regions = the whole network: no compile
    assert fit.graphless_candidate() == "regions"
    fit.candidates.append(Named("compile"))
    assert fit.graphless_candidate() == "compile"
    fit.plan = fit.candidates[-1]
    assert fit.graphless_candidate() is None, "a plan without torch's graphs has nothing to hand over to"
