"""Does a FuseCallback run leave its process slower or faster at eager steps? A diagnostic beside ``recipes.sh``.

The speedup FuseCallback logs divides eager steps by compiled steps of the same process. A separate eager-only run
is another process. If compiling changes how fast the process runs host code (a pool of compile workers, say), the
two disagree however long either runs. This script trains the recipe's GPT-8L task in one process, alternating fits
without any callback (``plain``) and with ``FuseCallback()`` (``fuse``), and writes per fit the median step time of
plain steps, or of the fuse fit's compiled and in-run eager steps, with the CPU seconds that the process's children
(compile workers, data workers) used during the fit::

    python benchmarks/process_check.py --out $OUT/process --batch 8 --order plain,fuse,plain,fuse,plain

Steps are timed start to next start with FuseCallback's own :class:`~lightning_fuse.timing.StepTimer`, labelled by
whether they ran under ``force_eager`` (``eager``: the reference chunks, their lead-in steps included) or not
(``compiled``: so every step of a plain fit); the first 10 of each label are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import peers_measure as pm  # noqa: E402
from lightning_fuse import FuseCallback  # noqa: E402
from lightning_fuse.compiler import forced_eager  # noqa: E402
from lightning_fuse.timing import StepTimer  # noqa: E402

SETTLE = 10


class LabelledSteps(pl.Callback):
    """Every step's time, labelled ``eager`` (under force_eager) or ``compiled``; placed after FuseCallback."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.timer = StepTimer(pl_module.device)
        self.timer.reserve(4096)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.timer.start()
        self.timer.stop("eager" if forced_eager() else "compiled")

    def medians(self) -> dict[str, float]:
        marks = self.timer.collect()
        return {kind: round(statistics.median(ms[SETTLE:] or ms), 3) for kind, ms in marks.items()}


def children_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process's live children."""
    total, me = 0.0, str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # ppid
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def one_fit(kind: str, batch: int, steps: int, cache: Path, tiny: bool, backend: str = "inductor") -> dict[str, object]:
    pl.seed_everything(0, verbose=False)
    task = pm.build_task("gpt", tiny)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    steps_cb = LabelledSteps()
    callbacks: list[pl.Callback] = [FuseCallback(cache_dir=str(cache), backend=backend)] if kind == "fuse" else []
    trainer = pl.Trainer(accelerator="auto", devices=1, precision="bf16-mixed" if device.type == "cuda" else "32-true",
                         max_steps=steps, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[*callbacks, steps_cb])  # fmt: skip
    cpu_before, start = children_cpu_s(), time.perf_counter()
    trainer.fit(task, train_dataloaders=pm.random_loader("gpt", batch, steps, tiny, device))
    out = {"fit": kind, "wall_s": round(time.perf_counter() - start, 1),
           "children_cpu_s": round(children_cpu_s() - cpu_before, 2), **steps_cb.medians()}  # fmt: skip
    pm.free_memory()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--order", default="plain,fuse,plain,fuse,plain")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/process-check-cache"))
    parser.add_argument("--tiny", action="store_true", help="tiny model (a CPU smoke run of this script)")
    parser.add_argument("--backend", default="inductor", help="FuseCallback's backend (aot_eager for a smoke run)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pm.configure_process()
    record = {"batch": args.batch, "steps": args.steps, "env": pm.environment(), "command": " ".join(sys.argv),
              "fits": []}  # fmt: skip
    for kind in args.order.split(","):
        record["fits"].append(one_fit(kind, args.batch, args.steps, args.cache, args.tiny, args.backend))
        print(json.dumps(record["fits"][-1]), flush=True)
    with open(args.out / "process_check.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
