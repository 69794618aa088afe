"""Models written the way users write them, and the harness that fits each with and without FuseCallback.

Every fit here is small (2 epochs of 12 steps on CPU) and compiles with ``aot_eager`` (or ``eager``), so a test
costs seconds. :func:`fit` seeds, builds the task, fits it and records every step's losses; :func:`assert_same_training`
compares two fits step by step and parameter by parameter. :func:`pin_search` makes ``mode="auto"`` pick a compiled
plan on CPU (where eager usually measures fastest), so the compiled code really trains in the fits compared.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import lightning as L
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, TensorDataset

import lightning_fuse.callback as fuse_callback
from lightning_fuse import FuseCallback
from lightning_fuse.search import TIMED_CALLS, PlanSearch
from tests.toy import Net

BATCH = 8
STEPS = 12  # batches per epoch
SAMPLES = BATCH * STEPS  # no partial last batch: the batch dim never changes
FP32 = {"rtol": 1e-4, "atol": 1e-5}
BF16 = {"rtol": 5e-2, "atol": 5e-2}


# ---------------------------------------------------------------------------------------------- the harness
@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Intra-op threads only cost on these tiny tensors (10x slower steps on a loaded 2-core machine)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


class LossRecorder(Callback):
    """Records what every training step returned (its loss, or a dict of losses), as floats."""

    def __init__(self) -> None:
        self.losses: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if isinstance(outputs, torch.Tensor):
            outputs = {"loss": outputs}
        assert isinstance(outputs, Mapping), f"training_step returned {type(outputs).__name__}"
        self.losses.append({k: float(v) for k, v in outputs.items() if isinstance(v, torch.Tensor)})


@dataclass
class Run:
    task: pl.LightningModule
    losses: list[dict[str, float]]
    trainer: pl.Trainer


def fit(make_task: Callable[[], pl.LightningModule], callbacks: Sequence[Callback] = (), seed: int = 0,
        **trainer_kwargs) -> Run:  # fmt: skip
    """Seed, build the task, fit it for 2 epochs on CPU, and return it with every step's losses."""
    L.seed_everything(seed, verbose=False)
    task = make_task()
    recorder = LossRecorder()
    settings = {
        "accelerator": "cpu", "devices": 1, "max_epochs": 2, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }  # fmt: skip
    settings.update(trainer_kwargs)
    trainer = pl.Trainer(callbacks=[*callbacks, recorder], **settings)
    trainer.fit(task)
    return Run(task, recorder.losses, trainer)


def assert_same_training(fused: Run, eager: Run, rtol: float = FP32["rtol"], atol: float = FP32["atol"]) -> None:
    """Same losses at every step and the same final parameters, within ``rtol``/``atol``."""
    assert len(fused.losses) == len(eager.losses) == 2 * STEPS
    for step, (got, want) in enumerate(zip(fused.losses, eager.losses)):
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=rtol, atol=atol,
                                       msg=lambda m, s=step, k=key: f"step {s} {k}: {m}")  # fmt: skip
    fused_params, eager_params = dict(fused.task.named_parameters()), dict(eager.task.named_parameters())
    assert fused_params.keys() == eager_params.keys()
    for name, want in eager_params.items():
        torch.testing.assert_close(fused_params[name].float(), want.float(), rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"parameter {n}: {m}")  # fmt: skip
    assert all(m._compiled_call_impl is None for m in fused.task.modules())  # the model is plain eager again


def fuse(**kwargs) -> FuseCallback:
    kwargs.setdefault("backend", "aot_eager")
    kwargs.setdefault("cache_dir", False)
    return FuseCallback(**kwargs)


def pin_search(monkeypatch, winner: str = "regions") -> None:
    """Make ``mode="auto"`` choose ``winner``: the search's timing says it is fastest, every other plan slower than
    eager; and keep it for the fit (on CPU ``aot_eager`` measures slower than eager, which would drop it).

    Every candidate the search tries still runs its forward and backward on the fit's inputs, so a candidate
    that fails is still dropped with its reason.
    """

    def pinned_time(self, plan, call):
        call()
        return [1.0 if plan.name == winner else 10.0 if plan.name == "eager" else 20.0] * TIMED_CALLS

    monkeypatch.setattr(PlanSearch, "_time", pinned_time)
    monkeypatch.setattr(fuse_callback, "SLOWER_THAN_EAGER", 0.0)
    monkeypatch.setattr(fuse_callback, "CLEARLY_SLOWER", 0.0)


