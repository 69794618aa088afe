"""DDP and FSDP on 2 GPUs: does FuseCallback's plan pay with several processes? (``models.VARIANTS``)

Each (model, strategy, batch, variant) is one launch: Lightning starts the second process itself
(``Trainer(devices=2, strategy="ddp"|"fsdp")``, FSDP with one unit per repeated block). ``batch_size`` is per
rank; ``step_ms`` is rank 0's median step after the warmup. On a machine with 2 GPUs:

    python benchmarks/multi_gpu.py --models gpt2,resnet50 --strategies ddp,fsdp --budget-s 540
    python benchmarks/multi_gpu.py --smoke --models gpt --variants eager,fuse   # CPU: gloo, 2 processes
"""

from __future__ import annotations

import sys
import time

import harness
import models
from lightning.pytorch.strategies import FSDPStrategy

FIELDS = ("model", "strategy", "world_size", "batch_size", "variant", "step_ms", "final_loss", "plan", "ran", "search",
          "error")
VARIANTS = models.VARIANTS


def measure(spec: dict) -> dict:
    """One multi-process fit (this process is rank 0; Lightning re-runs this command for rank 1)."""
    task, loader = models.build(spec["model"], spec["batch_size"], spec["smoke"], spec["steps"])
    strategy = spec["strategy"]
    if strategy == "fsdp":
        blocks = {type(block) for block in models.repeated_blocks(task.model)} - {type(task.model)}
        strategy = FSDPStrategy(auto_wrap_policy=blocks or None)
    started = time.perf_counter()
    callbacks = models.apply_variant(task, spec["variant"], spec["smoke"], spec["cache_dir"])
    device = {"accelerator": "cpu"} if spec["smoke"] else {}  # gloo on CPU
    result = harness.fit(task, loader, steps=spec["steps"], warmup=spec["warmup"], callbacks=callbacks,
                         started=started, devices=spec["world_size"], strategy=strategy,
                         use_distributed_sampler=False, **device)  # fmt: skip
    return {**result, **models.fuse_info(callbacks)}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "multi_gpu.jsonl", models="gpt2,resnet50", batches="small,large", variants=VARIANTS,
                       steps=200, warmup=30)  # fmt: skip
    p.add_argument("--strategies", default="ddp,fsdp")
    args = p.parse_args(argv)
    steps, warmup = (4, 2) if args.smoke else (args.steps, args.warmup)
    groups = [[{"model": model, "strategy": strategy, "world_size": 2, "batch_size": batch, "variant": variant,
                "steps": steps, "warmup": warmup, "smoke": args.smoke}
               for variant in harness.split(args.variants, VARIANTS)]
              for model, batch in models.regimes(args) for strategy in harness.split(args.strategies, ("ddp", "fsdp"))]
    return harness.run(args, "multi_gpu.py", measure, FIELDS, groups)


if __name__ == "__main__":
    sys.exit(main())
