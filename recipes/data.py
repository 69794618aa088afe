"""The data of the recipes: CIFAR-10 (or a synthetic stand-in of its shape) and byte-level text.

Nothing here downloads: CIFAR-10 is read from a folder you point ``data.root`` at, and the text is
the Python standard library's own source, which ships with every Python install. torchvision is imported only
to read real CIFAR-10, so the text recipes run without it.

Example::

    >>> from recipes.data import StandinImages
    >>> image, label = StandinImages(8, seed=0)[0]
    >>> tuple(image.shape), 0 <= int(label) < 10
    ((3, 32, 32), True)
"""

from __future__ import annotations

import logging
import sysconfig
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

log = logging.getLogger(__name__)

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


@rank_zero_only
def _announce(message: str) -> None:
    log.info(message)


class _LoaderModule(L.LightningDataModule):
    """Shared DataLoader settings: the train loader shuffles and keeps its partial last batch."""

    def __init__(self, batch_size: int, num_workers: int, pin_memory: bool) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}.")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before its dataloaders are asked for.")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=False,  # the partial last batch stays: FuseCallback must cope with the odd shape
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,  # no worker restart (and timing blip) at each epoch
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)


class StandinImages(Dataset):
    """A deterministic CIFAR-shaped data set: one faint colour pattern per class, shifted at random, plus noise.

    The classes are learnable (accuracy rises well above chance over a few hundred steps) but it is not
    CIFAR-10: use it to test plumbing and speed, never to report accuracy.

    Args:
        size: number of images.
        num_classes: number of classes (and of patterns).
        image_size: side of the square images.
        seed: the patterns depend on ``seed`` alone; the samples on ``seed`` and ``split``.
        split: 0 for training, 1 for validation: same patterns, different samples.

    Example::

        >>> data = StandinImages(size=4)
        >>> image, label = data[0]
        >>> image.shape, image.dtype, 0 <= label < 10
        (torch.Size([3, 32, 32]), torch.float32, True)
    """

    def __init__(self, size: int, num_classes: int = 10, image_size: int = 32, seed: int = 0, split: int = 0) -> None:
        patterns = torch.randn(num_classes, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
        patterns = F.interpolate(patterns, size=image_size, mode="bilinear", align_corners=False)  # (K, 3, H, W)
        g = torch.Generator().manual_seed(seed * 1000 + 1 + split)
        self.labels = torch.randint(num_classes, (size,), generator=g)
        shifts = torch.randint(image_size, (size, 2), generator=g).tolist()
        shifted = torch.stack([patterns[k].roll(s, dims=(1, 2)) for k, s in zip(self.labels.tolist(), shifts)])
        noise = torch.randn(size, 3, image_size, image_size, generator=g)
        pixels = (0.5 * shifted + noise) * 0.2 + 0.5  # faint pattern, strong noise, roughly CIFAR's range of values
        self.images = (pixels.clamp(0, 1) * 255).to(torch.uint8)  # (N, 3, H, W), a quarter of float32's memory
        self.mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
        self.std = torch.tensor(CIFAR_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        image = (self.images[index].float() / 255 - self.mean) / self.std
        return image, int(self.labels[index])


class CIFAR10DataModule(_LoaderModule):
    """CIFAR-10 from a local copy, or :class:`StandinImages` when ``root`` is None.

    Real data is normalised, randomly cropped (padding 4) and flipped for training. Nothing is downloaded.

    Args:
        root: a folder holding ``cifar-10-batches-py/`` (the "python version" archive from
            https://www.cs.toronto.edu/~kriz/cifar.html, extracted). None: the synthetic stand-in.
        batch_size: samples per batch, for training and validation.
        num_workers: DataLoader worker processes.
        pin_memory: pin host memory (speeds up copies to a GPU).
        standin_train_size: training images of the stand-in.
        standin_val_size: validation images of the stand-in.
        standin_seed: seed of the stand-in's patterns and samples.

    Raises:
        FileNotFoundError: In ``setup``, if ``root`` is set but holds no CIFAR-10.

    Example::

        >>> data = CIFAR10DataModule(batch_size=8, standin_train_size=16, standin_val_size=8)
        >>> data.setup("fit")
        >>> images, labels = next(iter(data.train_dataloader()))
        >>> images.shape, labels.shape
        (torch.Size([8, 3, 32, 32]), torch.Size([8]))
    """

    num_classes = 10

    def __init__(
        self,
        root: str | None = None,
        batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool = False,
        standin_train_size: int = 10_000,
        standin_val_size: int = 2_000,
        standin_seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers, pin_memory)
        self.root = root
        self.standin_sizes = (standin_train_size, standin_val_size)
        self.standin_seed = standin_seed

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        if self.root is None:
            self.train_set, self.val_set = self._standin()
        else:
            self.train_set, self.val_set = self._cifar10(Path(self.root).expanduser())

    def _standin(self) -> tuple[Dataset, Dataset]:
        _announce(
            "data.root is not set: training on a synthetic CIFAR-shaped STAND-IN (shifted colour patterns + noise), "
            "not CIFAR-10. For real CIFAR-10, extract cifar-10-python.tar.gz into a folder and pass data.root=<folder>."
        )
        train_size, val_size = self.standin_sizes
        return (
            StandinImages(train_size, self.num_classes, seed=self.standin_seed, split=0),
            StandinImages(val_size, self.num_classes, seed=self.standin_seed, split=1),
        )

    def _cifar10(self, root: Path) -> tuple[Dataset, Dataset]:
        if not (root / "cifar-10-batches-py").is_dir():
            raise FileNotFoundError(
                f"data.root={root} holds no cifar-10-batches-py/ folder. Extract cifar-10-python.tar.gz "
                "(https://www.cs.toronto.edu/~kriz/cifar.html) there, or set data.root=null for the synthetic stand-in."
            )
        import torchvision  # only here: the stand-in and the text recipes need no torchvision
        from torchvision import transforms

        normalize = [transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)]
        augment = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
        _announce(f"data: CIFAR-10 from {root}")
        return (
            torchvision.datasets.CIFAR10(root, train=True, transform=transforms.Compose(augment + normalize)),
            torchvision.datasets.CIFAR10(root, train=False, transform=transforms.Compose(normalize)),
        )


def read_corpus(
    root: str | Path | None = None, pattern: str = "*.py", max_bytes: int = 4_000_000
) -> tuple[bytes, list[Path]]:
    """Concatenate the files ``root/pattern`` in sorted order, up to ``max_bytes`` bytes.

    Args:
        root: a folder of text files. None: this Python's standard library (``sysconfig``'s ``stdlib`` path).
        pattern: glob pattern of the files inside ``root`` (not recursive).
        max_bytes: cap on the bytes returned; the last file read is cut to fit.

    Returns:
        The bytes and the files they came from.

    Raises:
        FileNotFoundError: If the files hold fewer than 100,000 bytes.

    Example::

        >>> text, files = read_corpus(max_bytes=10_000)
        >>> len(text), files[0].suffix
        (10000, '.py')
    """
    folder = Path(root).expanduser() if root is not None else Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    files: list[Path] = []
    size = 0
    for path in sorted(folder.glob(pattern)):
        if size >= max_bytes:
            break
        chunk = path.read_bytes()[: max_bytes - size]
        chunks.append(chunk)
        files.append(path)
        size += len(chunk)
    if size < min(100_000, max_bytes):
        raise FileNotFoundError(
            f"Only {size} bytes of text in {folder}/{pattern}; the text recipe needs at least 100,000. "
            "Point data.root at a folder of text files and data.pattern at their names (e.g. '*.txt')."
        )
    return b"".join(chunks), files


class ByteWindows(Dataset):
    """Consecutive, non-overlapping windows of ``seq_len + 1`` bytes: item ``i`` is ``(window[:-1], window[1:])``.

    Example::

        >>> data = ByteWindows(torch.arange(10, dtype=torch.uint8), seq_len=4)
        >>> len(data), data[1]
        (2, (tensor([4, 5, 6, 7]), tensor([5, 6, 7, 8])))
    """

    def __init__(self, data: Tensor, seq_len: int) -> None:
        if len(data) <= seq_len:
            raise ValueError(f"{len(data)} bytes are too few for one window of seq_len={seq_len}; lower data.seq_len.")
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.seq_len
        window = self.data[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


class TextDataModule(_LoaderModule):
    """Byte-level language modelling on real text: by default this Python's standard library sources.

    The bytes are token ids 0-255 (``vocab_size = 256``); the last ``val_fraction`` of the text is the
    validation set. Files are read in sorted order, so a given Python install always yields the same corpus.

    Args:
        root: a folder of text files. None: the Python standard library.
        pattern: glob pattern of the files inside ``root``.
        max_bytes: cap on the corpus size.
        val_fraction: share of the text held out for validation.
        seq_len: tokens per training sequence (windows are ``seq_len + 1`` bytes).
        batch_size: sequences per batch, for training and validation.
        num_workers: DataLoader worker processes.
        pin_memory: pin host memory (speeds up copies to a GPU).

    Raises:
        ValueError: If ``val_fraction`` is not strictly between 0 and 1.

    Example::

        >>> data = TextDataModule(max_bytes=200_000, seq_len=64, batch_size=4)
        >>> data.setup("fit")
        >>> x, y = next(iter(data.train_dataloader()))
        >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
        (torch.Size([4, 64]), True)
    """

    vocab_size = 256

    def __init__(
        self,
        root: str | None = None,
        pattern: str = "*.py",
        max_bytes: int = 4_000_000,
        val_fraction: float = 0.05,
        seq_len: int = 256,
        batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(batch_size, num_workers, pin_memory)
        if not 0 < val_fraction < 1:
            raise ValueError(f"data.val_fraction must be between 0 and 1 (exclusive), got {val_fraction}.")
        self.root = root
        self.pattern = pattern
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.seq_len = seq_len

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        text, files = read_corpus(self.root, self.pattern, self.max_bytes)
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        split = int(len(data) * (1 - self.val_fraction))
        self.train_set = ByteWindows(data[:split], self.seq_len)
        self.val_set = ByteWindows(data[split:], self.seq_len)
        _announce(
            f"data: {len(text) / 1e6:.1f} MB of text from {len(files)} files in {files[0].parent}/{self.pattern}, "
            f"{len(self.train_set)} training and {len(self.val_set)} validation windows of {self.seq_len} bytes"
        )
