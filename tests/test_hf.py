"""Hugging Face models in a LightningModule, fitted on CPU with ``FuseCallback(backend="aot_eager")``.

A tiny GPT-2 and a tiny BERT classifier (dropout on, padded batches with an attention mask) are called the usual
way, ``self.model(input_ids=..., attention_mask=..., labels=...).loss``. The plan search runs for real (no pinned
timings): whatever it chooses, the decision must list every candidate with its outcome, and the printed verdict
and the summary must name the plan. A compiled backward that raises on the fit's first compiled step must cost
the plan, not the run, and leave the training exactly as an eager fit's.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import pickle
import re
from dataclasses import dataclass

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

pytest.importorskip("transformers")

from lightning_fuse import FuseCallback, compat
from lightning_fuse.kv_cache import EagerGeneration, NoCacheInTraining
from tests.user_models import (
    BATCH,
    HFTask,
    Run,
    ShardedHFTask,
    assert_same_training,
    fit,
    fuse,
    one_thread,  # noqa: F401 - an autouse fixture: one intra-op thread in this module
    pin_search,
    tiny_bert_classifier,
    tiny_gpt2,
    tiny_opt,
)

OUTCOME = re.compile(r"(chosen|slower than \S+|not clearly faster than \S+?(, tried first)?: within its noise)"
                     r"( \(timed beside eager only\))?|slower than eager: [\d.]+x its slower timing, not timed again"
                     r"|failed: .+|skipped: .+")
MODELS = {
    "gpt2": lambda: HFTask(tiny_gpt2()),
    "bert": lambda: HFTask(tiny_bert_classifier(), classify=True),  # dropout 0.1 (BERT's default) stays on
}


@dataclass
class Reported:
    run: Run
    cb: FuseCallback
    printed: str
    logged: str


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module", params=sorted(MODELS))
def reported(request) -> Reported:
    """One fit per model with the real plan search; what it printed and what lightning_fuse logged."""
    torch._dynamo.reset()
    handler, logger = _Lines(), logging.getLogger("lightning_fuse")
    saved_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    stdout = io.StringIO()
    try:
        cb = fuse()
        with contextlib.redirect_stdout(stdout):
            run = fit(MODELS[request.param], [cb])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved_level)
        torch._dynamo.reset()
    return Reported(run, cb, stdout.getvalue(), "\n".join(handler.lines))


def test_fit_completes_with_every_step_trained(reported):
    run = reported.run
    assert run.trainer.state.finished and run.trainer.global_step == 24
    assert all(torch.isfinite(torch.tensor(step["loss"])) for step in run.losses)
    assert all(m._compiled_call_impl is None for m in run.task.modules())


def test_decision_lists_every_candidate_with_its_outcome(reported):
    cb = reported.cb
    decision = cb.decision
    assert decision is not None and not decision.cached
    names = [trial.name for trial in decision.trials]
    assert names == [plan.name for plan in cb.fit.candidates] == ["eager", "regions", "compile"]
    for trial in decision.trials:
        assert OUTCOME.fullmatch(trial.outcome), trial
        judged = trial.outcome.startswith(("chosen", "slower than", "not clearly faster"))
        assert (trial.ms is not None) == (judged and not trial.outcome.endswith("only)")), "a judged row has a time"
    assert [t.name for t in decision.trials if t.outcome.startswith("chosen")] == [decision.winner]
    assert cb.plan.name in names
    if cb.fit.dropped is None:
        assert cb.plan.name == decision.winner
    else:  # measured slower than eager in the fit itself: the rest trained eagerly
        assert cb.plan.name == "eager"
    # an epoch's row names the plan it ran under: a plan dropped at the last epoch's end (not mid-epoch by the
    # running guard, "over its last ... steps") ran that epoch, and the fit ends eager
    last = cb.history[-1]
    dropped_at_the_end = (cb.fit.dropped is not None and cb.fit.dropped_in_epoch == int(last["epoch"])
                          and "over its last" not in cb.fit.dropped)  # fmt: skip
    assert last["plan"] == (decision.winner if dropped_at_the_end else cb.plan.name)
    for line, trial in zip(decision.lines(), decision.trials):
        assert line.startswith(trial.name) and line.endswith(trial.outcome)


def test_printed_verdict_names_the_plan(reported):
    cb = reported.cb
    verdicts = [line for line in reported.printed.splitlines() if line.startswith("FuseCallback:")]
    assert len(verdicts) == 1, reported.printed
    assert cb.plan.name in verdicts[0] or (cb.fit.dropped is not None and cb.decision.winner in verdicts[0])


def test_summary_names_the_plan(reported):
    assert f"FuseCallback plan: {reported.cb.plan.name}" in reported.logged, reported.logged


# ---------------------------------------------------------------------------------------------- fault injection
class FirstCompiledStep(Callback):
    """Arms the fault at the fit's first step that runs the plan (after FuseCallback's own hook, so it knows)."""

    def __init__(self) -> None:
        self.cb: FuseCallback | None = None
        self.armed = False
        self.armed_at: int | None = None
        self.raised = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        guard = self.cb.fit.hooks.guard
        if self.armed_at is None and guard is not None and guard.armed:
            self.armed, self.armed_at = True, trainer.global_step


def failing_backward_backend(fault: FirstCompiledStep):
    """``aot_eager`` whose compiled backward raises once, when ``fault`` is armed."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def backward_compiler(gm, example_inputs):
        def run(args):
            if fault.armed:
                fault.armed = False
                fault.raised += 1
                raise RuntimeError("injected failure in a compiled backward")
            return gm(*args)

        run._boxed_call = True
        return run

    return aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=backward_compiler)