def fused_and_eager(make_task: Callable[[], pl.LightningModule], **fit_kwargs) -> tuple[Run, Run, FuseCallback]:
    """Fit ``make_task()`` eagerly and with FuseCallback; the test checks them (:func:`assert_plan_ran`,
    :func:`assert_same_training`)."""
    eager = fit(make_task, **fit_kwargs)
    cb = fuse()
    fused = fit(make_task, [cb], **fit_kwargs)
    return fused, eager, cb


def assert_plan_ran(cb: FuseCallback, winner: str) -> None:
    """The search chose ``winner``, it was kept for the whole fit, and no region fell back."""
    assert cb.decision is not None and cb.decision.winner == winner, cb.decision and cb.decision.lines()
    assert cb.plan.name == winner, cb.fit.dropped
    assert cb.fit.dropped is None
    assert cb.fallbacks == {}
    assert cb.tracker.total_compiles > 0
    assert [row["plan"] for row in cb.history] == [winner, winner]
    assert all(row["fuse/compiled"] == 1.0 for row in cb.history)


# ---------------------------------------------------------------------------------------------- plain blocks
class BlockNet(Net):
    """Embedding, repeated blocks (optionally under activation checkpointing, or each skipped at random in training
    with probability ``layer_drop``, as HF Wav2Vec2 does), a head."""

    def __init__(self, width: int = 16, depth: int = 3, classes: int = 4, use_reentrant: bool | None = None,
                 layer_drop: float = 0.0) -> None:  # fmt: skip
        super().__init__(width, depth, classes)
        self.use_reentrant = use_reentrant  # None: no checkpointing
        self.layer_drop = layer_drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            if self.training and self.layer_drop and bool(torch.rand(()) < self.layer_drop):  # a sync on a GPU
                continue
            if self.use_reentrant is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x)


def features(seed: int = 0, samples: int = SAMPLES, tokens: int | None = None) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    shape = (samples, 8) if tokens is None else (samples, tokens, 8)
    x = torch.randn(*shape, generator=g)
    y = (x[..., 0] > 0).long() + 2 * (x[..., 1] > 0).long()
    return TensorDataset(x, y)


class ClassifierTask(pl.LightningModule):
    """Cross-entropy over random features with ``self.model``; only parameters that require grad are optimized."""

    def __init__(self, model: nn.Module, lr: float = 0.05, momentum: float = 0.9, dataset: Dataset | None = None):
        super().__init__()
        self.model = model
        self.lr, self.momentum = lr, momentum
        self.dataset = dataset if dataset is not None else features()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr, momentum=self.momentum)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=BATCH)


class ShardedTask(ClassifierTask):
    """FSDP2 as Lightning's ``ModelParallelStrategy`` asks for it: ``fully_shard`` on each block, then the network,
    in ``configure_model``; ``mixed``: in bf16 under FSDP2's mixed-precision policy (its hooks cast the inputs).
    AdamW (torch's default implementation), whose update FuseCallback may replay from a graph."""

    def __init__(self, mixed: bool = False) -> None:
        super().__init__(BlockNet())
        self.mixed = mixed

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if self.mixed else None)
        for block in self.model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(self.model, mp_policy=policy)


class FrozenBackboneTask(ClassifierTask):
    """The embedding and the first two blocks frozen (``requires_grad_(False)``): a fine-tuning setup."""

    def __init__(self) -> None:
        super().__init__(BlockNet(depth=4))
        self.model.embed.requires_grad_(False)
        for block in self.model.blocks[:2]:
            block.requires_grad_(False)


class UserCompiledTask(ClassifierTask):
    """The user compiled the network before the fit."""

    def __init__(self, compile_it: bool) -> None:
        super().__init__(BlockNet())
        if compile_it:
            self.model.compile(backend="eager")


# ---------------------------------------------------------------------------------------------- a GAN, manual
class GanTask(pl.LightningModule):
    """A GAN-style step: manual optimization, two optimizers, ``manual_backward`` twice, noise drawn in the step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = Net(16, depth=2, classes=8, inputs=4)
        self.discriminator = Net(16, depth=2, classes=1, inputs=8)
        self.discriminator.out = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))  # the bigger one
        self.dataset = TensorDataset(torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(0)) + 2.0)

    def training_step(self, batch, batch_idx):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        noise = torch.randn(real.shape[0], 4, device=self.device)
        fake = self.generator(noise)

        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        d_loss = (F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                  + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros))  # fmt: skip
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        return {"d_loss": d_loss.detach(), "g_loss": g_loss.detach()}

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=1e-3),
                torch.optim.Adam(self.discriminator.parameters(), lr=1e-3))  # fmt: skip

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=BATCH)


# ---------------------------------------------------------------------------------------------- varying lengths
class AttentionBlock(nn.Module):
    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm2(x))


class SequenceNet(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 16, depth: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(AttentionBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        keep = mask[..., None].to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1))  # masked mean over the real tokens


class Sequences(Dataset):
    """Token sequences of lengths 5 to 16; the label is a function of the tokens."""

    def __init__(self, samples: int = SAMPLES, vocab: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(5, 17, (samples,), generator=g)
        lengths[:2] = torch.tensor([5, 16])  # both extremes occur
        self.items = [torch.randint(1, vocab, (int(n),), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


def pad_to_longest(items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collate: pad every sequence to the batch's longest (token 0, mask False)."""
    longest = max(len(item) for item in items)
    tokens = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.bool)
    for row, item in enumerate(items):
        tokens[row, : len(item)] = item
        mask[row, : len(item)] = True
    labels = torch.stack([item.sum() % 3 for item in items])
    return {"tokens": tokens, "mask": mask, "labels": labels}


