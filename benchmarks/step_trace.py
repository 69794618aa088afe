"""Where a training step's time goes, on a GPU: a diagnostic beside ``peers.py``, not a comparison.

Per regime and FuseCallback preset, in one process (caches warm after a first pass): a dense eager window
(``eager_steps`` per epoch), every step timed by CUDA events and labelled compiled / eager by the stance it ran
under, beside a pure eager run without the callback. Shows whether in-run eager steps cost what a pure eager run
does, by their position in the eager chunk (the first of each is a mode switch and not used by FuseCallback);
``--presets`` bisects a slow eager reference (which installed piece, regions or graph, slows the eager steps).

    python benchmarks/step_trace.py --out $OUT/trace --regimes gpt:8,gpt:64 --presets default,no_graph,graph_only
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import peers_measure as pm  # noqa: E402
from lightning_fuse import FuseCallback  # noqa: E402
from lightning_fuse.compiler import forced_eager  # noqa: E402

# FuseCallback settings to bisect a slow eager reference with: what is installed besides the eager window.
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},  # regions compiled and one CUDA graph (the default plan on one GPU)
    "no_graph": {"cuda_graph": False},  # regions compiled, no graph
    "graph_only": {"targets": []},  # the graph over the eager model, nothing compiled
    "nothing": {"targets": [], "cuda_graph": False},  # only the eager window switching stance
}
OP_PROFILE: Path | None = None  # --op-profile: where the OpProfile tables go
TINY = False  # --tiny: the CPU smoke models of peers_measure


class LabelledClock(pm.StepClock):
    """The benchmark clock, placed after FuseCallback: each step is also labelled by the stance it ran under, with
    its host time (no sync), the CUDA memory segments it had to allocate (cudaMalloc) and the full garbage
    collections that ran during it."""

    def __init__(self, steps: int) -> None:
        super().__init__(warmup=0, steps=steps, sync_at=())
        self.eager: list[bool] = []
        self.host: list[dict[str, float]] = []
        self._gen2 = 0
        gc.callbacks.append(self._count_gc)

    def _count_gc(self, phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            self._gen2 += 1

    def _counters(self) -> tuple[float, int, int]:
        segments = torch.cuda.memory_stats().get("segment.all.allocated", 0) if self.cuda else 0
        return time.perf_counter(), segments, self._gen2

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.eager.append(forced_eager())
        self._before = self._counters()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        after = self._counters()
        self.host.append({"host_ms": 1e3 * (after[0] - self._before[0]), "segments": after[1] - self._before[1],
                          "gc2": after[2] - self._before[2]})  # fmt: skip

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        gc.callbacks.remove(self._count_gc)

    def steps_ms(self) -> list[tuple[bool, float, dict[str, float]]]:
        if self.cuda:
            torch.cuda.synchronize()
        return [(e, self.elapsed_ms(a, b), h) for e, a, b, h in zip(self.eager, self.starts, self.ends, self.host)]


class OpProfile(pl.Callback):
    """Records one eager reference step (the second of the middle chunk) with ``torch.profiler`` and writes the ops
    by host time, to compare a slow in-run eager step with one from a run where nothing is compiled."""

    def __init__(self, path: Path, eager_steps: int) -> None:
        self.path = path
        self.target_chunk = eager_steps // 6  # chunks of 3: the middle one
        self._chunk, self._run, self._profiler = -1, 0, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        eager = forced_eager()
        self._run = self._run + 1 if eager else 0
        self._chunk += eager and self._run == 1
        if eager and self._run == 2 and self._chunk == self.target_chunk:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._profiler is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._profiler.__exit__(None, None, None)
            table = self._profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            self.path.write_text(table)
            self._profiler = None


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def fit(task: pl.LightningModule, loader, callbacks: list[pl.Callback], cache: Path, steps: int, **trainer_kw: Any):
    trainer = pl.Trainer(accelerator="auto", devices=1, precision="bf16-mixed", max_steps=steps, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=callbacks, **trainer_kw)  # fmt: skip
    with pm.compile_caches(cache):
        trainer.fit(task, train_dataloaders=loader)


def eager_check(model: str, batch: int, steps: int, eager_steps: int, cache: Path, preset: str) -> dict[str, Any]:
    """In-run eager steps by position in their chunk, against a pure eager run (no callback) in the same process."""
    device = _device()
    out: dict[str, Any] = {"model": model, "batch_size": batch, "steps": steps, "eager_steps": eager_steps,
                           "preset": preset, "settings": PRESETS[preset]}  # fmt: skip
    out["pure_eager_ms"] = pm.measure(model, batch, "eager", warmup=20, steps=steps - 20, cache_root=cache,
                                      tiny=TINY)["step_ms"]  # fmt: skip
    for _attempt in ("cold", "warm"):  # the first pass fills the compile cache
        pl.seed_everything(0, verbose=False)
        task = pm.build_task(model, tiny=TINY)
        clock = LabelledClock(steps)
        fuse = FuseCallback(eager_steps=eager_steps, cache_dir=str(cache / "fuse" / preset), **PRESETS[preset])
        callbacks: list[pl.Callback] = [fuse, clock]
        if OP_PROFILE is not None:
            callbacks.append(OpProfile(OP_PROFILE / f"ops-{model}{batch}-{preset}.txt", eager_steps))
        fit(task, pm.random_loader(model, batch, steps, TINY, device), callbacks, cache / preset, steps)
        pm.free_memory()
    timed = clock.steps_ms()[20:]
    position: dict[str, list[tuple[float, dict[str, float]]]] = {}
    run = 0
    for i, (eager, ms, host) in enumerate(timed):
        run = run + 1 if i and eager == timed[i - 1][0] else 1
        position.setdefault(f"{'eager' if eager else 'compiled'}_{min(run, 4)}", []).append((ms, host))
    out["by_position"] = {
        key: {"n": len(rows), "gpu_ms": round(statistics.median(ms for ms, _ in rows), 3),
              "host_ms": round(statistics.median(h["host_ms"] for _, h in rows), 3),
              "segments": sum(h["segments"] for _, h in rows), "gc2": sum(h["gc2"] for _, h in rows)}
        for key, rows in sorted(position.items())
    }  # fmt: skip
    out["fuse_plan"] = fuse.plan.describe() if fuse.plan else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--regimes", default="gpt:8,gpt:64,resnet:16")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eager-steps", type=int, default=30)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/step-trace-cache"))
    parser.add_argument("--presets", default="default", help=f"comma-separated, of: {', '.join(PRESETS)}")
    parser.add_argument("--tiny", action="store_true", help="tiny models (a CPU smoke run of this script)")
    parser.add_argument("--op-profile", action="store_true", help="also write the ops of one in-run eager step")
    args = parser.parse_args()
    global TINY, OP_PROFILE
    TINY = args.tiny
    OP_PROFILE = args.out if args.op_profile else None
    args.out.mkdir(parents=True, exist_ok=True)
    pm.configure_process()
    env = pm.environment()
    for regime in args.regimes.split(","):
        model, batch = regime.split(":")
        for preset in args.presets.split(","):
            result = eager_check(model, int(batch), args.steps, args.eager_steps, args.cache, preset)
            result.update(env=env, command=" ".join(sys.argv))
            print(json.dumps(result), flush=True)
            with open(args.out / "eager_check.jsonl", "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
