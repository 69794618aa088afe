"""DDP and FSDP on 2 GPUs: does FuseCallback's plan pay with several processes? (``models.VARIANTS``)

Each (model, strategy, batch, variant) is one launch: Lightning starts the second process itself
(``Trainer(devices=2, strategy="ddp"|"fsdp")``, FSDP with one unit per repeated block; ``fsdp2``: Lightning's
``ModelParallelStrategy`` with FSDP2's ``fully_shard`` on each repeated block and the network). ``batch_size`` is per
rank, and each rank trains on its own batch at every step; ``step_ms`` is rank 0's median step after the warmup
(``step_ms_q1``/``q3``: its quartiles). The fit runs in :data:`EPOCHS` epochs, and a ``fuse`` record adds what
FuseCallback logged on rank zero for the last one, which holds no compile nor search: ``speedup_logged`` and each
rank's GPU utilisation (``gpu_util_ranks``, %).

The losses: the networks run without dropout, so that every variant's losses can be held against eager's.
``loss_ranks`` is each rank's mean loss over the last steps, ``loss_curves`` each rank's mean loss over each tenth
of the fit. ``eager_fp32`` is eager in full precision (``32-true``): how far it lands from eager's ``bf16-mixed``
losses is bf16's own rounding, carried through the fit, and so the tolerance that another variant's distance from
eager is held to (``--losses`` prints both). ``eager_deterministic`` is eager with torch's deterministic kernels
(``Trainer(deterministic="warn")``): another correct path through the same fit, to tell how far a training
trajectory alone moves when only the kernels' rounding changes; ``eager_repeat`` is eager launched again, how far
eager's own curve moves from one launch to the next (not every CUDA kernel adds in a fixed order);
``eager_exact_reductions`` is eager with cuBLAS's
split-K reductions kept in float32 (torch lets them round to bf16 by default; compiled code meets that rounding
less often, and ``gradients.py`` finds its gradients closer to full precision than eager's), and ``--losses``
holds every variant to it too, within bf16's own ``rtol`` (``harness.BF16_RTOL``). ``--seed`` starts
the models and batches from another seed (a record's ``seed``; ``--losses`` holds each seed against its own eager),
so that one trajectory is not taken for a rule. The default fit memorises four random batches, and a change of
rounding can reroute its curve anywhere (``benchmarks/RESULTS.md``). ``--data markov`` trains a causal LM on
batches of Markov-chain text instead, a new one at every step of an epoch (``models.markov_batches``), and
``--scheduler`` warms its learning rate up: a fit that learns (a record's ``data`` and ``scheduler``; ``--losses``
holds each fit to its own eager, then every variant to full precision). The variant ``fuse_idle`` is
``FuseCallback(targets=[])``, the callback's own cost as it compiles nothing (``fuse_idle_unsampled``: without its
NVML sampler);
``fuse_no_graph`` and ``fuse_no_optimizer_graph`` leave out the network's CUDA graph or the optimizer's,
``fuse_emulated_casts`` has inductor round each intermediate to bf16 where eager's op would (its
``emulate_precision_casts``: a fused kernel otherwise keeps them in float32), and
``fuse_forced_graph`` forces the whole network compiled under one graph without a search
(``fuse_forced_graph_noref``: and without eager reference steps; ``fuse_forced_compile``: the same schedule with
no graph; ``fuse_forced_compile_eager_update``: nor the optimizer's; ``fuse_forced_compile_unverified``: nor the
check of its first output against eager; ``fuse_forced_compile_unverified_noref``: nor eager reference steps), to
find which piece moves the losses or the time. On a machine with 2 GPUs:

    python benchmarks/multi_gpu.py --models gpt2,resnet50 --strategies ddp,fsdp --budget-s 540
    python benchmarks/multi_gpu.py --losses benchmarks/results/multi_gpu.jsonl   # each variant's loss gap, fuse's count
    python benchmarks/multi_gpu.py --checks benchmarks/results/multi_gpu.jsonl   # the issue's speed checks
    python benchmarks/multi_gpu.py --models gpt2 --batches small --strategies ddp --data markov --scheduler \
        --variants eager,eager_fp32,fuse   # losses on a fit that learns
    python benchmarks/multi_gpu.py --smoke --models gpt --variants eager,fuse   # CPU: gloo, 2 processes
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness
import lightning.pytorch as pl
import models
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn

from lightning_fuse import compat

FIELDS = ("model", "strategy", "world_size", "batch_size", "seed", "data", "scheduler", "variant", "step_ms",
          "step_ms_q1", "step_ms_q3", "final_loss", "loss_ranks", "loss_curves", "speedup_logged", "gpu_util_ranks",
          "plan", "ran", "search", "loss_steps", "eager_steps", "error")  # fmt: skip
FORCED_COMPILE = {"targets": "full", "mode": "default", "cuda_graph": False}
"""FuseCallback's arguments that force the whole network compiled, with no search (the ``fuse_forced_*`` variants)."""
FORCED_GRAPH = {**FORCED_COMPILE, "cuda_graph": True}
DERIVED = {"eager_fp32": ("eager", {"precision": "32-true"}, {}), "eager_repeat": ("eager", {}, {}),
           "eager_deterministic": ("eager", {"deterministic": "warn"}, {}), "eager_exact_reductions": ("eager", {}, {}),
           "fuse_idle": ("fuse", {}, {"targets": []}),
           "fuse_idle_unsampled": ("fuse", {}, {"targets": [], "gpu_sample_hz": 0}),
           "fuse_no_graph": ("fuse", {}, {"cuda_graph": False}),
           "fuse_no_optimizer_graph": ("fuse", {}, {"optimizer_graph": False}),
           "fuse_emulated_casts": ("fuse", {}, models.EMULATED_CASTS),
           "fuse_forced_graph": ("fuse", {}, FORCED_GRAPH),
           "fuse_forced_compile": ("fuse", {}, FORCED_COMPILE),
           "fuse_forced_compile_eager_update": ("fuse", {}, {**FORCED_COMPILE, "optimizer_graph": False}),
           "fuse_forced_compile_unverified": ("fuse", {}, {**FORCED_COMPILE, "optimizer_graph": False,
                                                           "verify": False}),
           "fuse_forced_compile_unverified_noref": ("fuse", {}, {**FORCED_COMPILE, "optimizer_graph": False,
                                                                 "verify": False, "eager_steps": 0}),
           "fuse_forced_graph_noref": ("fuse", {}, {**FORCED_GRAPH, "eager_steps": 0})}  # fmt: skip
