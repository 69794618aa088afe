"""Choosing the plan: how the selected regions are compiled, and whether a CUDA graph covers the step.

The rule follows our H100 measurements (``benchmarks/RESULTS.md``, ``shared/perf-notes.md``): a training step of
a small model is bound by kernel launches on the CPU even at large batch, so on CUDA the default plan compiles the
regions for fusion (``mode="default"``, which leaves CUDA graphs to us) and captures one CUDA graph over the whole
forward and backward of the model, which removes the launch overhead that per-region graphs cannot. On a CPU
there is nothing to graph and the regions are compiled with inductor's default mode.

Example::

    >>> choose_plan("auto", "auto", torch.device("cpu")).describe()
    'regions: torch.compile(mode=default); CUDA graph: off (no CUDA device)'
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AUTO = "auto"


@dataclass(frozen=True)
class Plan:
    """What FuseCallback does to the model for this run."""

    compile_mode: str | None
    """The torch.compile ``mode`` of every region (``None``: torch's default)."""
    cuda_graph: bool
    """Capture one CUDA graph over the model's forward and backward."""
    reason: str
    dynamic: bool | None = None
    """``dynamic`` for torch.compile: ``False`` under a CUDA graph, whose shapes are static anyway; this also stops
    dynamo from turning dims dynamic when blocks of one class run at several shapes (a CNN's stages)."""

    def describe(self) -> str:
        graph = "on" if self.cuda_graph else "off"
        return f"regions: torch.compile(mode={self.compile_mode or 'default'}); CUDA graph: {graph} ({self.reason})"


def choose_plan(
    mode: str, cuda_graph: bool | str, device: torch.device, world_size: int = 1, dynamic: bool | None = None
) -> Plan:
    """Resolve ``mode="auto"`` and ``cuda_graph="auto"`` for ``device``; explicit settings are kept.

    Raises:
        ValueError: If ``cuda_graph=True`` is asked for with several processes (DDP/FSDP).
    """
    compile_mode = None if mode in (AUTO, "default") else mode
    if device.type != "cuda":
        return Plan(compile_mode, False, "no CUDA device", dynamic)
    if world_size > 1:
        if cuda_graph is True:
            raise ValueError(
                f"cuda_graph=True runs in a single process, but this run has {world_size} (DDP/FSDP). Use "
                "cuda_graph='auto' (off in multi-process runs) or False."
            )
        return Plan(compile_mode, False, f"{world_size} processes: gradients sync outside any graph", dynamic)
    if compile_mode in ("reduce-overhead", "max-autotune"):
        # torch's own CUDA graphs (cudagraph trees) are already on; a second graph around them cannot be captured
        return Plan(compile_mode, False, f"mode={mode} uses torch's per-region CUDA graphs", dynamic)
    if cuda_graph is False:
        return Plan(compile_mode, False, "cuda_graph=False", dynamic)
    reason = "cuda_graph=True" if cuda_graph is True else "auto: launch overhead dominates small models on CUDA"
    return Plan(compile_mode, True, reason, False if dynamic is None else dynamic)
