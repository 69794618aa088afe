"""The Hydra recipes: every config composes and builds, every model trains a few steps under every fuse preset,
sweeps give each job its own logs, and the data is deterministic. CPU only, tiny sizes."""

from __future__ import annotations

import inspect
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import hydra
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from lightning_fuse import FuseCallback
from recipes.data import ByteWindows, CIFAR10DataModule, StandinImages, TextDataModule, read_corpus
from recipes.tasks import AdamWSchedule, warmup_cosine
from recipes.train import auto_precision, instantiate_callbacks, instantiate_logger, register_resolvers, train

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("gpt_mini", "gpt", "resnet18", "mixer")
FUSE_PRESETS = ("off", "auto", "full", "regional", "cuda_graph", "measure_only")
EXPERIMENTS = (None, "small_batch", "large_batch")
DATA_OF_MODEL = {"gpt_mini": "TextDataModule", "gpt": "TextDataModule", "resnet18": "CIFAR10", "mixer": "CIFAR10"}
BATCH_SIZES = {"gpt_mini": (8, 64), "gpt": (8, 64), "resnet18": (16, 256), "mixer": (16, 256)}

TINY = {  # sizes that keep a training step well under a second on a CPU
    "gpt_mini": [
        "model.net.n_layer=2", "model.net.d_model=32", "model.net.n_head=2", "model.net.max_seq_len=16",
        "data.max_bytes=100000",
    ],
    "resnet18": ["data.standin_train_size=16", "data.standin_val_size=8"],
    "mixer": [
        "model.net.depth=2", "model.net.dim=32", "model.net.token_dim=16", "model.net.channel_dim=64",
        "data.standin_train_size=16", "data.standin_val_size=8",
    ],
}  # fmt: skip
SHORT_RUN = [
    "data.batch_size=4", "trainer.accelerator=cpu", "trainer.max_steps=2", "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1", "+trainer.num_sanity_val_steps=0", "+trainer.enable_progress_bar=false",
    "+trainer.enable_model_summary=false",
]  # fmt: skip


