"""The torch side of ``benchmarks/peers.py``: build a recipe task, apply one variant, train it, time it.

Every variant is measured the same way, by :class:`StepClock`, a callback of our own that records a CUDA event at
each ``on_train_batch_start`` and ``on_train_batch_end`` (``time.perf_counter`` on CPU) and reads them once, after
training. ``step_ms`` is the median of ``end - start`` over the timed steps: the training step, backward, optimizer
step and LR scheduler as Lightning runs them. ``iter_ms`` is the median of ``start[i+1] - start[i]``: the whole loop
iteration, data fetching and logging included. FuseCallback's own numbers are never used for the comparison.

Only :mod:`peers` imports this module, and only in the subcommands that train (``setup``, ``steps``, ``loss``).
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_fuse import FuseCallback
from lightning_fuse.gpu import GpuSampler, nvml_index
from recipes.models import GPT, resnet18_cifar
from recipes.tasks import ImageClassifier, LanguageModel

GPT_FULL = dict(vocab_size=8192, max_seq_len=256, n_layer=8, d_model=512, n_head=8)  # "GPT-8L" of perf-notes
GPT_TINY = dict(vocab_size=256, max_seq_len=32, n_layer=2, d_model=64, n_head=4)  # CPU smoke test
IMAGE_SIZE = {False: 32, True: 8}  # CIFAR; the tiny ResNet-18 sees 8x8 images
AUTOTUNE = {"max_autotune": True, "coordinate_descent_tuning": True}

# FuseCallback arguments of each fuse variant; cache_dir, backend and eager_steps are added in apply_variant.
FUSE_VARIANTS: dict[str, dict[str, Any]] = {
    "fuse": {},  # its defaults: the default plan
    "eager_callback": {"targets": [], "cuda_graph": False},  # no compile, no graph: the callback's own overhead
    "eager_callback_no_nvml": {"targets": [], "cuda_graph": False, "gpu_sample_hz": 0},  # the same, sampler off
    "fuse_graph_only": {"targets": []},  # one CUDA graph over the eager forward+backward
    "fuse_regional_graph": {"targets": "auto", "cuda_graph": True},
    "fuse_full_graph": {"targets": "full", "cuda_graph": True},
    "fuse_full_autotune_graph": {"targets": "full", "cuda_graph": True, "options": AUTOTUNE},
}
# Warnings seen in every run that say nothing about the variant.
_NOISE = ("does not have many workers", "num_workers", "validation_step` but have no", "treespec", "TF32")


def environment() -> dict[str, Any]:
    """Versions and device of this process, copied into every record."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "cpus": len(os.sched_getaffinity(0)),
    }


def configure_process() -> None:
    """Settings shared by every measuring process."""
    torch.set_float32_matmul_precision("high")  # TF32 on, as in perf-notes
    # Regional variants compile one `_call_impl` code object per block (7 distinct graphs for ResNet-18); a higher
    # limit keeps any variant from silently dropping to eager because of dynamo's per-code limit of 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")


# ---------------------------------------------------------------------------------------------- models and data
def build_task(model: str, tiny: bool) -> pl.LightningModule:
    """The recipe LightningModule, with a constant learning rate (``cosine=False``) so no run length is needed."""
    if model == "gpt":
        return LanguageModel(GPT(**(GPT_TINY if tiny else GPT_FULL)), cosine=False)
    if model == "resnet":
        return ImageClassifier(resnet18_cifar(), cosine=False)
    raise ValueError(f"model must be 'gpt' or 'resnet', got {model!r}.")


