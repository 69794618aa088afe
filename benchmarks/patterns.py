"""Training patterns users bring to FuseCallback: does it still train, how fast, how often does it recompile?

Each (model, pattern, variant) trains in its own process; ``step_ms`` is per batch (a micro-batch under
gradient accumulation), ``steps`` the batches run, ``wall_s`` the fit from start to end (compiling included),
``final_loss`` the mean loss of the last 10 steps, ``recompiles`` FuseCallback's count. Models: ``llama``
(transformers), ``resnet50`` (torchvision) where the pattern applies, ``vit`` and ``deberta`` (fuse's plan for
them is torch's cudagraph trees) for ``accumulate_clip``, and the recipe ``gpt`` with mixture-of-experts MLPs for
``moe``. On the GPU:

    python benchmarks/patterns.py --patterns all --budget-s 540
    python benchmarks/patterns.py --patterns varying_length --steps 230 --warmup 130 --budget-s 540
    python benchmarks/patterns.py --smoke --patterns moe,accumulate_clip --variants fuse   # CPU, the code path

Varying lengths are timed past their one-time costs, as the second line does: 8 untimed passes over the 16 lengths
hold every variant's compiles and graph recordings (torch's trees record a length at its second call, FuseCallback's
at its third, after its plan search), which inside a 100-step fit would sit in the timed steps of one variant only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import harness
import models
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

FIELDS = ("model", "pattern", "batch_size", "variant", "step_ms", "steps", "wall_s", "final_loss", "recompiles", "plan",
          "graphs", "ran", "error")
HF, VISION = ("llama",), ("resnet50",)
TREES = ("vit", "deberta")
"""Models whose fuse plan at small batch is torch's cudagraph trees (``reduce-overhead``), as the zoo measured."""
ALL_VARIANTS = ("eager", "fuse", "reduce_overhead")


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
    """Batches padded to their longest sequence, padding masked out, ``copies`` of each of the task's random batches
    cut to its own length: 4 copies give 16 lengths that come again (a small dataset), 40 each step its own. Each
    batch's longest row is drawn from 1/8 to all of the model's length (so that the batches spread over
    ``pad_buckets``' sizes), its other rows from half that to all of it."""

    def apply(task: models.Task, spec: dict) -> None:
        batches = []
        for batch in task.data.batches * copies:
            ids = batch["input_ids"]
            longest = int(torch.randint(ids.shape[1] // 8, ids.shape[1] + 1, ()))
            lengths = torch.randint(longest // 2, longest + 1, (ids.shape[0],))
            lengths[0] = longest
            mask = (torch.arange(longest) < lengths[:, None]).long()
            batches.append({"input_ids": ids[:, :longest], "attention_mask": mask,
                            "labels": ids[:, :longest].masked_fill(mask == 0, -100)})  # fmt: skip
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


def buckets(task: models.Task, spec: dict) -> dict:
    varying_length(4)(task, spec)
    return {"fuse": {"pad_buckets": (8, 16) if spec["smoke"] else (64, 128, 256, 512)}}


def clipped(task: models.Task, spec: dict) -> None:
    """Lightning clips under mixed precision only an optimizer that is not fused (fused AdamW unscales itself)."""
    task.fused = False


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
    "varying_length": (HF, ALL_VARIANTS, varying_length(4), {}),
    "varying_length_each": (HF, ALL_VARIANTS, varying_length(40), {}),
    "varying_length_buckets": (HF, ("fuse",), buckets, {}),
    "moe": (("gpt",), ALL_VARIANTS, moe, {}),
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
    started = time.perf_counter()
    try:
        fuse_kw = extra.get("fuse", {})
        callbacks = models.apply_variant(task, spec["variant"], spec["smoke"], spec["cache_dir"], **fuse_kw)
    except TypeError as err:  # an argument this FuseCallback does not have yet
        return {"error": harness.describe(err)}
    result = harness.fit(task, DataLoader(task.data, batch_size=None), steps=spec["steps"] * optimizers,
                         warmup=spec["warmup"], callbacks=callbacks, started=started, **trainer_kw)  # fmt: skip
    return {**result, **models.fuse_info(callbacks)}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "patterns.jsonl", models="all", batches="small", variants=ALL_VARIANTS, steps=100,
                       warmup=30)  # fmt: skip
    p.add_argument("--patterns", default="all", help=f"a comma list of {', '.join(PATTERNS)}, or all")
    args = p.parse_args(argv)
    steps, warmup = (4, 2) if args.smoke else (args.steps, args.warmup)
    wanted = harness.split(args.variants, ALL_VARIANTS)
    groups = [[{"model": model, "pattern": pattern, "batch_size": batch, "variant": variant, "steps": steps,
                "warmup": warmup, "smoke": args.smoke} for variant in PATTERNS[pattern][1] if variant in wanted]
              for pattern in harness.split(args.patterns, list(PATTERNS))
              for model, batch in models.regimes(args, HF + VISION + TREES + ("gpt",)) if model in PATTERNS[pattern][0]]
    return harness.run(args, "patterns.py", measure, FIELDS, groups)


if __name__ == "__main__":
    sys.exit(main())