@pytest.mark.parametrize("mode", ["auto", "default"])
def test_a_compiled_backward_that_raises_costs_the_plan_not_the_run(monkeypatch, mode):
    if mode == "auto":
        pin_search(monkeypatch, "regions")  # the search chooses regions; its own backwards do not raise
    make = lambda: HFTask(tiny_gpt2(use_cache=False))
    eager = fit(make)
    fault = FirstCompiledStep()
    cb = fault.cb = FuseCallback(mode=mode, cache_dir=False, backend=failing_backward_backend(fault))
    with pytest.warns(UserWarning, match="injected failure in a compiled backward"):
        fused = fit(make, [cb, fault])
    assert fault.raised == 1 and fault.armed_at is not None
    if mode == "auto":
        assert cb.decision.winner == "regions"
    assert "injected failure in a compiled backward" in cb.fit.dropped
    assert cb.fit.hooks.guard.redone_steps == 1
    assert cb.plan.name == "eager"  # dropped: the rest of the fit trained eagerly
    assert_same_training(fused, eager)


def test_gpt2_with_its_default_kv_cache_trains_with_forced_regions():
    make = lambda: HFTask(tiny_gpt2())
    eager = fit(make)
    cb = fuse(mode="default")
    fused = fit(make, [cb])
    assert cb.fallbacks == {}
    assert_same_training(fused, eager)


class CacheSpy(Callback):
    """Records whether each training forward of the network returned a KV cache, and whether it was an eager step."""

    def __init__(self, fuse: FuseCallback) -> None:
        self.fuse = fuse
        self.caches: list[bool] = []
        self.eager: list[bool] = []
        self.handle = None

    def on_fit_start(self, trainer, pl_module):
        self.handle = pl_module.model.register_forward_hook(self.spy)

    def spy(self, module, args, out):
        self.caches.append(getattr(out, "past_key_values", None) is not None)
        self.eager.append(not self.fuse.fit.hooks.no_cache.enabled)

    def on_fit_end(self, trainer, pl_module):
        self.handle.remove()


def test_a_causal_lm_trains_without_its_kv_cache_and_its_config_is_left_as_it_was():
    cb = fuse(mode="default")  # the plan is beside the point: every training call passes through the hook
    spy = CacheSpy(cb)
    run = fit(lambda: HFTask(tiny_gpt2()), [cb, spy])
    model = run.task.model
    assert model.config.use_cache is True  # the user's config: never edited
    plan_steps = [cache for cache, eager in zip(spy.caches, spy.eager) if not eager]
    eager_steps = [cache for cache, eager in zip(spy.caches, spy.eager) if eager]
    assert plan_steps and not any(plan_steps)  # no step of the plan built a cache
    assert eager_steps and all(eager_steps)  # eager steps (the reference) run the user's call as written
    assert not model._forward_pre_hooks  # the hook is gone after the fit
    model.train()
    assert model(input_ids=torch.randint(0, 64, (2, 8))).past_key_values is not None  # the default is back
    eager = fit(lambda: HFTask(tiny_gpt2()))
    assert_same_training(run, eager)