def random_loader(model: str, batch: int, batches: int, tiny: bool, device: torch.device, seed: int = 0) -> DataLoader:
    """``batches`` batches of random data already on ``device``, the same for every variant (fixed seed)."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = batch * batches
    if model == "gpt":
        spec = GPT_TINY if tiny else GPT_FULL
        tokens = torch.randint(0, spec["vocab_size"], (n, spec["max_seq_len"] + 1), generator=g, device=device)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])  # (n, T) inputs and next-token targets
    else:
        size = IMAGE_SIZE[tiny]
        images = torch.randn(n, 3, size, size, generator=g, device=device)
        data = TensorDataset(images, torch.randint(0, 10, (n,), generator=g, device=device))
    return DataLoader(data, batch_size=batch, shuffle=False)  # len(data) % batch == 0: no partial batch


def fixed_loader(model: str, batch: int, batches: int, tiny: bool, device: torch.device) -> tuple[DataLoader, str]:
    """A small fixed data set of real samples, repeated every epoch, so the loss falls quickly."""
    n = batch * batches
    if model == "gpt":
        from recipes.data import read_corpus

        seq = (GPT_TINY if tiny else GPT_FULL)["max_seq_len"]
        try:
            text, _ = read_corpus(max_bytes=max(100_000, n * (seq + 1)))  # this Python's standard library sources
            windows = torch.frombuffer(bytearray(text[: n * (seq + 1)]), dtype=torch.uint8).long().view(n, seq + 1)
            described = f"{n} windows of Python stdlib source (byte tokens), repeated each epoch"
        except FileNotFoundError:  # a Python install without its .py sources: memorise random tokens instead
            g = torch.Generator().manual_seed(0)
            windows = torch.randint(0, 256, (n, seq + 1), generator=g)
            described = f"{n} windows of random byte tokens (no stdlib sources found), repeated each epoch"
        data = TensorDataset(windows[:, :-1].to(device), windows[:, 1:].to(device))
    else:
        from recipes.data import StandinImages

        standin = StandinImages(n, image_size=IMAGE_SIZE[tiny])
        images = torch.stack([standin[i][0] for i in range(n)])
        data = TensorDataset(images.to(device), standin.labels.to(device))
        described = f"{n} stand-in CIFAR images (recipes.data.StandinImages), repeated each epoch"
    return DataLoader(data, batch_size=batch, shuffle=False), described


def regional_blocks(net: torch.nn.Module, model: str) -> list[torch.nn.Module]:
    """The repeated blocks that Accelerate's ``compile_regions`` would compile one by one."""
    if model == "gpt":
        return list(net.blocks)
    return [block for name in ("layer1", "layer2", "layer3", "layer4") for block in getattr(net, name)]


def apply_variant(
    variant: str, task: pl.LightningModule, model: str, cache_dir: Path, backend: str, eager_steps: int
) -> list[pl.Callback]:
    """Compile ``task`` in place for ``variant``, or return the FuseCallback that will. Raises on unknown names."""
    net = task.model
    kwargs = {} if backend == "inductor" else {"backend": backend}
    if variant == "eager":
        return []
    if variant == "compile":
        net.compile(**kwargs)  # in place, as Lightning's docs do it: state_dict keys stay the same
        return []
    if variant == "reduce_overhead":
        net.compile(**kwargs) if kwargs else net.compile(mode="reduce-overhead")  # mode needs inductor
        return []
    if variant == "regional":
        for block in regional_blocks(net, model):
            block.compile(**kwargs)
        return []
    if variant not in FUSE_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    settings = dict(FUSE_VARIANTS[variant], cache_dir=str(cache_dir / "fuse"), backend=backend)
    # every timed step is a fuse step; eager_callback* keep the user's defaults (the overhead a user pays)
    if not variant.startswith("eager_callback"):
        settings["eager_steps"] = eager_steps
    return [FuseCallback(**settings)]


@contextmanager
def compile_caches(cache_dir: Path) -> Iterator[None]:
    """Point inductor's and Triton's on-disk caches at ``cache_dir`` (read by torch at each compile)."""
    saved = {var: os.environ.get(var) for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir / "triton")
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


