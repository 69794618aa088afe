"""FuseCallback's own cost per training step: time spent inside its per-step hooks.

Every per-step hook of the callback is wrapped with ``time.perf_counter`` during a real fit (eager model, so
nothing is compiled and no step-time noise from compiling enters); the mean microseconds per step, divided by a
step time, is the callback's overhead. The hooks queue CUDA events on a GPU and never synchronise, so their CPU
time is their whole cost; the background NVML sampler thread is measured by its own switch (``--no-nvml``).

    python benchmarks/overhead.py --device cuda --steps 600 --step-ms 5.42 13.0
"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_fuse import FuseCallback  # noqa: E402

HOOKS = ("on_train_batch_start", "on_train_batch_end")


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def measure(device: str, steps: int, nvml: bool, profile: cProfile.Profile | None = None) -> dict:
    fuse = FuseCallback(targets=[], cuda_graph=False, cache_dir=False, gpu_sample_hz=10.0 if nvml else 0)
    spent: dict[str, list[float]] = {hook: [] for hook in HOOKS}
    for hook in HOOKS:
        original = getattr(fuse, hook)

        def timed(*args, _original=original, _hook=hook, **kwargs):
            if profile is not None:
                profile.enable()
            start = time.perf_counter()
            _original(*args, **kwargs)
            spent[_hook].append(time.perf_counter() - start)
            if profile is not None:
                profile.disable()

        setattr(fuse, hook, timed)
    data = TensorDataset(torch.randn(steps * 8, 32), torch.randint(0, 4, (steps * 8,)))
    trainer = pl.Trainer(accelerator=device, devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[fuse])
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))
    per_step = [a + b for a, b in zip(*spent.values())][10:]  # the first steps set up state
    return {"device": device, "nvml": nvml, "steps": len(per_step), "mean_us": 1e6 * statistics.mean(per_step),
            "median_us": 1e6 * statistics.median(per_step), "p99_us": 1e6 * sorted(per_step)[int(0.99 * len(per_step))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--step-ms", type=float, nargs="*", default=[5.42, 13.0],
                        help="step times to relate the cost to (default: H100 fuse steps, GPT-8L bs 8 and 64)")
    parser.add_argument("--profile", action="store_true", help="also print the hooks' top functions (cProfile)")
    args = parser.parse_args()
    if args.profile:  # a separate run: cProfile slows the hooks it measures
        profile = cProfile.Profile()
        measure(args.device, args.steps, True, profile)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
        print(text.getvalue())
    for nvml in (True, False):
        result = measure(args.device, args.steps, nvml)
        result["share_of_step"] = {f"{ms} ms": result["mean_us"] / (ms * 1e3) for ms in args.step_ms}
        print(json.dumps(result))


if __name__ == "__main__":
    main()