"""Variants of this benchmark's own: (the variant they run, its Trainer arguments, its FuseCallback arguments)."""
TOLERANCES = {"eager": ("eager_fp32", 1.0), "eager_fp32": ("eager", harness.WITHIN_RATIO)}
"""``loss_gaps``'s references whose tolerance another variant's gap sets: (that variant, how many times its gap)."""
MATMUL_FLAGS = {"eager_exact_reductions": {"allow_bf16_reduced_precision_reduction": False}}
"""Variants that set ``torch.backends.cuda.matmul`` flags for the whole fit, on every rank."""
VARIANTS = (*models.VARIANTS, *DERIVED)
STRATEGIES = ("ddp", "fsdp", "fsdp2")
"""DDP, FSDP (Lightning's ``FSDPStrategy``), FSDP2 (``ModelParallelStrategy`` and ``fully_shard``)."""
SPEED_VARIANTS = ("eager", "compile", "fuse")
"""The variants the issue's speed checks compare (:func:`checks`)."""
CURVE_POINTS = 10
"""``loss_curves``: the fit's steps in this many blocks, each block's mean loss."""
EPOCHS = 2
"""The fit's epochs: FuseCallback's scalars are per epoch, and the first holds the compile and the search."""


class RankLosses(pl.Callback):
    """Every rank's training losses (copied, with no sync per step), gathered on every rank at the fit's end, and
    which steps ran under ``set_stance("force_eager")`` (FuseCallback's eager reference steps)."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.ranks: list[float] = []
        self.curves: list[list[float]] = []
        self.eager_steps: list[int] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if compat.active_stance() == "force_eager":
            self.eager_steps.append(trainer.global_step)

    def rounded(self) -> list[float]:
        """This rank's loss at every step, to four significant digits."""
        return [float(f"{loss:.4g}") for loss in torch.stack(self.losses).tolist()] if self.losses else []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(loss.detach().float().clone())  # a CUDA graph's output is overwritten next step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.losses:
            return
        losses = torch.stack(self.losses)
        last = losses[-harness.LOSS_WINDOW :].mean()
        curve = torch.stack([block.mean() for block in losses.tensor_split(min(CURVE_POINTS, len(losses)))])
        gather = trainer.strategy.all_gather  # a collective: every rank calls it
        self.ranks = gather(last).flatten().tolist()
        self.curves = gather(curve).reshape(-1, len(curve)).tolist()