class GeneratesInValidation(HFTask):
    """Its validation generates 16 tokens greedily from each batch's first 4, as a summarization fine-tune scores
    its generations: ``generate`` calls the network at a new cache length for every token, in eval mode."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.generated: list[torch.Tensor] = []

    def validation_step(self, batch, batch_idx):
        input_ids, attention_mask, _ = batch
        self.generated.append(self.model.generate(input_ids[:, :4], attention_mask=attention_mask[:, :4],
                                                  max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                                  pad_token_id=0))  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=BATCH)


def test_a_validation_that_generates_text_generates_eagerly_and_keeps_the_plan(recwarn, caplog):
    """``generate`` runs eagerly, so its cache lengths compile nothing (sixty-fourth session: on an H200, Bloom's
    generation in validation compiled and recorded CUDA graphs for about a minute under FuseCallback, while the one
    line by hand, ``torch.compile(model)``, generated eagerly); it is said once, and taken off at the fit's end."""
    make = lambda: GeneratesInValidation(tiny_gpt2())
    eager = fit(make, limit_val_batches=2)
    cb = fuse(mode="default")
    with caplog.at_level("INFO"):
        fused = fit(make, [cb], limit_val_batches=2)
    assert_same_training(fused, eager)
    assert len(fused.task.generated) == len(eager.task.generated) == 4
    for got, want in zip(fused.task.generated, eager.task.generated):
        assert torch.equal(got, want)
    assert cb.plan.name == "regions" and cb.fit.dropped is None and cb.fallbacks == {}
    assert not [w for w in recwarn if "recompiled" in str(w.message)]
    assert all(stats.recompiles == 0 for stats in cb.fit.tracker.regions.values())
    assert caplog.text.count("GPT2LMHeadModel.generate runs eagerly") == 1
    assert "generate" not in vars(fused.task.model)


