"""The networks of the recipes: ResNet-18 for CIFAR, a small GPT and an MLP-Mixer.

Each transformer-like network keeps its repeated blocks in one ``nn.ModuleList`` of a single class
(``net.blocks``), which is what ``FuseCallback(targets="auto")`` looks for. The definitions follow
``benchmarks/RESULTS.md`` so that recipe runs and benchmark tables measure the same models. torchvision is
imported only to build the ResNet.

Example::

    >>> import torch
    >>> from recipes.models import MLPMixer
    >>> MLPMixer(depth=2, dim=32, token_dim=16, channel_dim=64)(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 for 32x32 images: a 3x3 stride-1 stem and no max-pool. No pretrained weights.

    Example::

        >>> net = resnet18_cifar()
        >>> net(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    import torchvision  # only here: the GPT and Mixer recipes need no torchvision

    net = torchvision.models.resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions."""

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} must be a multiple of n_head={n_head}; change one of them.")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)  # each (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` with a GELU MLP."""

    def __init__(self, d_model: int, n_head: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model),
            nn.GELU(),
            nn.Linear(mlp_ratio * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, C)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style language model: token and position embeddings, pre-norm blocks, a final LayerNorm and a head.

    The defaults are "GPT-8L" of the benchmarks. Byte-level text uses token ids below 256; a larger
    ``vocab_size`` only widens the embedding and the head.

    Args:
        vocab_size: number of token ids.
        max_seq_len: longest input sequence (size of the position embedding).
        n_layer: number of blocks, held in ``self.blocks`` (an ``nn.ModuleList``).
        d_model: width of the residual stream.
        n_head: attention heads; must divide ``d_model``.
        mlp_ratio: hidden width of each MLP, as a multiple of ``d_model``.
        dropout: dropout probability in attention and MLP (0 keeps training deterministic).

    Raises:
        ValueError: If ``d_model`` is not a multiple of ``n_head``, or an input is longer than ``max_seq_len``.

    Example::

        >>> net = GPT(vocab_size=256, max_seq_len=16, n_layer=2, d_model=32, n_head=4)
        >>> net(torch.zeros(3, 16, dtype=torch.long)).shape
        torch.Size([3, 16, 256])
    """

    def __init__(self, vocab_size: int = 8192, max_seq_len: int = 256, n_layer: int = 8, d_model: int = 512,
                 n_head: int = 8, mlp_ratio: int = 4, dropout: float = 0.0) -> None:  # fmt: skip
        super().__init__()
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, mlp_ratio, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(_init_gpt_weights)

    def forward(self, idx: Tensor) -> Tensor:  # idx: (B, T) token ids -> logits (B, T, vocab_size)
        T = idx.shape[1]
        if T > self.max_seq_len:
            raise ValueError(
                f"Input of length {T} is longer than max_seq_len={self.max_seq_len}; "
                "set data.seq_len <= model.net.max_seq_len."
            )
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init_gpt_weights(module: nn.Module) -> None:
    """GPT-2 style init (normal, std 0.02): the loss starts near ln(vocab) and falls fast."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class MixerBlock(nn.Module):
    """MLP-Mixer block: an MLP across patches (token mixing), then one across channels, each pre-norm residual."""

    def __init__(self, num_patches: int, dim: int, token_dim: int, channel_dim: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(num_patches, token_dim), nn.GELU(), nn.Linear(token_dim, num_patches))
        self.ln2 = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(nn.Linear(dim, channel_dim), nn.GELU(), nn.Linear(channel_dim, dim))

    def forward(self, x: Tensor) -> Tensor:  # x: (B, N, dim)
        x = x + self.token_mlp(self.ln1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.ln2(x))


class MLPMixer(nn.Module):
    """MLP-Mixer for small images: a patch embedding, ``depth`` identical blocks and a mean-pooled head.

    Args:
        num_classes: outputs of the head.
        image_size: side of the square input images.
        patch_size: side of each patch; must divide ``image_size``.
        in_channels: channels of the input images.
        dim: width of each patch embedding.
        depth: number of blocks, held in ``self.blocks`` (an ``nn.ModuleList``).
        token_dim: hidden width of the token-mixing MLPs.
        channel_dim: hidden width of the channel-mixing MLPs.

    Raises:
        ValueError: If ``patch_size`` does not divide ``image_size``.

    Example::

        >>> net = MLPMixer(dim=32, depth=2, token_dim=16, channel_dim=64)
        >>> net(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        num_classes: int = 10,
        image_size: int = 32,
        patch_size: int = 4,
        in_channels: int = 3,
        dim: int = 256,
        depth: int = 8,
        token_dim: int = 128,
        channel_dim: int = 1024,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"patch_size={patch_size} must divide image_size={image_size}; change one of them.")
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.blocks = nn.ModuleList(MixerBlock(num_patches, dim, token_dim, channel_dim) for _ in range(depth))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, C, H, W) -> logits (B, num_classes)
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, N, dim)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).mean(dim=1))