def without_dropout(net: nn.Module) -> None:
    """Dropout off, so that a variant's losses follow eager's step by step (its random masks never would)."""
    for module in net.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def fuse_scalars(history: list[dict]) -> dict[str, Any]:
    """What FuseCallback logged for the last epoch on rank zero: its speedup and each rank's GPU utilisation."""
    last = history[-1] if history else {}
    ranks = sorted((int(key.rsplit("rank", 1)[1]), value) for key, value in last.items() if "gpu_util_rank" in key)
    return {"speedup_logged": last.get("fuse/speedup"), "gpu_util_ranks": [value for _, value in ranks] or None}


def apply_derived(task: models.Task, name: str, smoke: bool, cache_dir: str | None) -> tuple[str, list, dict]:
    """Make ``task`` the variant ``name`` (one of :data:`VARIANTS`), its :data:`MATMUL_FLAGS` set for the whole
    process; returns the variant it runs, its callbacks and its Trainer arguments.

    Example::

        >>> task, _ = models.build("gpt", 2, smoke=True, length=1)
        >>> apply_derived(task, "eager_fp32", smoke=True, cache_dir=None)
        ('eager', [], {'precision': '32-true'})
    """
    variant, trainer_kw, fuse_kw = DERIVED.get(name, (name, {}, {}))
    for flag, value in MATMUL_FLAGS.get(name, {}).items():
        setattr(torch.backends.cuda.matmul, flag, value)
    return variant, models.apply_variant(task, variant, smoke, cache_dir, **fuse_kw), trainer_kw


def measure(spec: dict) -> dict:
    """One multi-process fit (this process is rank 0; Lightning re-runs this command for rank 1)."""
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set for rank 1 by Lightning's launcher before it runs this
    length = spec["steps"] // EPOCHS
    markov = spec.get("data") == "markov"
    task, loader = models.build(spec["model"], spec["batch_size"], spec["smoke"], length, seed=spec.get("seed") or 0,
                                scheduler=bool(spec.get("scheduler")),
                                markov=spec["world_size"] * length if markov else 0,
                                shift=rank * length if markov else rank)  # each rank its own batch at every step
    without_dropout(task.model)
    strategy = spec["strategy"]
    if strategy == "fsdp":
        blocks = {type(block) for block in models.repeated_blocks(task.model)} - {type(task.model)}
        strategy = FSDPStrategy(auto_wrap_policy=blocks or None)
    elif strategy == "fsdp2":
        task.fully_shard = True
        strategy = ModelParallelStrategy(data_parallel_size=spec["world_size"], tensor_parallel_size=1)
    started = time.perf_counter()
    variant, callbacks, trainer_kw = apply_derived(task, spec["variant"], spec["smoke"], spec["cache_dir"])
    losses = RankLosses()
    device = {"accelerator": "cpu"} if spec["smoke"] else {}  # gloo on CPU
    result = harness.fit(task, loader, steps=spec["steps"], warmup=spec["warmup"], callbacks=[*callbacks, losses],
                         started=started, devices=spec["world_size"], strategy=strategy,
                         use_distributed_sampler=False, **device, **trainer_kw)  # fmt: skip
    info = models.fuse_info(callbacks)
    scalars = fuse_scalars(info["history"]) if variant == "fuse" else {}
    return {**result, **info, **scalars, "loss_ranks": losses.ranks or None, "loss_curves": losses.curves or None,
            "loss_steps": losses.rounded() or None, "eager_steps": losses.eager_steps or None}


