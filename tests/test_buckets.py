"""Opt-in shape buckets (lightning_fuse.buckets): exact padding, refusals, and a fit with varying lengths."""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_fuse import FuseCallback
from lightning_fuse.buckets import PadToBuckets
from tests.toy import trainer


def test_pads_to_the_smallest_bucket_that_holds_the_batch_and_counts_the_waste():
    buckets = PadToBuckets([4, 8])
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3),
             "labels": torch.ones(2, 3, dtype=torch.long), "score": torch.ones(2)}  # fmt: skip
    buckets(batch)
    assert batch["input_ids"].shape == (2, 4) and batch["attention_mask"][:, 3].tolist() == [0.0, 0.0]
    assert batch["labels"][:, 3].tolist() == [-100, -100] and batch["score"].shape == (2,)
    long = {"input_ids": torch.ones(1, 9, dtype=torch.long)}
    buckets(long)  # longer than every bucket: left as it is
    assert long["input_ids"].shape == (1, 9) and buckets.waste == pytest.approx(2 / 8)


def test_refuses_what_it_cannot_pad_exactly():
    with pytest.raises(ValueError, match="cannot pad batch key 'pixel_values'"):
        PadToBuckets([8])({"input_ids": torch.ones(1, 3), "pixel_values": torch.ones(1, 3, 4)})
    with pytest.raises(ValueError, match="pads dict batches"):
        PadToBuckets([8])((torch.ones(1, 3),))
    with pytest.raises(ValueError, match="`pad_buckets` must be a list of positive lengths"):
        FuseCallback(pad_buckets=[0, 8])


class Pooler(nn.Module):
    """A masked mean-pool classifier: padding (mask 0) cannot change its output."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        return self.head(h.sum(1) / attention_mask.sum(1, keepdim=True))


class TokenTask(pl.LightningModule):
    """Padded token batches, the network called with keyword arguments."""

    def __init__(self):
        super().__init__()
        self.model = Pooler()
        self.losses = []

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss = nn.functional.cross_entropy(logits, batch["label"])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(3, 15, (48,), generator=g).tolist()
        rows = [(torch.randint(1, 20, (n,), generator=g), n % 2) for n in lengths]
        return DataLoader(rows, batch_size=4, collate_fn=pad_to_longest)


def pad_to_longest(rows):
    longest = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest)
    for i, (row, _) in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "label": torch.tensor([label for _, label in rows])}


def test_a_fit_with_buckets_trains_like_eager_and_compiles_once_per_bucket():
    pl.seed_everything(0, verbose=False)
    eager = TokenTask()
    trainer([], max_epochs=1).fit(eager)
    pl.seed_everything(0, verbose=False)
    fused = TokenTask()
    fuse = FuseCallback(mode="default", targets="full", backend="aot_eager", cache_dir=False, eager_steps=0,
                        dynamic_dims=None, pad_buckets=[8, 16])  # fmt: skip
    trainer([fuse], max_epochs=1).fit(fused)
    torch.testing.assert_close(fused.losses, eager.losses, rtol=1e-5, atol=1e-6)
    assert fuse.tracker.stats("model").compiles <= 2  # one per bucket, whatever the batches' own lengths
    assert 0 < fuse.history[0]["fuse/pad_waste"] < 1