def compose_train(output_dir: Path, *overrides: str) -> DictConfig:
    """``configs/train.yaml`` with ``overrides``; ``paths.output_dir`` replaces Hydra's run dir (unset here)."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=[f"paths.output_dir={output_dir}", *overrides])


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("fuse", FUSE_PRESETS)
@pytest.mark.parametrize("model", MODELS)
def test_every_combination_composes(tmp_path: Path, model: str, fuse: str, experiment: str | None) -> None:
    overrides = [f"model={model}", f"fuse={fuse}"] + ([f"experiment={experiment}"] if experiment else [])
    cfg = compose_train(tmp_path, *overrides)
    resolved = OmegaConf.to_container(cfg, resolve=True)  # every interpolation and resolver works
    assert DATA_OF_MODEL[model] in resolved["data"]["_target_"]  # the model picked its data
    assert (resolved["fuse"] is None) == (fuse == "off")
    if experiment:
        assert resolved["data"]["batch_size"] == BATCH_SIZES[model][experiment == "large_batch"]
    assert resolved["trainer"]["precision"] == auto_precision()


@pytest.mark.parametrize("logger", ("tensorboard", "none"))
@pytest.mark.parametrize("trainer", ("default", "cpu", "gpu", "ddp"))
def test_trainer_and_logger_presets_compose(tmp_path: Path, trainer: str, logger: str) -> None:
    cfg = compose_train(tmp_path, f"trainer={trainer}", f"logger={logger}")
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved["trainer"]["devices"] == (2 if trainer == "ddp" else 1)
    assert resolved["trainer"]["accelerator"] == {"default": "auto", "cpu": "cpu"}.get(trainer, "gpu")
    assert (instantiate_logger(cfg) is False) == (logger == "none")  # False, not None: no ./lightning_logs


@pytest.mark.parametrize("model", MODELS)
def test_model_and_data_instantiate_at_full_size(tmp_path: Path, model: str) -> None:
    cfg = compose_train(tmp_path, f"model={model}")
    task = hydra.utils.instantiate(cfg.model)
    data = hydra.utils.instantiate(cfg.data)
    assert isinstance(task.model, torch.nn.Module) and data.batch_size == cfg.data.batch_size
    if model == "gpt":  # GPT-8L of benchmarks/RESULTS.md, blocks where FuseCallback(targets="auto") finds them
        assert isinstance(task.model.blocks, torch.nn.ModuleList) and len(task.model.blocks) == 8
        assert task.model.head.out_features == 8192 and data.seq_len == 256


@pytest.mark.parametrize("fuse", FUSE_PRESETS)
def test_fuse_presets_instantiate(tmp_path: Path, fuse: str) -> None:
    callbacks = instantiate_callbacks(compose_train(tmp_path, f"fuse={fuse}"))
    assert [type(c) for c in callbacks] == ([] if fuse == "off" else [FuseCallback])


def test_fuse_can_be_removed_and_callbacks_added(tmp_path: Path) -> None:
    extra = "+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor"
    assert instantiate_callbacks(compose_train(tmp_path, "~fuse")) == []
    callbacks = instantiate_callbacks(compose_train(tmp_path, extra))
    assert [type(c).__name__ for c in callbacks] == ["FuseCallback", "LearningRateMonitor"]


def test_fuse_auto_lists_every_argument_at_its_default(tmp_path: Path) -> None:
    fuse = compose_train(tmp_path, "fuse=auto").fuse
    defaults = {n: p.default for n, p in inspect.signature(FuseCallback).parameters.items()}
    listed = {k: v for k, v in OmegaConf.to_container(fuse).items() if not k.startswith("_")}
    assert listed == {**defaults, "exclude": []}  # YAML has no tuples: () is written []


@pytest.mark.parametrize("fuse", FUSE_PRESETS)
@pytest.mark.parametrize("model", ("gpt_mini", "resnet18", "mixer"))
def test_every_model_trains_under_every_fuse_preset(tmp_path: Path, model: str, fuse: str) -> None:
    eager_backend = [] if fuse == "off" else ["fuse.backend=eager", "fuse.cache_dir=false"]  # dynamo only: fast
    cfg = compose_train(tmp_path, f"model={model}", f"fuse={fuse}", *TINY[model], *SHORT_RUN, *eager_backend)
    trainer = train(cfg)
    assert trainer.global_step == 2
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert any((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_training_is_deterministic(tmp_path: Path) -> None:
    overrides = ["fuse=off", "logger=none", *TINY["gpt_mini"], *SHORT_RUN]
    losses = [train(compose_train(tmp_path, *overrides)).callback_metrics["train/loss"] for _ in range(2)]
    assert losses[0] == losses[1]


def test_language_model_too_small_a_vocabulary_says_what_to_do(tmp_path: Path) -> None:
    cfg = compose_train(tmp_path, "fuse=off", "logger=none", "model.net.vocab_size=128", *TINY["gpt_mini"], *SHORT_RUN)
    with pytest.raises(ValueError, match="set model.net.vocab_size>=256"):
        train(cfg)


def test_the_optimizer_and_its_schedule_follow_model_optim(tmp_path: Path) -> None:
    overrides = ["fuse=off", "logger=none", *TINY["gpt_mini"], *SHORT_RUN, "trainer.max_steps=4"]
    trainer = train(compose_train(tmp_path, *overrides, "model.optim.lr=0.01", "model.optim.warmup_steps=2"))
    optimizer = trainer.optimizers[0]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]  # none on biases and norms
    assert optimizer.param_groups[0]["initial_lr"] == 0.01
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * warmup_cosine(4, 2, total_steps=4))


def test_a_schedule_that_cannot_run_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"AdamWSchedule needs lr > 0.*got lr=0, .*Fix model.optim"):
        AdamWSchedule(lr=0, weight_decay=0.1)
    endless = ["trainer.max_steps=-1", "trainer.max_epochs=-1"]
    cfg = compose_train(tmp_path, "fuse=off", "logger=none", *TINY["gpt_mini"], *SHORT_RUN, *endless)
    with pytest.raises(ValueError, match=r"cosine schedule needs a run of known length.*model.optim.cosine=false"):
        train(cfg)


@pytest.mark.inductor
def test_sweep_gives_each_job_its_own_logs(tmp_path: Path) -> None:
    """A sweep of ``fuse=off`` and a preset of the user's own (as ``configs/fuse/off.yaml`` advises: ``auto`` with
    a fast backend, from a folder on Hydra's search path)."""
    presets, sweep_dir = tmp_path / "presets", tmp_path / "sweep"
    (presets / "fuse").mkdir(parents=True)
    preset = "defaults:\n  - auto\n  - _self_\n\nbackend: eager\ncache_dir: false\n"
    (presets / "fuse" / "quick.yaml").write_text(preset)
    command = [
        sys.executable,
        "recipes/train.py",
        "-m",
        "fuse=off,quick",
        f"hydra.searchpath=[file://{presets}]",
        f"hydra.sweep.dir={sweep_dir}",
        *TINY["gpt_mini"],
    ]
    run = subprocess.run(command + SHORT_RUN, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    for job in ("0", "1"):
        assert any((sweep_dir / job / "tb").glob("events.out.tfevents.*")), f"job {job} wrote no TensorBoard events"
        assert (sweep_dir / job / "config.yaml").is_file()
    assert OmegaConf.load(sweep_dir / "0" / "config.yaml").fuse is None
    quick = OmegaConf.load(sweep_dir / "1" / "config.yaml").fuse
    assert quick.targets == "auto" and quick.backend == "eager", "auto's settings, then the preset's own"
    *_, job_1, sweep = _printed(run.stdout + run.stderr, "summary:")  # each job's own, then the sweep's
    assert job_1[1:] == ["-m", "lightning_fuse", "report", str(sweep_dir / "1")]
    assert sweep[1:] == ["-m", "lightning_fuse", "report", str(sweep_dir)]
    report = subprocess.run(sweep, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "fuse=quick model.net.n_layer=2" in report.stdout, "the job is named by its overrides"
    assert "fuse=off" not in report.stdout, "fuse=off logs no fuse/ scalars: not a FuseCallback run"


def _printed(output: str, label: str) -> list[list[str]]:
    """The commands the recipe printed on the line after ``label`` (``"summary:"`` or ``"see them:"``), as argv
    lists: a line of its own, no log prefix, ready to copy."""
    lines = output.splitlines()
    return [shlex.split(lines[i + 1]) for i, line in enumerate(lines[:-1]) if line.endswith(label)]


def test_the_commands_printed_at_the_end_of_a_run_work_as_printed(tmp_path: Path) -> None:
    """The run ends with a TensorBoard and a report command, both naming this interpreter: no venv to activate."""
    fast = ["fuse.backend=eager", "fuse.cache_dir=false", f"hydra.run.dir={tmp_path}"]
    command = [sys.executable, "recipes/train.py", *TINY["gpt_mini"], *SHORT_RUN, *fast]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    log_lines = (tmp_path / "train.log").read_text().splitlines()
    verdict = log_lines[[i for i, line in enumerate(log_lines) if "FuseCallback plan: " in line][-1] + 1]
    assert verdict.startswith("FuseCallback: ") and " compile " in verdict, f"the summary's verdict: {verdict!r}"
    assert sum(line.endswith(verdict) for line in log_lines) == 1, "the verdict, once in the log file"
    assert output.count(verdict) == 1, "and once on the terminal"
    (report,), (tensorboard,) = _printed(output, "summary:"), _printed(output, "see them:")
    assert report[0] == tensorboard[0] and Path(ROOT, report[0]).resolve() == Path(sys.executable).resolve()
    shown = subprocess.run(report, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "model.net.n_layer=2" in shown.stdout and "status" in shown.stdout, shown.stdout
    assert "tb" not in shown.stdout.split(), "named by its overrides, not by its logger folder"
    assert tensorboard[1:4] == ["-m", "tensorboard.main", "--logdir"]
    _serves(tensorboard + ["--port", "0"])  # any free port, on localhost only


def _serves(command: list[str], timeout_s: float = 120) -> None:
    """Start ``command`` (a TensorBoard server), wait until it says where it serves, then stop it."""
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(server.stdout), daemon=True)  # never blocks the test
    reader.start()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and server.poll() is None:
            if any(" at http://localhost:" in line for line in list(seen)):
                break
            time.sleep(0.2)
    finally:
        server.terminate()
        server.wait(timeout=30)
        reader.join(timeout=30)
    assert any(" at http://localhost:" in line for line in seen), "".join(seen)[-2000:]


@pytest.mark.parametrize("model", ("gpt_mini", "mixer", "resnet18"))
def test_fuse_regional_compiles_the_repeated_blocks_where_alike_else_the_whole_network(tmp_path, model) -> None:
    from lightning_fuse.regions import resolve_regions

    cfg = compose_train(tmp_path, f"model={model}", "fuse=regional", *TINY.get(model, []))
    assert cfg.fuse.cuda_graph is False
    names = [region.name for region in resolve_regions(hydra.utils.instantiate(cfg.model), cfg.fuse.targets)]
    if model == "resnet18":  # its blocks differ in width from stage to stage: what configs/fuse/regional.yaml says
        assert names == ["model"]
    else:
        assert len(names) >= 2 and all(name.startswith("model.blocks.") for name in names)


def test_standin_images_are_deterministic_and_learnable() -> None:
    first, again = StandinImages(64, seed=3), StandinImages(64, seed=3)
    assert torch.equal(first.images, again.images) and torch.equal(first.labels, again.labels)
    val = StandinImages(64, seed=3, split=1)
    assert not torch.equal(first.images, val.images)
    assert len(first.labels.unique()) == 10
    image, _ = first[0]
    assert image.shape == (3, 32, 32) and abs(image.mean().item()) < 1.0  # normalised, like real CIFAR


def test_cifar_without_a_copy_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="data.root=null for the synthetic stand-in"):
        CIFAR10DataModule(root=str(tmp_path)).setup("fit")


def test_text_corpus_is_real_deterministic_and_split() -> None:
    text, files = read_corpus()
    assert len(text) == 4_000_000 and len(files) >= 20  # the standard library holds well over 4 MB of .py files
    assert files == sorted(files) and read_corpus()[0] == text
    assert b"def " in text and b"import " in text
    data = TextDataModule(max_bytes=200_000, seq_len=32, batch_size=4)
    data.setup("fit")
    tokens, targets = data.train_set[5]
    assert torch.equal(tokens[1:], targets[:-1]) and tokens.max() < TextDataModule.vocab_size
    assert len(data.train_set) + len(data.val_set) == pytest.approx(200_000 / 32, abs=2)


def test_byte_windows_too_short_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="lower data.seq_len"):
        ByteWindows(torch.zeros(8, dtype=torch.uint8), seq_len=8)