def loss_gaps(records: list[dict], against: str = "eager") -> str:
    """A Markdown table: for each case (model, strategy, batch, seed, fit, device) and variant, the greatest relative
    distance between its ``loss_curves`` and the ``against`` variant's (every rank, every block), from each key's
    newest record that has curves. Each device is held to its own: the same fit rounds differently on another GPU.

    ``against="eager"``: the issue's yardstick, eager in the fit's precision; a variant is within bf16's tolerance
    where its gap is at most ``eager_fp32``'s. ``against="eager_fp32"``: full precision, the reference
    ``gradients.py`` holds each step to; a variant is within where it lies at most ``harness.WITHIN_RATIO`` times
    as far from it as eager does (eager's own bf16 rounding can be what parts the two curves). Either tolerance is
    at least ``harness.BF16_RTOL``, bf16's own, where the two references agree more closely than that. Against
    any other variant (``eager_exact_reductions``: eager as torch runs it with float32 reductions) no variant's
    gap sets the tolerance: it is ``harness.BF16_RTOL``.

    Example::

        >>> rows = [{"model": "m", "strategy": "ddp", "batch_size": 8, "variant": v, "loss_curves": [[c, c]]}
        ...         for v, c in (("eager", 2.0), ("fuse", 2.02), ("eager_fp32", 2.1))]
        >>> print(loss_gaps(rows).splitlines()[-1])
        | m | ddp | 8 | 0 | random | - | 0.05 | 0.01 (within) |
        >>> print(loss_gaps(rows, against="eager_fp32").splitlines()[-1])  # fuse 0.04 from full precision, eager 0.05
        | m | ddp | 8 | 0 | random | - | 0.05 | 0.04 (within) |
        >>> exact = {**rows[0], "variant": "eager_exact_reductions", "loss_curves": [[2.03, 2.03]]}
        >>> print(loss_gaps([*rows, exact], against="eager_exact_reductions").splitlines()[-1])  # eager, fuse, fp32
        | m | ddp | 8 | 0 | random | - | 0.01 (within) | 0.0049 (within) | 0.03 (beyond) |
    """
    judge, cases = _judged_gaps(records, against)
    others = [v for v in VARIANTS if v != judge and any(v in gap for _, gap, _ in cases)]
    header = ["model", "strategy", "batch", "seed", "fit", "device", *filter(None, [judge]), *others]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for case, gap, tolerance in cases:
        cells = [_figure(gap[v]) + ("" if tolerance is None else " (within)" if gap[v] <= tolerance else " (beyond)")
                 if v in gap else "-" for v in others]  # fmt: skip
        judge_cell = [] if judge is None else [_figure(gap[judge]) if judge in gap else "-"]
        lines.append("| " + " | ".join([*map(str, case), *judge_cell, *cells]) + " |")
    return "\n".join(lines)


def fuse_within(records: list[dict], against: str = "eager") -> str:
    """How many cases of :func:`loss_gaps` hold ``fuse`` within its tolerance, all of them and the fits that learn
    (Markov text), where memorised random batches can reroute any curve.

    Example::

        >>> rows = [{"model": "m", "strategy": "ddp", "batch_size": 8, "variant": v, "loss_curves": [[c, c]]}
        ...         for v, c in (("eager", 2.0), ("fuse", 2.02), ("eager_fp32", 2.1))]
        >>> fuse_within(rows)
        'fuse within in 1 of 1 cases; on fits that learn (Markov text), in 0 of 0.'
    """
    judged = [(case[4], gap["fuse"] <= tolerance) for case, gap, tolerance in _judged_gaps(records, against)[1]
              if "fuse" in gap and tolerance is not None]  # fmt: skip
    learning = [within for fit, within in judged if fit.startswith("markov")]
    return (f"fuse within in {harness.passing([within for _, within in judged])} cases; on fits that learn "
            f"(Markov text), in {harness.passing(learning)}.")


