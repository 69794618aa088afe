"""Each training step held to full precision: does a variant compute the gradients eager computes? (``multi_gpu``'s
variants, on one GPU or under DDP)

A loss curve is a weak test of a training step. Two correct fits that round differently part after some dozens of
steps of a fit without warmup, and by how much depends on the trajectory, not on the step. So this holds each step
to the truth instead. At every ``--check-every``-th step, just before the optimizer step, three gradients of the same
weights and batch are compared, parameter by parameter:

- the variant's: what the optimizer is about to use (under DDP, already averaged over the ranks);
- eager's in full precision (float32, no autocast, no TF32): the reference;
- eager's under the fit's precision (``bf16-mixed`` on a GPU): what eager's own rounding costs at that point.

A step's error is the median over the parameters of ``|g - g_fp32| / |g_fp32|``. ``grad_err`` is the median of the
variant's step errors, ``eager_grad_err`` that of eager's at the same points, and ``grad_err_ratio`` the greatest
ratio of the two over the checked steps: eager's own is exactly 1. A defect (stale weights or inputs, a gradient
lost or counted twice) moves a gradient by far more than rounding does, so a variant is ``within`` where the ratio
is at most ``harness.WITHIN_RATIO``. Where eager's own error passes :data:`INCONCLUSIVE` (ResNet-50 at initialisation:
a deep batch-norm network turns bf16's rounding into a gradient unlike full precision's), the reference tells
nothing and ``within`` is ``null``. ``worst`` names the parameter furthest from the reference at that peak step, and
``step_errors`` lists ``[step, error, eager's error]``. The networks run without dropout, as in ``multi_gpu.py``.

    python benchmarks/gradients.py --models gpt2 --variants eager,compile,fuse,fuse_forced_graph
    python benchmarks/gradients.py --models gpt2 --world-size 2 --variants eager,fuse   # DDP on 2 GPUs
    python benchmarks/gradients.py --smoke --models gpt --variants eager,compile,fuse   # CPU
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import harness
import lightning.pytorch as pl
import models
import torch
import torch.distributed as dist
from multi_gpu import VARIANTS, apply_derived, without_dropout
from torch import Tensor, nn

FIELDS = ("model", "strategy", "world_size", "batch_size", "seed", "variant", "grad_err", "eager_grad_err",
          "grad_err_ratio", "within", "checked", "worst", "step_errors", "final_loss", "plan", "ran",
          "error")  # fmt: skip
INCONCLUSIVE = 0.5
"""Eager's own median step error beyond which full precision is no reference for this fit's gradients."""
FLOOR = 1e-6
"""Eager's error counts as at least this (on a CPU in full precision it is 0)."""


def relative_errors(grads: Sequence[Tensor | None], reference: Sequence[Tensor | None]) -> list[float]:
    """``|g - ref| / |ref|`` per parameter (norms over each whole tensor); a gradient missing on one side only is
    infinitely wrong, and one missing on both sides (an unused parameter) is right.

    Example::

        >>> relative_errors([torch.tensor([1.0, 1.0]), None], [torch.tensor([1.0, 2.0]), None])
        [0.4472135901451111, 0.0]
    """
    errors = []
    for grad, ref in zip(grads, reference, strict=True):
        if grad is None or ref is None:
            errors.append(0.0 if grad is None and ref is None else float("inf"))
        else:
            errors.append(float((grad - ref).norm() / ref.norm().clamp_min(1e-30)))
    return errors


