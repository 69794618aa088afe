"""The models and variants every benchmark shares: ``MODELS[name] = (source, build, small batch, large batch)``.

Each model is built from a config with random weights (nothing is downloaded), wrapped in :class:`Task` (the
network as ``self.model``, AdamW, fused on CUDA) with random batches that move to the device once, at fit start.
``smoke=True`` builds a tiny version on small inputs. To list the models with their parameters:

    python benchmarks/models.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import harness
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_fuse import FuseCallback
from lightning_fuse.profiling import ProfileWindow
from lightning_fuse.timing import EAGER, LEAD_IN
from recipes.models import GPT, resnet18_cifar
from recipes.tasks import warmup_cosine

VARIANTS = ("eager", "compile", "reduce_overhead", "regional", "fuse")
EMULATED_CASTS = {"options": {"emulate_precision_casts": True}}
"""FuseCallback's arguments for the benchmarks' ``fuse_emulated_casts``: inductor rounds each intermediate to bf16
where eager's op would (a fused kernel otherwise keeps them in float32)."""
EAGER_RANDOM = {"options": {"fallback_random": True}}
"""FuseCallback's arguments for the benchmarks' ``fuse_eager_random``: inductor draws dropout's masks with eager's own
random ops, from the same generator, instead of its own Philox kernels (which draw other masks from the same seed)."""
DISTINCT_BATCHES = 4
"""Random batches per fit, cycled: enough that no step reuses the last one's inputs."""


class Batches(Dataset):
    """``length`` ready batches cycling over a few random ones, from the ``shift``-th on (a data-parallel rank's
    own); :meth:`to` moves them all to a device."""

    def __init__(self, batches: list[Any], length: int, shift: int = 0) -> None:
        self.batches, self.length, self.shift = batches, length, shift

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.batches[(index + self.shift) % len(self.batches)]

    def to(self, device: torch.device) -> None:
        move = partial(torch.utils._pytree.tree_map, lambda t: t.to(device) if isinstance(t, Tensor) else t)
        self.batches = [move(batch) for batch in self.batches]