def _judged_gaps(records: list[dict], against: str) -> tuple[str | None, list[tuple[tuple, dict, float | None]]]:
    """:func:`loss_gaps`' judge variant, and each case with an ``against`` curve: its variants' gaps to it and the
    tolerance they are held to (``None`` where the judge's own curve is missing)."""
    newest: dict[tuple, dict[str, dict]] = {}  # each case's newest record of each variant
    for record in records:
        if record.get("loss_curves"):
            case = (*(record.get(k) for k in ("model", "strategy", "batch_size")), record.get("seed") or 0,
                    _fit(record), record.get("device") or "-")  # fmt: skip
            newest.setdefault(case, {})[record.get("variant")] = record
    judge, scale = TOLERANCES.get(against, (None, 1.0))
    judged = []
    for case, variants in sorted(newest.items(), key=lambda item: str(item[0])):
        reference = variants.get(against)
        if reference is None:
            continue
        gap = {variant: _gap(record["loss_curves"], reference["loss_curves"]) for variant, record in variants.items()
               if variant != against}  # fmt: skip
        if judge is None:
            tolerance = harness.BF16_RTOL
        else:
            tolerance = max(harness.BF16_RTOL, scale * gap[judge]) if judge in gap else None
        judged.append((case, gap, tolerance))
    return judge, judged


def checks(records: list[dict]) -> str:
    """The several-GPUs issue's speed checks, as Markdown, over each default fit's newest rows
    (``harness.newest_rows``; seed 0, random batches, no scheduler): ``fuse`` over ``eager`` (never slower: at most
    1.0) and over ``compile`` (at most 1.0 on every case, 0.8 as the geometric mean), each step time with its
    spread (a fit's quartiles, or its repeats' range). A ratio is taken only where both sides ran on the same
    device: a case whose variants ran on different ones names them and is left out of that ratio's count. Fits
    that crashed (an error that is not a skip) are named.

    Example::

        >>> rows = [{"model": "m", "strategy": "ddp", "batch_size": 8, "variant": v, "step_ms": ms, "device": "H200"}
        ...         for v, ms in (("eager", 30.0), ("compile", 20.0), ("fuse", 10.0))]
        >>> print(checks(rows).splitlines()[2])
        | m | ddp | 8 | 30.00 | 20.00 | 10.00 | - | 0.33 | 0.50 | H200 |
        >>> print(checks(rows).splitlines()[-1])
        1 cases, 0 crashed fits; fuse <= eager in 1 of 1; <= compile in 1 of 1, geometric mean 0.50.
    """
    default_fits = [row for row in harness.newest_rows(records) if not row.get("seed") and _fit(row) == "random"]
    cases, crashes = harness.measured_cases(default_fits, ("model", "strategy", "batch_size"))
    judged = [_case_checks(case, variants) for case, variants in sorted(cases.items(), key=str) if "fuse" in variants]
    over = harness.judged_values(judged, ("eager", "compile"))
    mixed = sum(case["mixed"] for case in judged)
    verdicts = (f"fuse <= eager in {harness.passing(over['eager'], 1.0)}; <= compile in "
                f"{harness.passing(over['compile'], 1.0)}, geometric mean "
                f"{statistics.geometric_mean(over['compile']) if over['compile'] else float('nan'):.2f}"
                + (f"; {mixed} cases with a side on another device, left out of that ratio." if mixed else "."))
    header = ("| model | strategy | batch | eager ms | compile ms | fuse ms | plan | over eager | over compile | "
              "device |")
    return harness.checks_report(header, "|---|---|---:|---:|---:|---:|---|---:|---:|---|", judged, crashes, verdicts)