# ---------------------------------------------------------------------------------------------- the clock
class StepClock(pl.Callback):
    """Marks every training step at ``on_train_batch_start``/``on_train_batch_end``, without a per-step sync.

    Args:
        warmup: Steps kept out of the statistics (compile, CUDA-graph capture).
        steps: Timed steps after the warmup.
        sync_at: Steps whose end is also taken on the host clock after a ``synchronize()`` (setup time).
        sample_gpu: Sample NVML utilisation over the timed steps.
        cudagraph_mark_step: Call ``torch.compiler.cudagraph_mark_step_begin()`` at each step start
            (recommended for ``mode="reduce-overhead"`` in a training loop).
        keep_losses: Keep each step's loss (read once, after training).
    """

    def __init__(self, warmup: int, steps: int, *, sync_at: tuple[int, ...] = (0,), sample_gpu: bool = False,
                 cudagraph_mark_step: bool = False, keep_losses: bool = False) -> None:  # fmt: skip
        self.warmup, self.steps = warmup, steps
        self.sync_at = set(sync_at)
        self.cuda = torch.cuda.is_available()
        self.cudagraph_mark_step = cudagraph_mark_step
        self.keep_losses = keep_losses
        self.fit_start = time.perf_counter()
        self.synced: dict[int, float] = {}  # step -> seconds from fit start to its synchronised end
        self.starts: list[Any] = []
        self.ends: list[Any] = []
        self.losses: list[torch.Tensor] = []
        self.util: dict[str, float] = {}
        self.fuse: FuseCallback | None = None
        self.fuse_info: dict[str, Any] | None = None
        self._events: list[torch.cuda.Event] = []
        self._sampler: GpuSampler | None = None
        self._step = 0
        if self.cuda:  # created up front: nothing but event.record() happens inside a step
            self._events = [torch.cuda.Event(enable_timing=True) for _ in range(2 * (warmup + steps) + 2)]
            if sample_gpu:
                self._sampler = GpuSampler(nvml_index(torch.device("cuda", torch.cuda.current_device())), hz=10.0)

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two marks (CUDA events must have completed: synchronise first)."""
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._sampler is not None and not self._sampler.start():
            self._sampler = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self._step == self.warmup and self._sampler is not None:
            self._sampler.read_and_reset()  # drop the warmup's samples
        if self.cudagraph_mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        self.starts.append(self._mark())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        self.ends.append(self._mark())
        if self.keep_losses:
            loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
            self.losses.append(loss.detach().float().reshape(()))
        if self._step in self.sync_at:
            if self.cuda:
                torch.cuda.synchronize()  # the compile is only done when its first step is
            self.synced[self._step] = time.perf_counter() - self.fit_start
        if self._step == self.warmup + self.steps - 1 and self._sampler is not None:
            self.util = self._sampler.read_and_reset()
        self._step += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._sampler is not None:
            self._sampler.stop()
        if self.fuse is not None:  # before FuseCallback's teardown makes the model eager again
            self.fuse_info = _fuse_info(self.fuse)

    def results(self) -> dict[str, Any]:
        """Timing statistics of the steps recorded so far (one sync on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
        elapsed = self.elapsed_ms
        done = len(self.ends)
        timed = range(self.warmup, min(done, self.warmup + self.steps))
        step_ms = [elapsed(self.starts[i], self.ends[i]) for i in timed]
        iter_ms = [elapsed(self.starts[i], self.starts[i + 1]) for i in timed if i + 1 < len(self.starts)]
        out: dict[str, Any] = {
            "timing": "cuda_events" if self.cuda else "perf_counter",
            "steps_done": done,
            "warmup_steps": self.warmup,
            "timed_steps": len(step_ms),
            "step_ms": _median(step_ms),
            "step_ms_p10": _quantile(step_ms, 0.1),
            "step_ms_p90": _quantile(step_ms, 0.9),
            "iter_ms": _median(iter_ms),
            "first_step_s": self.synced.get(0),
            "gpu_util": self.util.get("gpu_util"),
            "gpu_util_max": self.util.get("gpu_util_max"),
            "sm_active": self.util.get("sm_active"),
            "tensor_active": self.util.get("tensor_active"),
        }
        if self.warmup == 0 and done:
            out["setup_s"] = self.synced.get(0)
            out["ready_s"] = self.synced.get(done - 1)
        if self.keep_losses and self.losses:
            out["losses"] = torch.stack(self.losses).cpu().tolist()
        return out


def _fuse_info(cb: FuseCallback) -> dict[str, Any]:
    """What FuseCallback actually did (a fallback or a failed capture changes what its step time means)."""
    try:  # diagnostics only: a renamed attribute must not cost the measurement
        graph = cb.graph
        return {
            "plan": cb.plan.describe() if cb.plan else None,
            "regions": len(cb.regions),
            "compiled_regions": len(cb.compiled_regions),
            "fallbacks": {r.name: r.fallback_reason for r in cb.runners if r.fallback_reason},
            "graph_captured": bool(graph is not None and getattr(graph, "_graphed", None) is not None),
            "graph_replays": getattr(graph, "replays", 0) if graph is not None else 0,
            "graph_disabled": getattr(graph, "disabled_reason", None) if graph is not None else None,
            "compile_s": round(cb.tracker.total_s, 3),
            "recompiles": cb.tracker.total_recompiles,
        }
    except Exception as err:  # noqa: BLE001
        return {"error": describe_error(err)}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _quantile(values: list[float], q: float) -> float | None:
    if len(values) < 2:
        return _median(values)
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


# ---------------------------------------------------------------------------------------------- one variant
def cache_dir_for(cache_root: str | Path, model: str, batch: int, variant: str, tiny: bool) -> Path:
    """``<root>/<model>[-tiny]-<batch>/<variant>``: one directory per regime and variant."""
    return Path(cache_root) / f"{model}{'-tiny' if tiny else ''}-{batch}" / variant


def measure(
    model: str,
    batch: int,
    variant: str,
    *,
    warmup: int,
    steps: int,
    cache_root: str | Path,
    tiny: bool = False,
    backend: str = "inductor",
    precision: str = "bf16-mixed",
    eager_steps: int = 0,
    sample_gpu: bool = False,
    sync_at: tuple[int, ...] = (0,),
    loader_fn: Callable[[torch.device], DataLoader] | None = None,
    keep_losses: bool = False,
    max_epochs: int = 1,
) -> dict[str, Any]:
    """Train ``variant`` for ``warmup + steps`` steps and return its record; an exception becomes ``error``.

    A failure that leaves CUDA unusable (an illegal memory access, say) also sets ``fatal``: the process must end.
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cache_dir = cache_dir_for(cache_root, model, batch, variant, tiny)
    record: dict[str, Any] = {"model": model, "batch_size": batch, "variant": variant, "cache_dir": str(cache_dir),
                              "precision": precision, "backend": backend, "tiny": tiny, "error": None}  # fmt: skip
    seen: list[warnings.WarningMessage] = []
    trainer = task = loader = callbacks = clock = None
    from torch._dynamo.utils import counters

    counters.clear()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        pl.seed_everything(0, verbose=False)
        task = build_task(model, tiny)
        loader = loader_fn(device) if loader_fn else random_loader(model, batch, warmup + steps, tiny, device)
        # Setup starts at the variant's own compile() call: a process's first one imports inductor (2-3 s).
        setup_start = time.perf_counter()
        callbacks = apply_variant(variant, task, model, cache_dir, backend, eager_steps)
        clock = StepClock(warmup, steps, sync_at=sync_at, sample_gpu=sample_gpu and cuda, keep_losses=keep_losses,
                          cudagraph_mark_step=variant == "reduce_overhead" and cuda)  # fmt: skip
        clock.fuse = next((cb for cb in callbacks if isinstance(cb, FuseCallback)), None)
        trainer = pl.Trainer(
            accelerator="gpu" if cuda else "cpu", devices=1, precision=precision, max_steps=warmup + steps,
            max_epochs=max_epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            callbacks=[clock, *callbacks],  # the clock first: its start mark comes before any other hook's work
        )  # fmt: skip
        with compile_caches(cache_dir), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            clock.fit_start = setup_start
            trainer.fit(task, train_dataloaders=loader)
        record.update(clock.results())
        if record["timed_steps"] < steps:
            record["error"] = f"only {record['timed_steps']} of {steps} timed steps ran"
    except Exception as err:  # noqa: BLE001 - a crashing variant (OOM, compile error) must not end the benchmark
        record["error"] = describe_error(err)
        if clock is not None and clock.ends:
            record.update({k: v for k, v in clock.results().items() if k not in record or record[k] is None})
        record["fatal"] = cuda and not _cuda_healthy()
    if clock is not None and clock.fuse_info is not None:
        record["fuse"] = clock.fuse_info
    record["warnings"] = _distinct_warnings(seen)
    record["dynamo"] = {"graphs": counters["stats"].get("unique_graphs", 0),
                        "graph_breaks": sum(counters["graph_break"].values())}  # fmt: skip
    if cuda:
        record["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 3)
    del trainer, task, loader, callbacks, clock
    free_memory()
    return record


def free_memory() -> None:
    """Drop compiled code, CUDA graphs and cached blocks, so the next variant starts from a clean device."""
    gc.collect()
    torch._dynamo.reset()  # also resets cudagraph trees (reduce-overhead's graphs and their memory pool)
    if torch.cuda.is_available():
        try:
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()
        except Exception:
            pass
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def describe_error(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:400] if lines else '(no message)'}"


def _cuda_healthy() -> bool:
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() == 2.0
    except Exception:
        return False


def _distinct_warnings(seen: list[warnings.WarningMessage], limit: int = 8) -> list[str]:
    out: list[str] = []
    for w in seen:
        text = " ".join(str(w.message).split())[:300]
        if text not in out and not any(noise in text for noise in _NOISE):
            out.append(text)
    return out[:limit]


# ---------------------------------------------------------------------------------------------- learning check
def loss_check(
    model: str, batch: int, steps: int, *, cache_root: str | Path, tiny: bool = False, backend: str = "inductor",
    precision: str = "bf16-mixed", batches: int = 16, window: int = 20, tolerance: float = 0.02,
) -> dict[str, Any]:  # fmt: skip
    """Train eager and the default ``fuse`` from the same seed on the same small data set; compare final losses."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    loader, described = fixed_loader(model, batch, batches, tiny, device)
    runs = {}
    for variant in ("eager", "fuse"):
        runs[variant] = measure(
            model, batch, variant, warmup=0, steps=steps, cache_root=cache_root, tiny=tiny, backend=backend,
            precision=precision, loader_fn=lambda _device: loader, keep_losses=True, max_epochs=-1,
        )  # fmt: skip
    window = max(1, min(window, steps // 2))
    record: dict[str, Any] = {
        "kind": "loss", "model": model, "batch_size": batch, "variant": "loss_check", "steps": steps,
        "data": described, "window": window, "tolerance": tolerance,
        "error": "; ".join(f"{v}: {r['error']}" for v, r in runs.items() if r["error"]) or None,
    }  # fmt: skip
    for variant, run in runs.items():
        losses = run.get("losses") or []
        record[f"{variant}_first_loss"] = round(losses[0], 5) if losses else None
        record[f"{variant}_loss"] = round(statistics.fmean(losses[-window:]), 5) if len(losses) >= window else None
        if variant == "fuse":
            record["fuse"] = run.get("fuse")
            record["fuse_warnings"] = run.get("warnings")
    eager, fuse = record["eager_loss"], record["fuse_loss"]
    if eager is not None and fuse is not None:
        record["rel_diff"] = round(abs(fuse - eager) / max(abs(eager), 1e-12), 5)
        record["agree"] = record["rel_diff"] < tolerance
    else:
        record["rel_diff"] = record["agree"] = None
    return record
