"""What the GPU runs in one training step, by kernel, per variant: a diagnostic beside ``peers.py``.

For each variant of one regime (in one process, caches warm after the first variant of a kind), a few steps
after warmup are recorded with ``torch.profiler``; prints the step's wall time (CUDA events), its GPU-busy time
(the union of kernel intervals), kernels per step, the kernels with the most GPU time per step, and the host
ops with the most self time per step. Shows how much of a step a whole-iteration capture could still remove (the
idle part) and which kernels dominate the rest.

    python benchmarks/kernels.py --model gpt --batch 8 --variants reduce_overhead,fuse,fuse_unreleased --out $OUT/k
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import peers_measure as pm  # noqa: E402
from lightning_fuse import graphs  # noqa: E402

RELEASE = graphs.release_capture_graph


class KernelWindow(pl.Callback):
    """Times every step with CUDA events and profiles steps ``[start, start + count)`` (CUDA kernels only)."""

    def __init__(self, start: int, count: int, mark_step: bool) -> None:
        self.start, self.count, self.mark_step = start, count, mark_step
        self.step = 0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.profiler: torch.profiler.profile | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        if self.step == self.start:
            torch.cuda.synchronize()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        self.events.append((begin, torch.cuda.Event(enable_timing=True)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.events[-1][1].record()
        self.step += 1
        if self.step == self.start + self.count:
            torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)

    def summary(self, top: int) -> dict:
        torch.cuda.synchronize()
        window = self.events[self.start : self.start + self.count]
        steady = self.events[self.start + self.count :] or window
        kernels = [e for e in self.profiler.events()  # GPU work only: not the GPU-side ranges of host annotations
                   if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]  # fmt: skip
        intervals = sorted((e.time_range.start, e.time_range.end) for e in kernels)
        busy_us, reach = 0.0, float("-inf")
        for begin, end in intervals:  # union of kernel intervals
            busy_us += max(0.0, end - max(begin, reach))
            reach = max(reach, end)
        by_name: dict[str, list[float]] = defaultdict(list)
        for e in kernels:
            by_name[e.name].append(e.time_range.end - e.time_range.start)
        rows = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
        host = [e for e in self.profiler.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
        syncs = sum(e.count for e in host if e.key in ("cudaStreamWaitEvent", "cudaEventRecord"))
        host = sorted(host, key=lambda e: -e.self_cpu_time_total)[:top]
        return {
            "profiled_step_ms": statistics.median(a.elapsed_time(b) for a, b in window),
            "step_ms": statistics.median(a.elapsed_time(b) for a, b in steady),
            "gpu_busy_ms_per_step": busy_us / 1e3 / self.count,
            "kernels_per_step": len(kernels) / self.count,
            "stream_syncs_per_step": syncs / self.count,  # cudaStreamWaitEvent + cudaEventRecord calls
            "top": [{"kernel": name[:110], "per_step": len(t) / self.count, "us_per_step": sum(t) / self.count}
                    for name, t in rows],  # fmt: skip
            "host_top": [{"op": e.key[:110], "per_step": e.count / self.count,
                          "self_us_per_step": e.self_cpu_time_total / self.count} for e in host],  # fmt: skip
        }


def profile_variant(model: str, batch: int, variant: str, cache: Path, warmup: int, count: int, top: int) -> dict:
    """``fuse_unreleased`` is ``fuse`` with the capture's autograd graph kept alive (graphs.release_capture_graph
    off): its parameters then accumulate gradients on the capture's side stream."""
    device = torch.device("cuda", torch.cuda.current_device())
    pl.seed_everything(0, verbose=False)
    task = pm.build_task(model, tiny=False)
    steps = warmup + count + 50
    graphs.release_capture_graph = (lambda graphed: 0) if variant == "fuse_unreleased" else RELEASE
    base = "fuse" if variant == "fuse_unreleased" else variant
    cache_dir = pm.cache_dir_for(cache, model, batch, base, False)
    callbacks = pm.apply_variant(base, task, model, cache_dir, "inductor", eager_steps=0)
    window = KernelWindow(warmup, count, mark_step=variant == "reduce_overhead")
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=steps, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[window, *callbacks])  # fmt: skip
    with pm.compile_caches(cache_dir):
        trainer.fit(task, train_dataloaders=pm.random_loader(model, batch, steps, False, device))
    result = {"model": model, "batch_size": batch, "variant": variant, **window.summary(top)}
    pm.free_memory()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt", choices=("gpt", "resnet"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--variants", default="reduce_overhead,fuse")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5, help="profiled steps")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/kernels-cache"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pm.configure_process()
    args.out.mkdir(parents=True, exist_ok=True)
    env = pm.environment()
    for variant in args.variants.split(","):
        result = profile_variant(args.model, args.batch, variant, args.cache, args.warmup, args.steps, args.top)
        result.update(env=env, command=" ".join(sys.argv))
        with open(args.out / f"kernels-{args.model}{args.batch}.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"\n{variant}: step {result['step_ms']:.2f} ms (profiled {result['profiled_step_ms']:.2f}), GPU busy "
              f"{result['gpu_busy_ms_per_step']:.2f} ms, {result['kernels_per_step']:.0f} kernels/step, "
              f"{result['stream_syncs_per_step']:.0f} event records and waits/step")
        for row in result["top"]:
            print(f"  {row['us_per_step']:8.1f} us  {row['per_step']:5.1f}x  {row['kernel']}")
        print("  host, self time per step:")
        for row in result["host_top"]:
            print(f"  {row['self_us_per_step']:8.1f} us  {row['per_step']:5.1f}x  {row['op']}")


if __name__ == "__main__":
    main()