@contextmanager
def full_precision(device: torch.device) -> Iterator[None]:
    """float32 math: no autocast, no TF32 in matrix products or convolutions."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


class GradientCheck(pl.Callback):
    """Before every ``every``-th optimizer step, the gradients the optimizer is about to use against eager's in
    full precision and eager's in the fit's precision, at the same weights and batch (this module's docstring).

    List it last among the callbacks, so that the gradients it checks are those every other callback left. It
    leaves the fit as it found it: no ``.grad`` is touched, and buffers (batch-norm statistics) are restored. One
    batch makes one optimizer step: with gradient accumulation the step's gradients are not one batch's.

    Raises:
        ValueError: At fit start, where the Trainer accumulates gradients over several batches.

    Example::

        >>> check = GradientCheck(every=5); check.rows
        []
    """

    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.rows: list[dict[str, Any]] = []
        self._batch: Any = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"GradientCheck compares one batch's gradients, but the Trainer accumulates "
                f"{trainer.accumulate_grad_batches} batches a step: set accumulate_grad_batches=1."
            )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._batch = batch

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step % self.every:
            return
        net = pl_module.model
        names, params = zip(*[(name, p) for name, p in net.named_parameters() if p.requires_grad])
        used = [None if p.grad is None else p.grad.detach().float().clone() for p in params]
        reference = self._eager_gradients(pl_module, params, full_precision(pl_module.device))
        eager = self._eager_gradients(pl_module, params, trainer.precision_plugin.forward_context())
        errors, eager_errors = relative_errors(used, reference), relative_errors(eager, reference)
        worst = names[errors.index(max(errors))]
        self.rows.append({"step": trainer.global_step, "err": statistics.median(errors),
                          "eager_err": statistics.median(eager_errors), "worst": worst})  # fmt: skip

    def _eager_gradients(self, pl_module: pl.LightningModule, params: Sequence[nn.Parameter],
                         context: AbstractContextManager) -> list[Tensor | None]:  # fmt: skip
        """The batch's gradients computed eagerly under ``context`` (averaged over the ranks), ``.grad`` untouched."""
        buffers = [b.detach().clone() for b in pl_module.model.buffers()]
        with torch.compiler.set_stance("force_eager"), torch.enable_grad(), context:
            loss = pl_module.loss_fn(pl_module.model, self._batch)
        grads = [None if g is None else g.float() for g in torch.autograd.grad(loss, params, allow_unused=True)]
        with torch.no_grad():
            for buffer, saved in zip(pl_module.model.buffers(), buffers):
                buffer.copy_(saved)
        if dist.is_available() and dist.is_initialized():
            for grad in grads:  # every rank's parameters have a gradient, or none has
                if grad is not None:
                    dist.all_reduce(grad)
                    grad /= dist.get_world_size()
        return grads

    def summary(self) -> dict[str, Any]:
        """The record's fields from the checked steps (this module's docstring)."""
        if not self.rows:
            return {"checked": 0}
        ratios = [row["err"] / max(row["eager_err"], FLOOR) for row in self.rows]
        peak = ratios.index(max(ratios))
        eager_err = statistics.median(row["eager_err"] for row in self.rows)
        within = None if eager_err > INCONCLUSIVE else ratios[peak] <= harness.WITHIN_RATIO
        return {"grad_err": statistics.median(row["err"] for row in self.rows), "eager_grad_err": eager_err,
                "grad_err_ratio": ratios[peak], "within": within, "checked": len(self.rows),
                "worst": self.rows[peak]["worst"],
                "step_errors": [[row["step"], float(f"{row['err']:.4g}"), float(f"{row['eager_err']:.4g}")]
                                for row in self.rows]}  # fmt: skip


def measure(spec: dict) -> dict:
    """One fit with its gradients checked (under DDP this process is rank 0; Lightning starts the others)."""
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    task, loader = models.build(spec["model"], spec["batch_size"], spec["smoke"], spec["steps"],
                                seed=spec.get("seed") or 0, shift=rank)  # fmt: skip
    without_dropout(task.model)
    started = time.perf_counter()
    _, callbacks, trainer_kw = apply_derived(task, spec["variant"], spec["smoke"], spec["cache_dir"])
    check = GradientCheck(spec["every"])
    world = spec["world_size"]
    setup = {"devices": world, **({"strategy": "ddp", "use_distributed_sampler": False} if world > 1 else {})}
    device = {"accelerator": "cpu", "precision": "bf16-mixed"} if spec["smoke"] else {}  # CPU autocast: rounding
    result = harness.fit(task, loader, steps=spec["steps"], warmup=min(spec["steps"] - 1, 2), started=started,
                         callbacks=[*callbacks, check], **setup, **device, **trainer_kw)  # fmt: skip
    info = models.fuse_info(callbacks)
    return {"final_loss": result["final_loss"], "error": result["error"], "plan": info["plan"], "ran": info["ran"],
            **check.summary()}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(__doc__, "gradients.jsonl", models="gpt2", batches="small", variants=VARIANTS, steps=40)
    p.add_argument("--world-size", type=int, default=1, choices=(1, 2), help="2: Lightning's DDP on 2 devices")
    p.add_argument("--check-every", type=int, default=1, help="check every this many optimizer steps")
    p.add_argument("--seed", type=int, default=0, help="the models' initialisation and batches (0: the default)")
    args = p.parse_args(argv)
    if args.check_every < 1:
        p.error(f"--check-every must be at least 1, got {args.check_every}")
    steps = 6 if args.smoke else args.steps
    case = {"strategy": "ddp" if args.world_size > 1 else None, "world_size": args.world_size, "steps": steps,
            "every": args.check_every, "smoke": args.smoke, **({"seed": args.seed} if args.seed else {})}  # fmt: skip
    variants = harness.split(args.variants, VARIANTS)
    groups = [[{"model": model, "batch_size": batch, "variant": variant, **case} for variant in variants]
              for model, batch in models.regimes(args)]  # fmt: skip
    return harness.run(args, "gradients.py", measure, FIELDS, groups)


if __name__ == "__main__":
    sys.exit(main())
