"""Training patterns users bring to FuseCallback: does it still train, how fast, how often does it recompile?

Each (model, pattern, variant) trains in its own process; ``step_ms`` is per batch (a micro-batch under
gradient accumulation), ``steps`` the batches run, ``wall_s`` the fit from start to end (compiling included),
``final_loss`` the mean loss of the last 10 steps, ``recompiles`` FuseCallback's count, ``speedup_logged`` (with
``speedup_low``/``speedup_high``, its interval) and ``eager_step_ms_in_run`` what the fuse fit logged for its last
epoch (:func:`models.logged_speedup`), to hold against the separate fits' ratio, ``trained_share`` the share of the
trainable parameters the fit changed (:func:`trained_share`), ``cpu_ms`` the main thread's median CPU time a step,
``step_times`` each timed batch and ``reference_steps`` fuse's eager reference steps among them (:func:`step_times`),
``device_allocs`` each timed batch's ``cudaMalloc`` calls (CUDA; :class:`harness.StepClock`), and with
``--profile-steps`` the GPU kernels, the GPU's busy share and the host's waits for the device a batch, from a profile
of the batches before the timed ones (:class:`models.ProfiledSteps`); the variant ``fuse_unsampled`` (asked by name)
is fuse without its GPU sampler thread, to see whether the sampler changes what such a profile reads.
Models: ``llama`` (transformers), ``resnet50`` (torchvision) where the pattern applies, ``vit`` and ``deberta``
(fuse's plan for them is torch's cudagraph trees) for ``accumulate_clip``, ``bert`` and ``deberta`` (classifiers,
each batch padded to its longest text) for the varying lengths, and the recipe ``gpt`` with mixture-of-experts MLPs
for ``moe``; ``two_views`` calls the network twice on each batch before one backward (a consistency loss);
``generate_in_validation`` validates every quarter of the fit on 2 batches, each generating 64 tokens greedily
from its first 32 (``llama`` and ``bloom``; a validation's time falls in the step before it, which the median of
the timed steps leaves out, and in ``wall_s``; ``torch.compile(model)``'s wrapper is not the module that generates,
so the one lines generate eagerly, as FuseCallback does). On the GPU:

    python benchmarks/patterns.py --patterns all --budget-s 540
    python benchmarks/patterns.py --patterns varying_length --steps 230 --warmup 130 --budget-s 540
    python benchmarks/patterns.py --smoke --patterns moe,accumulate_clip --variants fuse   # CPU, the code path

Varying lengths are timed past their one-time costs, as the second line does: 8 untimed passes over the 16 lengths
hold every variant's compiles and graph recordings (torch's trees record a length at its second call, FuseCallback's
at its third, after its plan search), which inside a 100-step fit would sit in the timed steps of one variant only.

``--checks`` prints the issue's checks over a results file instead (:func:`checks`):

    python benchmarks/patterns.py --checks benchmarks/results/patterns.jsonl
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import models
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

FIELDS = ("model", "pattern", "batch_size", "variant", "step_ms", "steps", "wall_s", "final_loss", "recompiles",
          "most_recompiles", "compile_s", "plan", "graphs", "ran", "search", "speedup_logged", "speedup_low",
          "speedup_high", "eager_step_ms_in_run", "trained_share", "cpu_ms", "step_times", "reference_steps",
          "device_allocs", "kernels_per_step", "gpu_busy_frac", "syncs_per_step", "gpu_ms_per_step",
          "error")  # fmt: skip
HF, VISION = ("llama",), ("resnet50",)
ENCODERS = ("bert", "deberta")
"""Classifiers whose users pad each batch to its longest text (HF's ``DataCollatorWithPadding``); DeBERTa's forward
copies a tensor from the host (its relative positions)."""
TREES = ("vit", "deberta")
"""Models whose fuse plan at small batch is torch's cudagraph trees (``reduce-overhead``), as the zoo measured."""
GENERATORS = ("llama", "bloom")
"""Causal LMs for the validation that generates text: fuse's plan for Llama at small batch captures a graph of its
own (``compile+graph``), for Bloom it is torch's cudagraph trees."""
PROMPT, NEW_TOKENS = 32, 64
"""The validation's prompts (each batch's first tokens) and the tokens generated from them (smoke: 8 and 8)."""
ALL_VARIANTS = ("eager", "fuse", "reduce_overhead", "compile")
DERIVED = {"fuse_unsampled": ("fuse", {"gpu_sample_hz": 0}), "fuse_warm": ("fuse", {}),
           "fuse_trees": ("fuse", {"mode": "reduce-overhead", "targets": "model"})}
"""Variants of this benchmark's own, run only where asked by name (not in ``all``) and where the variant they run
does: (that variant, its FuseCallback arguments), as ``multi_gpu.DERIVED``. ``fuse_unsampled``: fuse without its
NVML sampler thread, to see with ``--profile-steps`` whether the sampler changes what a profile of fuse's steps
reads. ``fuse_warm``: fuse on the compile cache and decision a cold fuse fit left (:func:`launch`), to see what a
second run of the same training costs (its recompiles, compile time and wall); that cold fit is a whole ``fuse`` fit,
recorded as ``fuse``, so that both come from one call at the cost of one (ask for ``fuse_warm`` without ``fuse``).
``fuse_trees``: fuse forced to the search's ``reduce-overhead`` plan (the whole network under torch's cudagraph trees),
which no search precedes and whose trees, a forced mode's, are never stopped: what its steps cost once the trees met
more sizes than they record, beside ``fuse``'s, whose plan then runs without them."""
ONE_LINES = ("reduce_overhead", "compile")
"""The one-line alternatives fuse is held to: ``torch.compile(model)`` with ``mode="reduce-overhead"``, and without."""
CASE = ("model", "pattern", "batch_size")
"""The fields that name a case of the checks."""


class TwoOptimizers(models.Task):
    """GAN-style manual optimization: two optimizers over two halves of the parameters, one forward each."""

    def __init__(self, task: models.Task) -> None:
        super().__init__(task.model, task.loss_fn, task.data, task.lr)
        self.automatic_optimization = False

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        cuda = self.device.type == "cuda"
        half = len(params) // 2
        return [torch.optim.AdamW(group, lr=self.lr, fused=cuda) for group in (params[:half], params[half:])]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        for optimizer in self.optimizers():
            self.toggle_optimizer(optimizer)  # the other half's requires_grad goes off, as in Lightning's GAN example
            loss = self.loss_fn(self.model, batch)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            self.untoggle_optimizer(optimizer)
        return loss.detach()


class MoE(nn.Module):
    """Top-1 mixture of experts: each token goes to the expert its router picks (data-dependent shapes)."""

    def __init__(self, dim: int, experts: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)) for _ in range(experts)
        )

    def forward(self, x: Tensor) -> Tensor:  # (B, T, C)
        flat = x.flatten(0, 1)  # (B*T, C)
        weight, choice = self.router(flat).softmax(-1).max(-1)  # (B*T,) each
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().squeeze(1)  # how many: known only from the data
            out = out.index_add(0, rows, expert(flat[rows]) * weight[rows, None].to(flat.dtype))
        return out.view_as(x)