def _case_checks(case: tuple, variants: dict[str, dict]) -> dict:
    """One case's ``fuse`` over ``eager`` and over ``compile`` (``None`` where a side is missing or ran on another
    device than ``fuse``), and its table line."""
    fuse = variants["fuse"]
    found = {side: fuse["step_ms"] / variants[side]["step_ms"] if side in variants and variants[side].get("device")
             == fuse.get("device") else None for side in ("eager", "compile")}  # fmt: skip
    devices = sorted({str(row.get("device")) for name, row in variants.items() if name in SPEED_VARIANTS})
    cells = [*case, *map(_spread, map(variants.get, SPEED_VARIANTS)), fuse.get("plan") or "-",
             *(harness.figure(found[side]) for side in ("eager", "compile")),
             " / ".join(devices)]  # fmt: skip
    return {**found, "mixed": len(devices) > 1, "line": "| " + " | ".join(map(str, cells)) + " |"}


def _spread(row: dict | None) -> str:
    """A row's step time with its spread: its repeats' range (``harness.pooled``), or one fit's quartiles."""
    if row is None:
        return "-"
    quartiles = (row.get("step_ms_q1"), row.get("step_ms_q3"))
    spread = row.get("step_ms_range") or (f"{quartiles[0]:.1f}-{quartiles[1]:.1f}" if None not in quartiles else "")
    return f"{row['step_ms']:.2f}" + (f" ({spread})" if spread else "")


def _fit(record: dict) -> str:
    """What a record's fit trains on: ``random`` (batches cycled) or ``markov`` text, ``+lr`` with the scheduler."""
    return (record.get("data") or "random") + ("+lr" if record.get("scheduler") else "")


def _figure(gap: float) -> str:
    """A gap to two decimals, or to two significant digits below 0.01 (where two decimals would read 0.00)."""
    return f"{gap:.2f}" if gap >= 0.01 or gap == 0 else f"{gap:.2g}"


def _gap(curves: list[list[float]], eager: list[list[float]]) -> float:
    return max(abs(a / b - 1) for rank, ref in zip(curves, eager) for a, b in zip(rank, ref))


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "multi_gpu.jsonl", models="gpt2,resnet50", batches="small,large", variants=VARIANTS,
                       steps=200, warmup=30)  # fmt: skip
    p.add_argument("--strategies", default="ddp,fsdp", help="a comma list of ddp, fsdp, fsdp2")
    p.add_argument("--losses", type=Path, help="print each variant's loss gap to eager from these records, and stop")
    p.add_argument("--checks", type=Path, help="print the issue's speed checks over these records, and stop")
    p.add_argument("--seed", type=int, default=0, help="the models' initialisation and batches (0: the default)")
    p.add_argument("--data", choices=("random", "markov"), default="random",
                   help="random batches cycled (the default), or Markov text: a new batch each step of an epoch "
                        "(causal LMs)")
    p.add_argument("--scheduler", action="store_true", help="a warmup-then-cosine learning rate, stepped each step")
    args = p.parse_args(argv)
    if args.checks:
        print(checks(harness.read_records(args.checks)))
        return 0
    if args.losses:
        records = harness.read_records(args.losses)
        for title, against in (("eager", "eager"), ("full precision", "eager_fp32"),
                               ("eager with float32 reductions", "eager_exact_reductions")):
            print(f"Against {title}:\n\n{loss_gaps(records, against)}\n\n{fuse_within(records, against)}\n")
        return 0
    steps, warmup = (4, 2) if args.smoke else (args.steps, args.warmup)
    groups = [[{"model": model, "strategy": strategy, "world_size": 2, "batch_size": batch, "variant": variant,
                "steps": steps, "warmup": warmup, "smoke": args.smoke, **({"seed": args.seed} if args.seed else {}),
                **({"data": args.data} if args.data != "random" else {}),
                **({"scheduler": True} if args.scheduler else {})}
               for variant in harness.split(args.variants, VARIANTS)]
              for model, batch in models.regimes(args) for strategy in harness.split(args.strategies, STRATEGIES)]
    return harness.run(args, "multi_gpu.py", measure, FIELDS, groups)


if __name__ == "__main__":
    sys.exit(main())
