"""Quick GPU check of FuseCallback's plans on the GPT recipe model (not a benchmark: a few steps each)."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_fuse import FuseCallback
from recipes.models import GPT
from recipes.tasks import LanguageModel


def loader(batch: int, steps: int) -> DataLoader:
    tokens = torch.randint(0, 8192, (batch * steps, 257), generator=torch.Generator().manual_seed(0))
    data = TensorDataset(tokens[:, :-1].cuda(), tokens[:, 1:].cuda())
    return DataLoader(data, batch_size=batch)


def run(name: str, callback, batch: int = 8, steps: int = 60) -> None:
    pl.seed_everything(0)
    task = LanguageModel(GPT(vocab_size=8192, max_seq_len=256, n_layer=8, d_model=512, n_head=8), cosine=False)
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback] if callback else [], num_sanity_val_steps=0)
    t0 = time.perf_counter()
    trainer.fit(task, train_dataloaders=loader(batch, steps))
    wall = time.perf_counter() - t0
    hist = callback.history[-1] if callback else {}
    print(f"RESULT {name}: wall {wall:.1f}s step_ms={hist.get('fuse/step_ms')} eager_ms={hist.get('fuse/eager_step_ms')}"
          f" speedup={hist.get('fuse/speedup')} compile_s={hist.get('fuse/compile_s')} util={hist.get('fuse/gpu_util')}"
          f" mfu={hist.get('fuse/mfu')} replays={callback.graph.replays if callback and callback.graph else None}",
          flush=True)


if __name__ == "__main__":
    torch.set_float32_matmul_precision("high")
    run("regional+graph", FuseCallback(cache_dir="/tmp/fuse_cache"))
    run("graph-only", FuseCallback(targets=[], cache_dir="/tmp/fuse_cache"))
    run("regional", FuseCallback(cuda_graph=False, cache_dir="/tmp/fuse_cache"))
    run("regional+graph warm", FuseCallback(cache_dir="/tmp/fuse_cache"))