class VariableLengthTask(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = SequenceNet()
        self.dataset = Sequences()

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.model(batch["tokens"], batch["mask"]), batch["labels"])
        self.log("train_loss", loss, batch_size=BATCH)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=BATCH, collate_fn=pad_to_longest)

    def sequence_lengths(self) -> list[int]:
        return [batch["tokens"].shape[1] for batch in self.train_dataloader()]


# ---------------------------------------------------------------------------------------------- mixture of experts
class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """Top-1 gating: each token goes to its argmax expert, found with ``torch.nonzero`` and boolean indexing."""

    def __init__(self, width: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(Expert(width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.norm(x).reshape(-1, x.shape[-1])
        weight, choice = F.softmax(self.gate(flat), dim=-1).max(dim=-1)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            chosen = choice == index
            rows = torch.nonzero(chosen, as_tuple=True)[0]
            if rows.numel() == 0:  # data-dependent: an expert may get no token in a batch
                continue
            out = out.index_add(0, rows, expert(flat[chosen]) * weight[chosen].unsqueeze(-1))
        return x + out.reshape(x.shape)


def moe_net(width: int = 16, depth: int = 2, classes: int = 4) -> Net:
    return Net(width, depth, classes, block=MoEBlock)


# ---------------------------------------------------------------------------------------------- Hugging Face
def tiny_gpt2(dropout: float = 0.0, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, **overrides)  # fmt: skip
    return GPT2LMHeadModel(config)


def tiny_opt(**overrides):
    """OPT, whose layers write dropout as a function (``F.dropout(x, p=self.dropout, ...)``, 0.1 by default)."""
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                       max_position_embeddings=32, word_embed_proj_dim=32, **overrides)  # fmt: skip
    return OPTForCausalLM(config)


def tiny_bert_classifier(**overrides):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2, **overrides)  # fmt: skip
    return BertForSequenceClassification(config)


def token_batches(seed: int = 0, samples: int = SAMPLES, length: int = 16, vocab: int = 64,
                  classify: bool = False) -> TensorDataset:  # fmt: skip
    """input_ids, an attention mask with right padding (lengths 8 to 16), and labels (-100 on padding for an LM;
    a class per sequence for a classifier)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (samples, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (samples,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids = ids * mask  # pad token 0
    if classify:
        labels = (ids[:, 0] % 2).long()
    else:
        labels = ids.masked_fill(mask == 0, -100)
    return TensorDataset(ids, mask, labels)


class HFTask(pl.LightningModule):
    """A Hugging Face model called the usual way: ``self.model(input_ids=..., attention_mask=..., labels=...)``."""

    def __init__(self, model: nn.Module, classify: bool = False, lr: float = 1e-2,
                 gradient_checkpointing: bool | None = None) -> None:  # fmt: skip
        super().__init__()
        self.model = model
        self.lr = lr
        if gradient_checkpointing is not None:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": gradient_checkpointing})
        self.dataset = token_batches(classify=classify)

    def training_step(self, batch, batch_idx):
        input_ids, attention_mask, labels = batch
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        self.log("train_loss", out.loss, batch_size=BATCH)
        return out.loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=BATCH)


class ShardedHFTask(HFTask):
    """An HF GPT-2 sharded with FSDP2 as Lightning's ``ModelParallelStrategy`` asks for it: ``fully_shard`` on each
    transformer block, then the model, in ``configure_model``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for block in self.model.transformer.h:
            fully_shard(block)
        fully_shard(self.model)


def lora_gpt2():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
                        lora_dropout=0.0)  # fmt: skip
    return get_peft_model(tiny_gpt2(use_cache=False), config)  # see test_hf: regions + the KV cache
