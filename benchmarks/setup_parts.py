"""Where FuseCallback's setup time goes on a GPU, beside plain regional compilation: a diagnostic.

Times, in this process, the NVML sampler's start and stop, and for a fresh-cache fit of one model (``--model``,
``--batch``) with FuseCallback the callback's fit-start hook, its parts, and the first step.

    python benchmarks/setup_parts.py --model gpt --batch 8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import peers_measure as pm  # noqa: E402
from lightning_fuse import FuseCallback, gpu  # noqa: E402
from lightning_fuse import callback as fuse_callback  # noqa: E402

SPENT: dict[str, float] = {}


def timed(owner: object, name: str) -> None:
    """Replace ``owner.name`` with a wrapper that adds its duration to ``SPENT[name]``."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SPENT[name] = SPENT.get(name, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)


class FirstStep(pl.Callback):
    def __init__(self) -> None:
        self.fit_start = time.perf_counter()
        self.first_step_s: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.first_step_s is None:
            torch.cuda.synchronize()
            self.first_step_s = time.perf_counter() - self.fit_start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt", choices=("gpt", "resnet"))
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    pm.configure_process()
    sampler = gpu.GpuSampler(torch.cuda.current_device(), hz=10)
    start = time.perf_counter()
    sampler.start()
    started = time.perf_counter() - start
    time.sleep(0.5)
    start = time.perf_counter()
    sampler.stop()
    result = {"sampler_start_s": started, "sampler_stop_s": time.perf_counter() - start}
    for name in ("on_fit_start", "_start_cache", "_start_gpu_metrics", "on_fit_end", "teardown"):
        timed(FuseCallback, name)
    for name in ("resolve_regions", "choose_plan", "compile_regions", "format_plan"):
        timed(fuse_callback, name)
    cache = Path(tempfile.mkdtemp())
    device = torch.device("cuda", torch.cuda.current_device())
    task = pm.build_task(args.model, tiny=False)
    clock = FirstStep()
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[clock, FuseCallback(eager_steps=0, cache_dir=str(cache / "fuse"))])  # fmt: skip
    with pm.compile_caches(cache):
        clock.fit_start = time.perf_counter()
        trainer.fit(task, train_dataloaders=pm.random_loader(args.model, args.batch, 3, False, device))
    result.update(first_step_s=clock.first_step_s, **{f"{k}_s": round(v, 3) for k, v in SPENT.items()})
    result.update(env=pm.environment(), command=" ".join(sys.argv))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