class Task(pl.LightningModule):
    """The LightningModule of every benchmark: ``loss_fn(self.model, batch)``, AdamW (fused on CUDA).

    Args:
        net: The network, kept as ``self.model``.
        loss_fn: ``(model, batch) -> loss``.
        data: The batches; moved to the device at fit start, so no step copies its inputs.
        lr: AdamW's learning rate.
        scheduler: Step a warmup-then-cosine ``LambdaLR`` every step.
        fused: A fused AdamW on CUDA, else torch's default, foreach (Lightning refuses to clip a fused optimizer's
            gradients under mixed precision).

    Set ``fully_shard`` before the fit to shard it with FSDP2 (the strategy must be ``ModelParallelStrategy``).
    """

    def __init__(self, net: nn.Module, loss_fn: Callable, data: Batches, lr: float = 3e-4, scheduler: bool = False,
                 fused: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.model, self.loss_fn, self.data, self.lr, self.scheduler = net, loss_fn, data, lr, scheduler
        self.fused = fused
        self.fully_shard = False
        """FSDP2, under Lightning's ``ModelParallelStrategy``: ``fully_shard`` each repeated block, then the network,
        in :meth:`configure_model` (as torchtitan shards)."""

    def configure_model(self) -> None:
        if not self.fully_shard:
            return
        from torch.distributed.fsdp import fully_shard

        for block in repeated_blocks(self.model):
            if block is not self.model:
                fully_shard(block)
        fully_shard(self.model)

    def on_fit_start(self) -> None:
        self.data.to(self.device)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.loss_fn(self.model, batch)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.model.parameters() if p.requires_grad]
        # fused=False would not mean foreach: an explicit False leaves torch's default, foreach, off (a Python loop)
        optimizer = torch.optim.AdamW(params, lr=self.lr, fused=(self.fused and self.device.type == "cuda") or None)
        if not self.scheduler:
            return optimizer
        total = max(self.trainer.max_steps, 1)
        factor = partial(warmup_cosine, warmup_steps=min(20, total // 10 + 1), total_steps=total)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def hf_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(**batch).loss  # a transformers ModelOutput


def classify(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def next_token(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    tokens, targets = batch  # (B, T) each
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def token_batches(batch: int, seq: int, vocab: int, target_len: int | None = None, classes: int = 0,
                  padded: bool = False) -> list[dict]:  # fmt: skip
    """Causal-LM batches (labels = inputs), seq2seq ones (``target_len``) or classification ones (``classes``);
    ``padded``: each row's text is 1/2 to all of ``seq`` long, the rest masked out (padding to the longest)."""
    out = []
    for _ in range(DISTINCT_BATCHES):
        ids = torch.randint(0, vocab, (batch, seq))
        mask = torch.ones_like(ids)
        if padded:
            lengths = torch.randint(seq // 2, seq + 1, (batch, 1))
            mask = (torch.arange(seq) < lengths).long()
        labels = torch.randint(0, classes, (batch,)) if classes else ids
        if target_len:
            labels = torch.randint(0, vocab, (batch, target_len))
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


MARKOV_TOKENS = 256
"""The tokens of :func:`markov_batches`' chain (a random subset of the vocabulary)."""
MARKOV_SUCCESSORS = 4
"""Each token of the chain is followed by one of this many, the ``k``-th with probability proportional to ``1/k``:
the text's entropy is 1.24 nats a token, which a model learns towards however many batches it sees."""


def markov_batches(batch: int, seq: int, vocab: int, count: int) -> list[dict]:
    """``count`` causal-LM batches of text from one random Markov chain (:data:`MARKOV_TOKENS`,
    :data:`MARKOV_SUCCESSORS`): text with structure to learn, where :func:`token_batches`' random tokens, cycled,
    can only be memorised. A memorising fit is chaotic (a change of rounding moves its loss curve by anything from
    nothing to tenfold, ``benchmarks/RESULTS.md``); a fit that learns the chain follows one curve, so two correct
    variants' losses can be held to each other.

    Example::

        >>> batches = markov_batches(batch=2, seq=5, vocab=100, count=3)
        >>> len(batches), batches[0]["input_ids"].shape, batches[0]["labels"] is batches[0]["input_ids"]
        (3, torch.Size([2, 5]), True)
    """
    chain = min(MARKOV_TOKENS, vocab)
    tokens = torch.randperm(vocab)[:chain]
    successors = torch.randint(0, chain, (chain, MARKOV_SUCCESSORS))
    weights = (1.0 / torch.arange(1, MARKOV_SUCCESSORS + 1)).expand(count * batch, -1)
    state = torch.randint(0, chain, (count * batch,))
    columns = [state]
    for _ in range(seq - 1):
        state = successors[state, torch.multinomial(weights, 1).squeeze(1)]
        columns.append(state)
    text = tokens[torch.stack(columns, 1)].view(count, batch, seq)
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids} for ids in text]


def image_batches(batch: int, side: int, classes: int, as_dict: bool = False) -> list[Any]:
    out = []
    for _ in range(DISTINCT_BATCHES):
        x, y = torch.randn(batch, 3, side, side), torch.randint(0, classes, (batch,))
        out.append({"pixel_values": x, "labels": y} if as_dict else (x, y))
    return out


def _hf(config_name: str, model_name: str, full: dict, tiny: dict, smoke: bool) -> nn.Module:
    import transformers

    config = getattr(transformers, config_name)(**(tiny if smoke else full))
    return getattr(transformers, model_name)(config)


TINY_TEXT = {"vocab_size": 128, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}


def gpt2(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    tiny = dict(n_layer=2, n_embd=32, n_head=2, n_positions=32, **TINY_TEXT)
    net = _hf("GPT2Config", "GPT2LMHeadModel", {}, tiny, smoke)  # GPT-2 small, 124M
    return net, hf_loss, token_batches(batch, 16 if smoke else 512, net.config.vocab_size)


def llama(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    full = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024)  # fmt: skip
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64, **TINY_TEXT)  # fmt: skip
    net = _hf("LlamaConfig", "LlamaForCausalLM", full, tiny, smoke)
    return net, hf_loss, token_batches(batch, 16 if smoke else 512, net.config.vocab_size)


def opt(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """OPT-125m, whose layers write dropout as a function (``F.dropout``, 0.1): no module tree shows it."""
    tiny = dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64,
                word_embed_proj_dim=32, **TINY_TEXT)  # fmt: skip
    net = _hf("OPTConfig", "OPTForCausalLM", {}, tiny, smoke)  # the config's defaults: OPT-125m
    return net, hf_loss, token_batches(batch, 16 if smoke else 512, net.config.vocab_size)


def mixtral(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """A Mixtral-style causal LM (8 experts, 2 per token): its experts run on the tokens routed to them, a
    data-dependent shape in every layer."""
    full = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
            "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
            "max_position_embeddings": 1024}  # fmt: skip
    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64,
            **TINY_TEXT}  # fmt: skip
    net = _hf("MixtralConfig", "MixtralForCausalLM", full, tiny, smoke)
    return net, hf_loss, token_batches(batch, 16 if smoke else 512, net.config.vocab_size)


def bert(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, **TINY_TEXT)
    net = _hf("BertConfig", "BertForSequenceClassification", {}, tiny, smoke)  # BERT-base, 2 labels
    return net, hf_loss, token_batches(batch, 16 if smoke else 128, net.config.vocab_size, classes=2)


def t5(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    full = dict(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64, decoder_start_token_id=0)  # t5-small
    tiny = dict(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, decoder_start_token_id=0, **TINY_TEXT)
    net = _hf("T5Config", "T5ForConditionalGeneration", full, tiny, smoke)
    seq = 16 if smoke else 256
    return net, hf_loss, token_batches(batch, seq, net.config.vocab_size, target_len=seq // 4)


def deberta(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """DeBERTa-v2 classifier on padded batches: its relative positions build a tensor from Python values in every
    forward (a host-to-device copy, which no CUDA graph capture survives)."""
    full = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                vocab_size=32000, relative_attention=True, position_buckets=256, pos_att_type=["p2c", "c2p"],
                max_position_embeddings=512, num_labels=2)  # deberta-v3-base's shape, a smaller vocab
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"], num_labels=2, **TINY_TEXT)
    net = _hf("DebertaV2Config", "DebertaV2ForSequenceClassification", full, tiny, smoke)
    return net, hf_loss, token_batches(batch, 16 if smoke else 256, net.config.vocab_size, classes=2, padded=True)


def llama_lora(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """The llama causal LM with a peft LoRA adapter (rank 16 on the attention projections), base weights frozen."""
    import peft

    net, loss, batches = llama(batch, smoke)
    config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return peft.get_peft_model(net, config), loss, batches


def vit(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    tiny = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                patch_size=8, num_labels=10)  # fmt: skip
    net = _hf("ViTConfig", "ViTForImageClassification", dict(num_labels=1000), tiny, smoke)
    return net, hf_loss, image_batches(batch, net.config.image_size, net.config.num_labels, as_dict=True)


def deit(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """DeiT-base: on an H200 (2026-11-29) its compiled blocks compiled again inside a CUDA graph's capture, so
    ``regions+graph`` fails and the network compiled whole carries the graph."""
    tiny = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                patch_size=8, num_labels=10)  # fmt: skip
    net = _hf("DeiTConfig", "DeiTForImageClassification", dict(num_labels=1000), tiny, smoke)
    return net, hf_loss, image_batches(batch, net.config.image_size, net.config.num_labels, as_dict=True)


def bloom(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """A BLOOM causal LM (ALiBi positions), 12 layers of 768: on an H200 (2026-11-29, at 6 layers of 512) its network
    synced with the host even compiled, so no CUDA graph of FuseCallback's own held it and torch's cudagraph trees
    (``reduce-overhead``) won."""
    full = dict(hidden_size=768, n_layer=12, n_head=12, vocab_size=32000)
    tiny = dict(hidden_size=32, n_layer=2, n_head=2, **TINY_TEXT)
    net = _hf("BloomConfig", "BloomForCausalLM", full, tiny, smoke)
    return net, hf_loss, token_batches(batch, 16 if smoke else 512, net.config.vocab_size)


def qwen3(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """A Qwen3 causal LM (RMS norms on queries and keys), 12 layers of 768 with its config's defaults otherwise
    (``use_cache`` on): on an H200 (2026-11-29, at 6 layers of 512) ``compile+graph``."""
    full = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=1024)  # fmt: skip
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=64, **TINY_TEXT)  # fmt: skip
    net = _hf("Qwen3Config", "Qwen3ForCausalLM", full, tiny, smoke)
    return net, hf_loss, token_batches(batch, 16 if smoke else 512, net.config.vocab_size)


def modernbert(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """ModernBERT-base classifier on padded batches (local attention in two layers of three, rotary positions):
    on an H200 (2026-11-29, at 6 layers of 512) ``regions+graph``."""
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, local_attention=8,
                cls_token_id=2, sep_token_id=3, **TINY_TEXT)  # fmt: skip
    net = _hf("ModernBertConfig", "ModernBertForSequenceClassification", dict(num_labels=2), tiny, smoke)
    return net, hf_loss, token_batches(batch, 16 if smoke else 256, net.config.vocab_size, classes=2, padded=True)


def swin(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """Swin-T (shifted windows, masks built per stage): on an H200 (2026-11-29, smaller) ``regions+graph``."""
    tiny = dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4,
                num_labels=10)  # fmt: skip
    net = _hf("SwinConfig", "SwinForImageClassification", dict(num_labels=1000), tiny, smoke)
    return net, hf_loss, image_batches(batch, net.config.image_size, net.config.num_labels, as_dict=True)


def speech_batches(batch: int, samples: int, vocab: int, label_len: int) -> list[dict]:
    """CTC batches: raw audio (``samples`` a row) and transcripts of ``label_len`` tokens, none the blank (0)."""
    return [{"input_values": torch.randn(batch, samples), "labels": torch.randint(1, vocab, (batch, label_len))}
            for _ in range(DISTINCT_BATCHES)]  # fmt: skip


def wav2vec2(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """Wav2Vec2 for CTC (wav2vec2-base's shape) on 2 s of 16 kHz audio: SpecAugment masks the frames in training
    with NumPy's global generator, and the CTC loss selects the labels by a mask (a data-dependent shape)."""
    tiny = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(32, 32),
                conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                vocab_size=32)  # fmt: skip
    net = _hf("Wav2Vec2Config", "Wav2Vec2ForCTC", dict(vocab_size=32), tiny, smoke)
    return net, hf_loss, speech_batches(batch, 400 if smoke else 32000, net.config.vocab_size, 4 if smoke else 24)


def gpt_neox(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """A GPT-NeoX causal LM in Pythia-160m's shape (attention and MLP side by side in each layer, rotary positions
    on a quarter of each head), a 32000-token vocabulary."""
    full = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                vocab_size=32000, max_position_embeddings=1024)  # fmt: skip
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=64, **TINY_TEXT)  # fmt: skip
    net = _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", full, tiny, smoke)
    return net, hf_loss, token_batches(batch, 16 if smoke else 512, net.config.vocab_size)


def gemma3(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """A Gemma 3 causal LM, 12 layers of 768: five sliding-window layers (a 256-token window over 512 tokens, so
    the window masks) to one global, each kind with its own rotary table; norms on queries and keys."""
    full = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                num_key_value_heads=4, head_dim=64, query_pre_attn_scalar=64, vocab_size=32000, sliding_window=256,
                max_position_embeddings=1024)  # fmt: skip
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
                **TINY_TEXT)  # fmt: skip
    net = _hf("Gemma3TextConfig", "Gemma3ForCausalLM", full, tiny, smoke)
    return net, hf_loss, token_batches(batch, 16 if smoke else 512, net.config.vocab_size)


def whisper(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """Whisper-tiny (the config's defaults) on 30 s of log-mel features and 64-token transcripts: an encoder of
    1500 frames, a decoder whose config keeps its key-value cache on in training."""
    tiny = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
                max_target_positions=16, decoder_start_token_id=2, **TINY_TEXT)  # fmt: skip
    net = _hf("WhisperConfig", "WhisperForConditionalGeneration", {}, tiny, smoke)
    config = net.config
    frames, label_len = 2 * config.max_source_positions, 8 if smoke else 64  # the encoder's two convolutions halve
    return net, hf_loss, [{"input_features": torch.randn(batch, config.num_mel_bins, frames),
                           "labels": torch.randint(3, config.vocab_size, (batch, label_len))}
                          for _ in range(DISTINCT_BATCHES)]  # fmt: skip


def clip(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """CLIP ViT-B/32 (the config's defaults) trained contrastively on image and caption pairs: the loss pairs
    every image with every caption of the batch."""
    import transformers

    if smoke:
        text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    max_position_embeddings=16, **TINY_TEXT)  # fmt: skip
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      image_size=32, patch_size=8)  # fmt: skip
        config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    else:
        config = transformers.CLIPConfig()
    net = transformers.CLIPModel(config)
    text, vision = config.text_config, config.vision_config
    return net, hf_loss, [{"input_ids": torch.randint(3, text.vocab_size, (batch, text.max_position_embeddings)),
                           "pixel_values": torch.randn(batch, 3, vision.image_size, vision.image_size),
                           "return_loss": True} for _ in range(DISTINCT_BATCHES)]  # fmt: skip


def segformer(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    """SegFormer-B0 (the config's defaults) for 150-class segmentation of 512-pixel images: attention over
    spatially reduced keys, and a loss on logits upsampled to the label map. At the large batch (64) eager's
    upsampling raises on an H200 (its output holds more than INT_MAX elements) where ``reduce-overhead`` runs: a
    model that runs only compiled."""
    tiny = dict(num_channels=3, depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 16, 32], num_attention_heads=[1, 1, 1, 2],
                decoder_hidden_size=32, num_labels=10)  # fmt: skip
    net = _hf("SegformerConfig", "SegformerForSemanticSegmentation", dict(num_labels=150), tiny, smoke)
    side, classes = 32 if smoke else 512, net.config.num_labels
    return net, hf_loss, [{"pixel_values": torch.randn(batch, 3, side, side),
                           "labels": torch.randint(0, classes, (batch, side, side))}
                          for _ in range(DISTINCT_BATCHES)]  # fmt: skip


def torchvision_model(name: str, batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    classes = 10 if smoke else 1000
    net = getattr(torchvision.models, name)(num_classes=classes)
    return net, classify, image_batches(batch, 32 if smoke else 224, classes)


def recipe_gpt(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    size = dict(vocab_size=256, max_seq_len=16, n_layer=2, d_model=32, n_head=4) if smoke else {}  # else GPT-8L
    net = GPT(**size)
    batches = token_batches(batch, net.max_seq_len, net.vocab_size)
    return net, next_token, [(b["input_ids"], b["input_ids"].roll(-1, 1)) for b in batches]  # targets: next token


def recipe_resnet18(batch: int, smoke: bool) -> tuple[nn.Module, Callable, list]:
    return resnet18_cifar(), classify, image_batches(batch, 32, 10)


MODELS: dict[str, tuple[str, Callable, int, int]] = {
    "gpt2": ("transformers", gpt2, 8, 32),
    "llama": ("transformers", llama, 8, 32),
    "llama_lora": ("transformers+peft", llama_lora, 8, 32),
    "mixtral": ("transformers", mixtral, 8, 32),
    "opt": ("transformers", opt, 8, 32),
    "bert": ("transformers", bert, 32, 128),
    "deberta": ("transformers", deberta, 16, 64),
    "t5": ("transformers", t5, 16, 64),
    "vit": ("transformers", vit, 32, 128),
    "deit": ("transformers", deit, 32, 128),
    "bloom": ("transformers", bloom, 8, 32),
    "qwen3": ("transformers", qwen3, 8, 32),
    "modernbert": ("transformers", modernbert, 16, 64),
    "swin": ("transformers", swin, 32, 128),
    "wav2vec2": ("transformers", wav2vec2, 8, 32),
    "gpt_neox": ("transformers", gpt_neox, 8, 32),
    "gemma3": ("transformers", gemma3, 8, 32),
    "whisper": ("transformers", whisper, 8, 32),
    "clip": ("transformers", clip, 32, 128),
    "segformer": ("transformers", segformer, 16, 64),
    "resnet50": ("torchvision", partial(torchvision_model, "resnet50"), 32, 128),
    "mobilenet_v3_small": ("torchvision", partial(torchvision_model, "mobilenet_v3_small"), 64, 256),
    "efficientnet_b0": ("torchvision", partial(torchvision_model, "efficientnet_b0"), 32, 128),
    "convnext_tiny": ("torchvision", partial(torchvision_model, "convnext_tiny"), 32, 128),
    "gpt": ("recipes", recipe_gpt, 8, 64),
    "resnet18": ("recipes", recipe_resnet18, 16, 256),
}
"""name -> (library, ``build(batch, smoke) -> (net, loss_fn, batches)``, small batch, large batch)."""


def batch_size(model: str, which: str, smoke: bool) -> int:
    """``which`` is ``small``, ``large`` or a number; smoke runs use 2 and 4."""
    if which.isdigit():
        return int(which)
    small, large = (2, 4) if smoke else MODELS[model][2:]
    return small if which == "small" else large


def regimes(args: Any, allowed: Sequence[str] = ()) -> list[tuple[str, int]]:
    """(model, batch size) of every ``--models`` x ``--batches`` pair."""
    names = harness.split(args.models, list(allowed or MODELS))
    return [(model, batch_size(model, which, args.smoke)) for model in names for which in args.batches.split(",")]


def build(model: str, batch: int, smoke: bool, length: int, scheduler: bool = False, seed: int = 0,
          fused: bool = True, shift: int = 0, markov: int = 0) -> tuple[Task, DataLoader]:  # fmt: skip
    """The model's :class:`Task` (``scheduler``, ``fused``: as :class:`Task` takes them) and a loader of ``length``
    batches (one epoch), from ``seed``, starting at the ``shift``-th (:class:`Batches`). ``markov``: that many
    batches of :func:`markov_batches`' text instead of the model's random ones (a causal LM's only)."""
    pl.seed_everything(seed, verbose=False)
    net, loss_fn, batches = MODELS[model][1](batch, smoke)
    if markov:
        first = batches[0]
        if not (isinstance(first, dict) and first.get("labels") is first.get("input_ids")):
            raise ValueError(f"`markov` text is for the causal LMs' batches (labels = input_ids); {model!r} has none.")
        batches = markov_batches(batch, first["input_ids"].shape[1], net.config.vocab_size, markov)
    data = Batches(batches, length, shift)
    return Task(net, loss_fn, data, scheduler=scheduler, fused=fused), DataLoader(data, batch_size=None)


def repeated_blocks(net: nn.Module) -> list[nn.Module]:
    """The children of every ``ModuleList``/``Sequential`` whose children share one class (as accelerate's
    ``compile_regions``); the whole network where there are none."""
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        children = list(module.children())
        repeated = len(children) > 1 and len({type(child) for child in children}) == 1
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and repeated:
            blocks.extend(children)
            return
        for child in children:
            visit(child)

    visit(net)
    return blocks or [net]


class MarkStep(pl.Callback):
    """``reduce-overhead`` needs each iteration's start marked, or its CUDA graphs take the last step's outputs as
    live; under gradient accumulation only the first micro-batch's (marking each frees the trees' gradient outputs
    while they are still being summed: "accessing tensor output of CUDAGraphs that has been overwritten")."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx % trainer.accumulate_grad_batches == 0:
            torch.compiler.cudagraph_mark_step_begin()


def apply_variant(task: Task, variant: str, smoke: bool, cache_dir: str | None = None, **fuse_kw: Any) -> list:
    """Make ``task`` the ``variant``; returns its callbacks. Smoke runs compile with ``aot_eager`` (no inductor).

    ``compile``: ``torch.compile(net)``; ``reduce_overhead``: the same with ``mode="reduce-overhead"``;
    ``regional``: each repeated block ``.compile()`` in place; ``fuse``: ``FuseCallback(**fuse_kw)``.
    """
    backend = "aot_eager" if smoke else "inductor"
    if variant == "compile":
        task.model = torch.compile(task.model, backend=backend)
    elif variant == "reduce_overhead":
        task.model = torch.compile(task.model, backend=backend, mode=None if smoke else "reduce-overhead")
        return [MarkStep()]
    elif variant == "regional":
        for block in repeated_blocks(task.model):
            block.compile(backend=backend)
    elif variant == "fuse":
        return [FuseCallback(**{"backend": backend, "cache_dir": cache_dir or False, **fuse_kw})]
    elif variant != "eager":
        raise ValueError(f"variant={variant!r} is none of {', '.join(VARIANTS)}")
    return []


class ReferenceSteps(pl.Callback):
    """Which batches of a fit were the FuseCallback's timed eager reference steps once its plan ran, and which were
    their chunks' untimed lead-ins (listed after the FuseCallback, it reads the kind that callback gave the step), to
    read their times and host side from the :class:`harness.StepClock`.

    Example::

        >>> fuse = FuseCallback()
        >>> marks = ReferenceSteps(fuse)  # Trainer(callbacks=[clock, fuse, marks]); after the fit:
        >>> marks.reference, marks.lead_ins  # the batch indexes of the timed eager reference steps, of the lead-ins
        (set(), set())
    """

    def __init__(self, fuse: FuseCallback) -> None:
        self.fuse, self.reference, self.lead_ins = fuse, set(), set()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, idx: int) -> None:
        fit = self.fuse.fit
        if fit.plan is not None and fit.step_kind in (EAGER, LEAD_IN):
            kind = self.reference if fit.step_kind == EAGER else self.lead_ins
            kind.add(fit.steps)  # the fit's batch index, as the StepClock counts its batches


class ProfiledSteps(pl.Callback):
    """Profiles ``steps`` batches from the fit's ``first`` (counted from 0) with FuseCallback's own window
    (:class:`lightning_fuse.profiling.ProfileWindow`): its ``kernels_per_step``, ``gpu_busy_frac``,
    ``syncs_per_step`` (the host's waits for the device) and ``gpu_ms_per_step`` (the GPU's own time a step) in
    :attr:`result`. CUDA only; else ``{}``. :meth:`before_timed` places the window so that no timed batch is
    profiled.

    Example::

        >>> ProfiledSteps(first=200, steps=5).first, ProfiledSteps.before_timed(warmup=130, steps=6).first
        (200, 123)
    """

    def __init__(self, first: int, steps: int) -> None:
        self.window, self.first = ProfileWindow(steps), first
        self._batch = 0

    @classmethod
    def before_timed(cls, warmup: int, steps: int) -> ProfiledSteps:
        """The ``steps`` batches that end one batch before the first timed one (``warmup``)."""
        return cls(max(0, warmup - steps - 1), steps)

    @property
    def result(self) -> dict[str, float]:
        return dataclasses.asdict(self.window.result) if self.window.done else {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if pl_module.device.type == "cuda" and self._batch == self.first:
            self.window.step_start()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:  # fmt: skip
        if self.window.active:
            self.window.step_end()
        self._batch += 1


def fuse_info(callbacks: list) -> dict[str, Any]:
    """What the FuseCallback among ``callbacks`` did (``None``s without one): ``plan``, ``recompiles`` (and
    ``most_recompiles``, of one region), ``compile_s`` (every compile of the fit, the search's included),
    ``graphs`` (the CUDA graphs of our own it captured), ``history``,
    ``ran`` (the summary's line: the plan, its graph captured with its replays or why not, the graphs torch's
    cudagraph trees recorded, fallbacks) and
    ``search`` (the decision, one line per candidate)."""
    fuse = next((cb for cb in callbacks if isinstance(cb, FuseCallback)), None)
    plan = getattr(fuse, "plan", None)
    tracker = getattr(fuse, "tracker", None)
    decision = getattr(fuse, "decision", None)
    name = None if plan is None else getattr(plan, "name", None) or plan.describe()
    graph = getattr(plan, "graph", None)
    regions = getattr(tracker, "regions", {})
    return {"plan": name, "recompiles": getattr(tracker, "total_recompiles", None),
            "most_recompiles": max((r.recompiles for r in regions.values()), default=0) if tracker else None,
            "compile_s": getattr(tracker, "total_s", None),
            "graphs": graph.graphs if graph is not None else None,
            "history": getattr(fuse, "history", []), "ran": fuse.fit.what_ran() if fuse is not None else None,
            "search": decision.lines() if decision is not None else None}  # fmt: skip


def logged_speedup(history: list[dict]) -> dict[str, float | None]:
    """What a FuseCallback fit logged (``history``, one row an epoch) for its last epoch that has each value: the
    speedup with its interval, and the in-run eager reference's step.

    Example::

        >>> logged_speedup([{"fuse/speedup": 2.0, "fuse/eager_step_ms": 30.0}, {"fuse/speedup": 2.2}])
        {'speedup_logged': 2.2, 'speedup_low': None, 'speedup_high': None, 'eager_step_ms_in_run': 30.0}
    """
    keys = {"speedup_logged": "speedup", "speedup_low": "speedup_low", "speedup_high": "speedup_high",
            "eager_step_ms_in_run": "eager_step_ms"}  # fmt: skip
    return {field: next((row[f"fuse/{key}"] for row in reversed(history) if row.get(f"fuse/{key}") is not None), None)
            for field, key in keys.items()}  # fmt: skip


def main() -> None:
    for name, (source, build_net, small, large) in MODELS.items():
        try:
            params = sum(p.numel() for p in build_net(small, False)[0].parameters())
            print(f"{name:20s} {source:13s} {params / 1e6:7.1f}M  batch {small} / {large}")
        except ImportError as err:
            print(f"{name:20s} {source:13s} {harness.describe(err)}")


if __name__ == "__main__":
    main()
