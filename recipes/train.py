"""Train a recipe composed from ``configs/``: data, model, FuseCallback, trainer and logger.

Run from the repository root::

    python recipes/train.py                                   # small GPT on Python's stdlib, FuseCallback "auto"
    python recipes/train.py model=resnet18 fuse=off           # ResNet-18, plain eager training
    python recipes/train.py model=gpt experiment=small_batch trainer.max_steps=300
    python recipes/train.py -m fuse=off,auto experiment=small_batch,large_batch   # a sweep, one folder per job
    python recipes/train.py --cfg job                         # print the composed config and stop

Each run writes its logs, TensorBoard events and config under Hydra's output folder
(``outputs/<date>/<time>/``; ``multirun/<date>/<time>/<job>/`` in a sweep) and ends by printing
the commands that show them, run by the same interpreter (``.venv/bin/python -m lightning_fuse report ...``), so
they work without activating the venv.

Example::

    >>> from recipes.train import log_commands
    >>> log_commands("outputs/x")["report"].split()[1:]
    ['-m', 'lightning_fuse', 'report', 'outputs/x']
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import sys
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

# The repository root: `python recipes/train.py` then imports `recipes.*` (the configs' targets) and `lightning_fuse`
# from this checkout, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
log = logging.getLogger(__name__)


def auto_precision() -> str:
    """Trainer precision for this machine: bf16-mixed on a GPU with bf16, 16-mixed on older GPUs, else 32-true."""
    if not torch.cuda.is_available():
        return "32-true"
    return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"


def if_cuda(on_cuda: object, otherwise: object) -> object:
    """``${if_cuda:a,b}`` in a config: ``a`` when a CUDA GPU is visible, else ``b``."""
    return on_cuda if torch.cuda.is_available() else otherwise


def register_resolvers() -> None:
    """Register ``${auto_precision:}`` and ``${if_cuda:a,b}`` with OmegaConf (again is a no-op)."""
    for name, resolver in (("auto_precision", auto_precision), ("if_cuda", if_cuda)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


# At import, not in main(): `--cfg job --resolve` resolves the config before main() runs.
register_resolvers()


def instantiate_callbacks(cfg: DictConfig) -> list[Callback]:
    """FuseCallback from ``cfg.fuse`` (none when it is null), then every callback in ``cfg.callbacks``."""
    configs = ([cfg.fuse] if cfg.get("fuse") else []) + list((cfg.get("callbacks") or {}).values())
    callbacks = []
    for config in configs:
        log.info(f"Instantiating callback <{config._target_}>")
        callbacks.append(hydra.utils.instantiate(config))
    return callbacks


def instantiate_logger(cfg: DictConfig) -> Logger | bool:
    """The logger from ``cfg.logger``; False (no logging) when it is null."""
    if not cfg.get("logger"):
        return False  # None would make Lightning create its own logger in ./lightning_logs
    log.info(f"Instantiating logger <{cfg.logger._target_}>")
    return hydra.utils.instantiate(cfg.logger)


def train(cfg: DictConfig) -> L.Trainer:
    """Build data, task, callbacks, logger and trainer from ``cfg``, then ``trainer.fit``."""
    L.seed_everything(cfg.seed, workers=True)
    torch.set_float32_matmul_precision(cfg.float32_matmul_precision)
    log.info(f"Instantiating data <{cfg.data._target_}>")
    datamodule = hydra.utils.instantiate(cfg.data)
    log.info(f"Instantiating model <{cfg.model._target_}> with network <{cfg.model.net._target_}>")
    task = hydra.utils.instantiate(cfg.model)
    callbacks = instantiate_callbacks(cfg)
    logger = instantiate_logger(cfg)
    log.info(f"Instantiating trainer <{cfg.trainer._target_}>")
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=logger)
    trainer.fit(task, datamodule=datamodule)
    return trainer


def _shown(path: str | Path) -> str:
    """``path`` relative to the working directory when it lies inside it (shorter to copy), else absolute."""
    path = Path(path).absolute()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def log_commands(folder: str | Path) -> dict[str, str]:
    """The shell commands that show the logs under ``folder``, run by this interpreter: no venv to activate.

    ``"tensorboard"`` serves the TensorBoard events; ``"report"`` prints ``lightning-fuse report``'s table. Paths are
    relative to the working directory where they lie inside it, and quoted for the shell.

    Example::

        >>> log_commands("outputs/x")["report"].endswith("-m lightning_fuse report outputs/x")
        True
    """
    python = _shown(sys.executable) if "/" in _shown(sys.executable) else f"./{_shown(sys.executable)}"
    folder = _shown(folder)
    return {
        "tensorboard": shlex.join([python, "-m", "tensorboard.main", "--logdir", folder]),
        "report": shlex.join([python, "-m", "lightning_fuse", "report", folder]),
    }


def announce_logs(trainer: L.Trainer, output_dir: str) -> None:
    """Log where this run's files are and the commands that show them (see :func:`log_commands`)."""
    log.info(f"Run folder (logs, config, .hydra/): {_shown(output_dir)}")
    if trainer.logger is None or trainer.log_dir is None:
        return
    log.info(f"TensorBoard logs: {_shown(trainer.log_dir)}")
    if importlib.util.find_spec("tensorboard") is None:
        log.info('  to read them, install tensorboard: pip install "lightning-fuse[report]"')
        return
    commands = log_commands(output_dir)  # each on a line of its own, under its label: ready to copy
    log.info(f"  see them:\n{commands['tensorboard']}")
    log.info(f"  summary:\n{commands['report']}")
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        commands = log_commands(HydraConfig.get().sweep.dir)
        log.info("  all jobs of this sweep:")
        log.info(f"    see them:\n{commands['tensorboard']}")
        log.info(f"    summary:\n{commands['report']}")


@rank_zero_only
def save_resolved_config(cfg: DictConfig) -> None:
    """Write ``cfg``, interpolations resolved, to ``<output_dir>/config.yaml`` (``.hydra/`` keeps it unresolved)."""
    OmegaConf.save(cfg, os.path.join(cfg.paths.output_dir, "config.yaml"), resolve=True)


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> None:
    """Entry point: save the resolved config, train, say where the logs are (FuseCallback's summary, its verdict
    included, is logged at the fit's end, once)."""
    save_resolved_config(cfg)
    trainer = train(cfg)
    if trainer.is_global_zero:
        announce_logs(trainer, cfg.paths.output_dir)


if __name__ == "__main__":
    main()