def varying_length(copies: int) -> Callable[[models.Task, dict], None]:
    """Batches padded to their longest sequence, padding masked out (and out of a causal LM's labels; a classifier
    keeps its labels), ``copies`` of each of the task's random batches cut to its own length: 4 copies give 16
    lengths that come again (a small dataset), 40 each step its own. Each batch's longest row is drawn from 1/8 to
    all of the model's length (so that the batches spread over ``pad_buckets``' sizes), its other rows from half
    that to all of it."""

    def apply(task: models.Task, spec: dict) -> None:
        batches = []
        for batch in task.data.batches * copies:
            ids = batch["input_ids"]
            longest = int(torch.randint(ids.shape[1] // 8, ids.shape[1] + 1, ()))
            lengths = torch.randint(longest // 2, longest + 1, (ids.shape[0],))
            lengths[0] = longest
            mask = (torch.arange(longest) < lengths[:, None]).long()
            ids_cut = ids[:, :longest].contiguous()  # as a collator pads them: a slice's strides would recompile
            labels = batch["labels"] if batch["labels"].dim() == 1 else ids_cut.masked_fill(mask == 0, -100)
            batches.append({"input_ids": ids_cut, "attention_mask": mask, "labels": labels})
        task.data.batches = batches

    return apply


def checkpointing(reentrant: bool) -> Callable[[models.Task, dict], None]:
    def apply(task: models.Task, spec: dict) -> None:
        task.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})

    return apply


def lora(task: models.Task, spec: dict) -> None:
    from peft import LoraConfig, get_peft_model  # a missing peft becomes the record's error

    task.model = get_peft_model(task.model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


def frozen_backbone(task: models.Task, spec: dict) -> None:
    head = list(task.model.children())[-1]  # lm_head, fc: the last child trains, the rest is frozen
    task.model.requires_grad_(False)
    head.requires_grad_(True)


def precompiled(task: models.Task, spec: dict) -> None:
    task.model.compile(backend="aot_eager" if spec["smoke"] else "inductor")


def moe(task: models.Task, spec: dict) -> None:
    for block in task.model.blocks:
        block.mlp = MoE(block.ln2.normalized_shape[0])


BUCKETS = (64, 128, 256, 512)
"""``pad_buckets`` of the ``varying_length_buckets`` pattern (the lengths of ``varying_length(4)``, padded)."""
LOSS_RTOL = LOSS_ATOL = 5e-2
"""How far a final loss may lie from eager's of the same steps (``math.isclose``): bf16's tolerance, as the tests
hold bf16 fits to eager's (``tests/user_models.BF16``); the absolute part for fits that memorise to near 0."""
LOSS_OFF = "†"
"""Marks a one-line fit whose final loss missed eager's of as many steps (:data:`LOSS_RTOL`)."""
OTHER_MACHINE = "§"
"""Marks an eager or one-line fit measured on another machine than fuse's (:func:`harness.other_machines`): not a
pair, so the checks that hold fuse to it do not count it (``zoo.py``'s ``*`` marks rows of two calls, still
counted). On the H200, one Llama's eager step was 61.4 ms in one call's fits, and fuse's 28.4 and 23.6 ms on two
machines (2026-11-30)."""
MOST_RECOMPILES = 2
"""Varying lengths without buckets: at most this many recompiles of any one region (the issue's check)."""
USER_COMPILED = ("precompiled",)
"""Patterns whose ``eager`` fit is the user's own compile (``model.compile()`` before the fit): fuse's logged speedup
is against eager (its reference steps bypass the user's compile, :class:`~lightning_fuse.plan.UserCompiled`), which
no fit here measured, so the checks show it without holding it to the separate fits' ratio."""
OVER_ONE_LINE = 1.05
"""``fuse`` at most this many times ``model.compile(mode="reduce-overhead")``'s step: the zoo's limit for the best
one line, so that a plan the search found and then passed over shows (the varying lengths, 2026-11-27)."""


def buckets(task: models.Task, spec: dict) -> dict:
    varying_length(4)(task, spec)
    return {"fuse": {"pad_buckets": (8, 16) if spec["smoke"] else BUCKETS}}


def clipped(task: models.Task, spec: dict) -> None:
    """Lightning clips under mixed precision only an optimizer that is not fused (fused AdamW unscales itself)."""
    task.fused = False


def two_views(task: models.Task, spec: dict) -> None:
    """The network called twice on the batch before one backward, as a consistency loss over two views trains
    (SimCSE, FixMatch, SimCLR): each call must keep its outputs and activations until the backward."""
    task.loss_fn = TwoCalls(task.loss_fn)


class TwoCalls:
    """``loss_fn`` of both calls, averaged."""

    def __init__(self, loss_fn: Callable) -> None:
        self.loss_fn = loss_fn

    def __call__(self, model: nn.Module, batch: Any) -> Tensor:
        return (self.loss_fn(model, batch) + self.loss_fn(model, batch)) / 2


def generate_in_validation(task: models.Task, spec: dict) -> None:
    """A validation loop that generates text (greedy) besides its loss, as summarization and instruction fine-tunes
    score their generations: an HF model's ``generate`` calls the network at a new cache length for every token."""
    prompt, new_tokens = (8, 8) if spec["smoke"] else (PROMPT, NEW_TOKENS)

    def validation_step(batch: dict, batch_idx: int) -> Tensor:  # a function: Lightning reads its __code__
        loss = task.model(**batch).loss
        start = batch["input_ids"][:, :prompt]
        task.model.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
        return loss

    task.validation_step = validation_step
    task.val_dataloader = lambda: DataLoader(models.Batches(task.data.batches, 2), batch_size=None)


def nothing(task: models.Task, spec: dict) -> None:
    """The pattern lives in the Trainer's arguments."""


PATTERNS: dict[str, tuple[tuple[str, ...], tuple[str, ...], Callable, dict]] = {
    "checkpointing": (HF, ALL_VARIANTS, checkpointing(False), {}),
    "checkpointing_reentrant": (HF, ALL_VARIANTS, checkpointing(True), {}),
    "lora": (HF, ALL_VARIANTS, lora, {}),
    "frozen_backbone": (HF + VISION, ALL_VARIANTS, frozen_backbone, {}),
    "two_optimizers": (HF + VISION, ALL_VARIANTS, nothing, {"optimizers": 2}),
    "accumulate_clip": (HF + VISION + TREES, ALL_VARIANTS, clipped,
                        {"accumulate_grad_batches": 4, "gradient_clip_val": 1.0}),
    "fp16_scaler": (HF + VISION, ALL_VARIANTS, nothing, {"precision": "16-mixed"}),
    "bf16_true": (HF + VISION, ALL_VARIANTS, nothing, {"precision": "bf16-true"}),
    "precompiled": (HF + VISION, ("eager", "fuse"), precompiled, {}),
    "varying_length": (HF + ENCODERS, ALL_VARIANTS, varying_length(4), {}),
    "varying_length_each": (HF + ENCODERS, ALL_VARIANTS, varying_length(40), {}),
    "varying_length_buckets": (HF, ("fuse",), buckets, {}),
    "moe": (("gpt",), ALL_VARIANTS, moe, {}),
    "two_views": (HF + VISION, ALL_VARIANTS, two_views, {}),
    "generate_in_validation": (GENERATORS, ALL_VARIANTS, generate_in_validation,
                               {"limit_val_batches": 2, "val_check_interval": 0.25}),
}
"""pattern -> (models it applies to, variants, ``apply(task, spec)`` returning extra FuseCallback arguments
under ``"fuse"``, Trainer arguments (``optimizers``: optimizer steps per batch))."""


def measure(spec: dict) -> dict:
    """One fit of one pattern and variant (in a child process)."""
    _, _, apply, trainer_kw = PATTERNS[spec["pattern"]]
    trainer_kw = dict(trainer_kw)
    optimizers = trainer_kw.pop("optimizers", 1)
    batches = spec["steps"] * trainer_kw.get("accumulate_grad_batches", 1)
    task, _ = models.build(spec["model"], spec["batch_size"], spec["smoke"], batches)
    extra = apply(task, spec) or {}
    task = TwoOptimizers(task) if optimizers == 2 else task
    initial = [param.detach().clone() for param in task.parameters() if param.requires_grad]
    started = time.perf_counter()
    variant, derived_kw = DERIVED.get(spec["variant"], (spec["variant"], {}))
    fuse_kw = {**extra.get("fuse", {}), **derived_kw}
    try:
        callbacks = models.apply_variant(task, variant, spec["smoke"], spec["cache_dir"], **fuse_kw)
    except TypeError as err:  # an argument this FuseCallback does not have yet
        return {"error": harness.describe(err)}
    marks = [models.ReferenceSteps(callbacks[0])] if callbacks and variant == "fuse" else []
    profile_steps = spec.get("profile_steps")
    profiled = [models.ProfiledSteps.before_timed(spec["warmup"], profile_steps)] if profile_steps else []
    result = harness.fit(task, DataLoader(task.data, batch_size=None), steps=spec["steps"] * optimizers,
                         warmup=spec["warmup"], callbacks=callbacks + marks + profiled, started=started,
                         **trainer_kw)  # fmt: skip
    info = models.fuse_info(callbacks)
    trained = trained_share(initial, [param for param in task.parameters() if param.requires_grad])
    return {**result, **info, **models.logged_speedup(info["history"]), "trained_share": trained,
            **step_times(result, spec["warmup"], marks[0].reference if marks else set()),
            **(profiled[0].result if profiled else {})}


def step_times(result: dict, warmup: int, reference: set[int]) -> dict[str, Any]:
    """Each timed batch's milliseconds in the fit's order (``step_times``, rounded to 0.01), and which of them were
    the FuseCallback's eager reference steps (``reference_steps``, indexes into ``step_times``): the same batches
    come in the same order in every variant's fit, so two fits compare batch by batch.

    Example::

        >>> step_times({"epoch_ms": {0: [10.123, 30.0], 1: [11.0]}}, warmup=5, reference={6, 2})
        {'step_times': [10.12, 30.0, 11.0], 'reference_steps': [1]}
    """
    times = [round(ms, 2) for epoch in sorted(result.get("epoch_ms", {})) for ms in result["epoch_ms"][epoch]]
    return {"step_times": times, "reference_steps": sorted(batch - warmup for batch in reference
                                                           if 0 <= batch - warmup < len(times))}  # fmt: skip


def trained_share(initial: list[Tensor], final: list[Tensor]) -> float:
    """The share of the trainable parameters' elements whose tensor the fit changed (``initial``: copies from
    before it): eager trains all of them, a variant that skips an optimizer's update trains less.

    Example::

        >>> trained_share([torch.zeros(3), torch.zeros(1)], [torch.ones(3), torch.zeros(1)])
        0.75
    """
    changed = sum(before.numel() for before, after in zip(initial, final, strict=True)
                  if not torch.equal(before, after.detach().to(before.device)))  # fmt: skip
    return changed / max(1, sum(before.numel() for before in initial))


def checks(records: list[dict]) -> str:
    """The real-models issue's pattern checks, as Markdown, over each model, pattern and batch's newest rows
    (``harness.newest_rows``): ``fuse``'s step over eager's (at most 1) and over the faster one line of
    :data:`ONE_LINES` where measured (at most :data:`OVER_ONE_LINE`, the zoo's limit; the cell names it), its final
    loss against eager's of as many steps (:data:`LOSS_RTOL`), and for varying lengths its recompiles of one region
    (at most :data:`MOST_RECOMPILES`; a record before ``most_recompiles`` gives the fit's total, an upper bound,
    starred), the CUDA graphs with buckets (at most one a bucket) and its fit's wall time against eager's plus fuse's
    compiling (``compile_s``); the bucketed pattern is held to the unbucketed one's eager and one-line fits, on the same
    batches. A loss is the run's last repeat's, its repeats' range in brackets (:func:`_loss`). A one-line fit whose
    final loss missed eager's is marked :data:`LOSS_OFF` and named with both losses (the check still holds fuse to
    it): on the GPU the one line of ``torch.compile`` left the second optimizer's half untrained under
    ``toggle_optimizer``. The logged speedup of :data:`USER_COMPILED` patterns is shown, not held to their separate
    fits (their eager fit is the user's compile). A check whose sides were not both measured is left out; the fits
    that crashed are named. Where several machines each ran fuse and a one line of a case, the spread of their ratios
    follows (:func:`machine_spread`).

    Example::

        >>> rows = [{"model": "m", "pattern": "varying_length", "batch_size": 8, "variant": "eager", "steps": 100,
        ...          "step_ms": 30.0, "final_loss": 2.0, "wall_s": 20.0},
        ...         {"model": "m", "pattern": "varying_length", "batch_size": 8, "variant": "fuse", "steps": 100,
        ...          "step_ms": 9.0, "final_loss": 2.05, "wall_s": 50.0, "compile_s": 40.0, "most_recompiles": 1,
        ...          "plan": "regions", "speedup_logged": 3.5, "speedup_low": 3.0, "speedup_high": 4.0}]
        >>> rows.append({**rows[0], "variant": "reduce_overhead", "step_ms": 6.0})
        >>> print(checks(rows).splitlines()[2])
        | m | varying_length | 8 | 30.00 | 9.00 | regions | 0.30 | 1.50 reduce_overhead | 2.05 / 2 | 1 | - | \
50 / 60 | 3.50 (3.00-4.00) / 3.33 |
        >>> print(checks(rows).splitlines()[-1])
        1 cases, 0 crashed fits; fuse <= eager in 1 of 1; <= 1.05x the best one line in 0 of 1; final loss \
within bf16's tolerance of eager's in 1 of 1; varying lengths: <= 2 recompiles of a region in 1 of 1, <= one graph a \
bucket in 0 of 0, wall <= eager's + compiling in 1 of 1; the logged interval holds the separate fits' ratio in \
1 of 1.
    """
    cases, crashes = harness.measured_cases(harness.newest_rows(records), CASE)
    judged = [_pattern_checks(case, variants, cases) for case, variants in sorted(cases.items(), key=str)]
    judged = [case for case in judged if case is not None]
    passed = {name: harness.passing(flags) for name, flags in
              harness.judged_values(judged, ("faster", "one_line", "loss", "recompiles", "graphs", "wall",
                                             "logged")).items()}  # fmt: skip
    verdicts = (f"fuse <= eager in {passed['faster']}; <= {OVER_ONE_LINE}x the best one line in "
                f"{passed['one_line']}; final loss within bf16's tolerance of eager's in "
                f"{passed['loss']}; varying lengths: <= {MOST_RECOMPILES} recompiles of a region in "
                f"{passed['recompiles']}, <= one graph a bucket in {passed['graphs']}, wall <= eager's + compiling in "
                f"{passed['wall']}; the logged interval holds the separate fits' ratio in "
                f"{passed['logged']}.")  # fmt: skip
    off = [case["line_off"] for case in judged if case["line_off"]]
    verdicts += f" {LOSS_OFF} The one line's final loss missed eager's: {', '.join(off)}." if off else ""
    machines = [case["other_machine"] for case in judged if case["other_machine"]]
    verdicts += (f" {OTHER_MACHINE} Not counted, fuse's fit and these ran on another machine: {', '.join(machines)}."
                 if machines else "")  # fmt: skip
    verdicts += machine_spread(records)
    header = ("| model | pattern | batch | eager ms | fuse ms | plan | over eager | over the best one line | loss, "
              "fuse / eager | most recompiles | graphs | wall s, fuse / eager + compiling | logged speedup "
              "(interval) / separate fits' |")  # fmt: skip
    return harness.checks_report(header, "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|", judged,
                                 crashes, verdicts)  # fmt: skip


def machine_spread(records: list[dict]) -> str:
    """fuse's step over the faster one line's on each machine that ran both in a case (each variant's newest row
    there; fuse's at the commit of the case's newest fuse row), for the cases more than one machine paired: the
    spread behind the checks' one pair (these machines drift 5-20% between runs). Empty where no case has two.

    Example::

        >>> rows = [{"model": "m", "pattern": "p", "batch_size": 8, "variant": variant, "step_ms": ms,
        ...          "machine": machine, "commit": "c1", "run_started": "2026-11-30"}
        ...         for machine, variant, ms in (("a", "fuse", 9.0), ("a", "compile", 10.0), ("b", "fuse", 12.0),
        ...                                      ("b", "compile", 10.0), ("c", "compile", 5.0))]
        >>> rows.append({**rows[-1], "variant": "fuse", "step_ms": 1.0, "commit": "c0", "run_started": "2026-11-29"})
        >>> machine_spread(rows)  # c's fuse ran an older library: c pairs nothing
        " Across machines, fuse over the faster one line (each machine's own pair): m p 8 at 0.90-1.20 (2 machines)."
    """
    newest = harness.newest_rows(records)
    fuse_commit = {_case(row): row.get("commit") for row in newest if row.get("variant") == "fuse"}
    kept = [row for row in records if row.get("machine")
            and (row.get("variant") != "fuse" or row.get("commit") == fuse_commit.get(_case(row)))]  # fmt: skip
    ratios: dict[tuple, list[float]] = {}
    for machine in sorted({row["machine"] for row in kept}):
        on_it = harness.newest_rows([row for row in kept if row["machine"] == machine])
        for case, variants in harness.measured_cases(on_it, CASE)[0].items():
            lines = [variants[variant]["step_ms"] for variant in ONE_LINES if variant in variants]
            if "fuse" in variants and lines:
                ratios.setdefault(case, []).append(variants["fuse"]["step_ms"] / min(lines))
    spread = [f"{' '.join(map(str, case))} at {min(r):.2f}-{max(r):.2f} ({len(r)} machines)"
              for case, r in sorted(ratios.items(), key=str) if len(r) > 1]  # fmt: skip
    said = "Across machines, fuse over the faster one line (each machine's own pair):"
    return f" {said} {'; '.join(spread)}." if spread else ""


def _case(row: dict) -> tuple:
    return tuple(row.get(field) for field in CASE)


def _pattern_checks(case: tuple, variants: dict[str, dict], cases: dict[tuple, dict[str, dict]]) -> dict | None:
    """One case's checks (``None`` where a side is missing) and its table line; ``None`` without fuse."""
    model, pattern, batch = case
    fuse = variants.get("fuse")
    if fuse is None:
        return None
    bucketed = pattern == "varying_length_buckets"
    sides = cases.get((model, "varying_length", batch), {}) if bucketed else variants
    eager = sides.get("eager")
    one_line = min((sides[v] for v in ONE_LINES if v in sides), key=lambda row: row["step_ms"], default=None)
    varying = pattern.startswith("varying_length")
    line_off = one_line is not None and not bucketed and _trains_like(one_line, eager) is False
    eager_elsewhere = eager is not None and harness.other_machines(fuse, eager)
    line_elsewhere = one_line is not None and harness.other_machines(fuse, one_line)
    paired = None if eager_elsewhere else eager  # step ratio, wall and logged speedup: one machine's fits only
    over = fuse["step_ms"] / eager["step_ms"] if eager else None
    over_line = fuse["step_ms"] / one_line["step_ms"] if one_line else None
    same_fit = eager if eager and eager.get("steps") == fuse.get("steps") else {}  # losses, wall: as many steps
    both_losses = None not in (fuse.get("final_loss"), same_fit.get("final_loss"))
    most = fuse.get("most_recompiles", fuse.get("recompiles"))
    star = "" if "most_recompiles" in fuse else "*"
    sides = (fuse.get("wall_s"), same_fit.get("wall_s"), fuse.get("compile_s"))
    wall = (sides[0], sides[1] + sides[2]) if None not in sides else None
    logged, holds = _logged(fuse, None if pattern in USER_COMPILED else paired)
    found = {"faster": over <= 1.0 if over is not None and paired else None,
             "one_line": over_line <= OVER_ONE_LINE if over_line is not None and not line_elsewhere else None,
             "loss": _trains_like(fuse, eager),
             "recompiles": most <= MOST_RECOMPILES if varying and not bucketed and most is not None else None,
             "graphs": fuse.get("graphs", 0) <= len(BUCKETS) if bucketed and fuse.get("graphs") is not None else None,
             "wall": wall[0] <= wall[1] if varying and wall and paired else None, "logged": holds}  # fmt: skip
    elsewhere = OTHER_MACHINE if eager_elsewhere else ""
    marks = (LOSS_OFF if line_off else "") + (OTHER_MACHINE if line_elsewhere else "")
    cells = [model, pattern, batch, harness.figure(eager and eager["step_ms"]), harness.figure(fuse["step_ms"]),
             fuse.get("plan") or "-", f"{harness.figure(over)}{elsewhere}",
             f"{over_line:.2f}{marks} {one_line['variant']}" if one_line else "-",
             f"{_loss(fuse)} / {_loss(same_fit)}" if both_losses else "-",
             f"{most}{star}" if varying and most is not None else "-",
             fuse.get("graphs") if bucketed and fuse.get("graphs") is not None else "-",
             f"{wall[0]:.0f} / {wall[1]:.0f}{elsewhere}" if varying and wall else "-", logged]  # fmt: skip
    apart = [side for side, off in (("eager", eager_elsewhere), ("the one line", line_elsewhere)) if off]
    return {**found, "line_off": _missed(pattern, one_line, eager) if line_off else None,
            "other_machine": f"{model} {pattern} ({' and '.join(apart)})" if apart else None,
            "line": "| " + " | ".join(map(str, cells)) + " |"}  # fmt: skip


def _loss(row: dict) -> str:
    """A row's final loss, and the range of its run's repeats in brackets where pooled (``final_loss_range``).

    Example::

        >>> _loss({"final_loss": 2.692, "final_loss_range": "2.56-2.69"}), _loss({"final_loss": 2.53})
        ('2.69 (2.56-2.69)', '2.53')
    """
    spread = row.get("final_loss_range")
    return f"{row['final_loss']:.3g}" + (f" ({spread})" if spread else "")


def _missed(pattern: str, one_line: dict, eager: dict) -> str:
    """A one-line fit whose loss missed eager's: both losses, and the shares of the parameters each trained where
    recorded (``trained_share``).

    Example::

        >>> _missed("two_optimizers", {"final_loss": 3.29, "trained_share": 0.5}, {"final_loss": 0.335,
        ...                                                                       "trained_share": 1.0})
        'two_optimizers (3.29 / 0.335; it trained 0.50 of the parameters, eager 1.00)'
    """
    shares = (one_line.get("trained_share"), eager.get("trained_share"))
    trained = f"; it trained {shares[0]:.2f} of the parameters, eager {shares[1]:.2f}" if None not in shares else ""
    return f"{pattern} ({one_line['final_loss']:.3g} / {eager['final_loss']:.3g}{trained})"


def _logged(fuse: dict, eager: dict | None) -> tuple[str, bool | None]:
    """The fuse fit's logged speedup with its interval beside the separate fits' ratio (eager's step over fuse's),
    and whether the interval holds it (``None`` where a side is missing; without ``eager``, the logged speedup
    alone).

    Example::

        >>> _logged({"step_ms": 8.74, "speedup_logged": 18.7, "speedup_low": 13.6, "speedup_high": 26.6},
        ...         {"step_ms": 64.97})
        ('18.70 (13.60-26.60) / 7.43', False)
    """
    logged, low, high = (fuse.get(key) for key in ("speedup_logged", "speedup_low", "speedup_high"))
    if logged is None:
        return "-", None
    interval = f" ({low:.2f}-{high:.2f})" if None not in (low, high) else ""
    if not eager:
        return f"{logged:.2f}{interval} / -", None
    true = eager["step_ms"] / fuse["step_ms"]
    return f"{logged:.2f}{interval} / {true:.2f}", low <= true <= high if interval else None


def _trains_like(row: dict, eager: dict | None) -> bool | None:
    """Whether ``row``'s fit ended at eager's final loss of as many steps, within bf16's tolerance
    (:data:`LOSS_RTOL`; ``None`` where not both measured).

    Example::

        >>> _trains_like({"steps": 100, "final_loss": 3.29}, {"steps": 100, "final_loss": 0.34})
        False
    """
    if not eager or eager.get("steps") != row.get("steps") or None in (row.get("final_loss"), eager.get("final_loss")):
        return None
    return math.isclose(row["final_loss"], eager["final_loss"], rel_tol=LOSS_RTOL, abs_tol=LOSS_ATOL)


def launch(runner: harness.Runner, spec: dict, env: dict) -> dict:
    """One job's fit in its own process; for ``fuse_warm``, first a whole cold ``fuse`` fit on the same fresh cache,
    recorded as ``fuse``. Where that fit fails or the budget skips it, its error is the warm job's record too."""
    if spec["variant"] == "fuse_warm":
        cold = runner.launch("patterns.py", {**spec, "variant": "fuse"}, env, kind="cold")
        runner.write({**spec, "variant": "fuse", **cold})
        if cold.get("error"):
            return cold
    return runner.launch("patterns.py", spec, env, kind=spec["variant"])


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "patterns.jsonl", models="all", batches="small", variants=ALL_VARIANTS, steps=100,
                       warmup=30)  # fmt: skip
    p.add_argument("--patterns", default="all", help=f"a comma list of {', '.join(PATTERNS)}, or all")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many batches right before the timed ones (models.ProfiledSteps; CUDA)")
    p.add_argument("--checks", type=Path, help="print the issue's checks over these records (checks), and stop")
    args = p.parse_args(argv)
    if args.checks is not None:
        print(checks(harness.read_records(args.checks)))
        return 0
    steps, warmup = (4, 2) if args.smoke else (args.steps, args.warmup)
    wanted = list(ALL_VARIANTS) if args.variants == "all" else harness.split(args.variants, (*ALL_VARIANTS, *DERIVED))
    if {"fuse", "fuse_warm"} <= set(wanted):
        raise SystemExit("fuse_warm runs and records a cold fuse fit first: ask for fuse_warm without fuse")
    regimes = models.regimes(args, tuple(dict.fromkeys(HF + VISION + TREES + ENCODERS + GENERATORS + ("gpt",))))
    groups = [[{"model": model, "pattern": pattern, "batch_size": batch, "variant": variant, "steps": steps,
                "warmup": warmup, "smoke": args.smoke, "profile_steps": args.profile_steps}
               for variant in wanted if DERIVED.get(variant, (variant,))[0] in PATTERNS[pattern][1]]
              for pattern in harness.split(args.patterns, list(PATTERNS))
              for model, batch in regimes if model in PATTERNS[pattern][0]]
    return harness.run(args, "patterns.py", measure, FIELDS, groups, launch)


if __name__ == "__main__":
    sys.exit(main())