def test_eager_generation_leaves_a_static_cache_to_hf_and_copies_with_the_module():
    class Wrapper(torch.nn.Module):  # as peft's PeftModelForCausalLM: its generate is the base model's
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.base_model = model

        def generate(self, **kwargs):
            return self.base_model.generate(**kwargs)

    stances = []
    model = tiny_gpt2()
    model.eval()
    wrapper = Wrapper(model)
    eager = EagerGeneration(wrapper)
    assert eager.modules == [model]
    spy = model.register_forward_pre_hook(lambda *args: stances.append(compat.active_stance()))
    prompt = torch.randint(0, 64, (1, 4))
    eager.install()
    try:
        wrapper.generate(input_ids=prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert set(stances) == {"force_eager"}
        stances.clear()
        model.generate(input_ids=prompt, max_new_tokens=2, do_sample=False, pad_token_id=0,
                       cache_implementation="static")  # fmt: skip
        assert stances and set(stances) == {"default"}
        spy.remove()
        copied = copy.deepcopy(model)
        assert copied.generate.module is copied and pickle.loads(pickle.dumps(model)).generate.module is not model
    finally:
        eager.uninstall()
    assert "generate" not in vars(model) and "generate" in vars(copied)


def test_opt_whose_dropout_is_a_function_fails_no_candidate_on_its_masks():
    """Before FuseCallback watched the generator, every compiled candidate of OPT failed its check against eager's
    output and loss (other dropout masks: no ``nn.Dropout`` layer said the calls were random) and the fit kept
    eager (seen with inductor on CPU; no GPU has run OPT here)."""
    cb = fuse()
    fit(lambda: HFTask(tiny_opt()), [cb], max_epochs=1)
    outcomes = [trial.outcome for trial in cb.decision.trials]
    assert len(outcomes) > 1 and not [outcome for outcome in outcomes if outcome.startswith("failed")], outcomes
    assert not cb.fallbacks


def test_a_user_passing_use_cache_keeps_it():
    model = tiny_gpt2()
    no_cache = NoCacheInTraining(model)
    no_cache.install()
    try:
        assert model(input_ids=torch.randint(0, 64, (2, 8)), use_cache=True).past_key_values is not None
        assert model(input_ids=torch.randint(0, 64, (2, 8))).past_key_values is None
    finally:
        no_cache.uninstall()
    assert not NoCacheInTraining(torch.nn.Linear(2, 2)).applies


def test_use_cache_is_passed_only_where_a_forward_names_it_itself_or_through_a_wrapped_model():
    """transformers 5's BERT classifier has ``use_cache`` on in its config and ``**kwargs`` in its forward, yet
    builds no cache: FuseCallback once said it "takes use_cache" (BERT, ESM, LayoutLM). A peft-style wrapper,
    ``forward(*args, **kwargs)`` around a causal LM, does pass it on."""
    class Wrapper(torch.nn.Module):  # as peft's PeftModelForCausalLM
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.base_model, self.config = model, model.config

        def get_base_model(self) -> torch.nn.Module:
            return self.base_model

        def forward(self, *args, **kwargs):
            return self.base_model(*args, **kwargs)

    bert = tiny_bert_classifier()
    assert bert.config.use_cache is True and not NoCacheInTraining(bert).applies
    assert not NoCacheInTraining(Wrapper(bert)).applies
    assert NoCacheInTraining(Wrapper(tiny_gpt2())).applies


def test_the_network_compiled_whole_does_not_recompile_on_the_cache_hook():
    """``compile+graph`` compiles the network with its hooks: the hook must read nothing that changes after the
    first call (it once flipped an "announced" flag there, which recompiled the network and cost it its graph)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = tiny_gpt2()
    no_cache = NoCacheInTraining(model)
    no_cache.install()
    model.compile(backend="eager")
    try:
        model(input_ids=torch.randint(0, 64, (2, 8)))
        compiled = counters["frames"]["total"]
        for _ in range(2):
            model(input_ids=torch.randint(0, 64, (2, 8)))
    finally:
        no_cache.uninstall()
    assert counters["frames"]["total"] == compiled  # no frame compiled again


def test_the_search_replays_the_call_as_the_training_step_makes_it(monkeypatch):
    """A graph captured in the search must match the training calls: their signature is the call before any hook
    (``use_cache=False`` is added inside), or the plan would run without its graph."""
    import lightning_fuse.choice as choice_module

    seen: list[dict] = []

    class Spy(choice_module.TrialCall):
        def __init__(self, module, args, kwargs, **options):
            seen.append(dict(kwargs))
            super().__init__(module, args, kwargs, **options)

    monkeypatch.setattr(choice_module, "TrialCall", Spy)
    fit(lambda: HFTask(tiny_gpt2()), [fuse()])
    assert seen and sorted(seen[0]) == ["attention_mask", "input_ids", "labels"]


def test_the_whole_network_compiled_is_checked_against_eager_called_as_its_hooks_call_it(monkeypatch):
    """A compiled region's first output is checked against its eager forward run alone, without the hooks: the
    check must be handed ``use_cache=False`` as the hook handed it to the compiled call. It was not, and a causal
    LM without dropout (checked in training) compiled whole fell back: "2 outputs against 3 from eager"."""
    pin_search(monkeypatch, "compile")
    cb = fuse()
    fit(lambda: HFTask(tiny_gpt2()), [cb])
    assert cb.decision.winner == "compile", cb.decision.lines()
    assert cb.plan.name == "compile" and not cb.fallbacks, cb.fallbacks


@pytest.mark.skipif(not torch.distributed.is_available(), reason="FSDP2 needs torch.distributed")
def test_a_sharded_causal_lm_compiled_whole_is_checked_without_its_cache_too(monkeypatch):
    """Under FSDP2 the check reruns the whole network's call, whose hooks gather its shards; it must run without
    the KV cache as the training call did. It ran with it, and on 2x H200 the candidate that compiles GPT-2 whole
    fell back ("2 outputs against 3 from eager")."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    pin_search(monkeypatch, "compile")
    cb = fuse()
    try:
        fit(lambda: ShardedHFTask(tiny_gpt2()), [cb], strategy=ModelParallelStrategy())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert cb.decision.winner == "compile", cb.decision.lines()
    assert cb.plan.name == "compile" and not cb.fallbacks, cb.fallbacks
