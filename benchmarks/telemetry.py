"""Is FuseCallback's logged speedup honest, and what does its eager reference cost? Five fits in one process (one more
with each of ``--eager-control`` and ``--reset-control``).

For each model, batch and epoch length: an eager-only fit, a ``FuseCallback()`` fit, another eager-only fit, a
``FuseCallback(eager_steps=0)`` fit and a ``FuseCallback`` fit with a dense reference (:data:`DENSE`), each of
``--epochs`` epochs from the same seed. ``logged`` is the
``FuseCallback()`` fit's last epoch's ``speedup`` (``speedup_low``/``speedup_high`` where the callback logs
them); ``independent`` is the eager-only fits' median step over the ``eager_steps=0`` fit's, in the last epoch,
with a 95% percentile-bootstrap interval of that ratio of medians (``scipy.stats.bootstrap``), and
``independent_adjacent`` the same ratio from the second eager-only fit alone, the one run right before the
``eager_steps=0`` fit (the nearer moment of the host's), and ``independent_mean`` the ratio of the mean steps
(:func:`ratio_of_means`: a host with two speeds moves a median from one to the other);
``reference_cost`` is the ``FuseCallback()`` fit's last-epoch training time over the ``eager_steps=0`` fit's,
minus 1 (what the reference steps cost, and how far the host moved between the two fits), and
``reference_cost_in_run`` the reference's share of the whole ``FuseCallback()`` fit's training time as the callback
itself counts it (the steps it ran eagerly for the reference, lead-ins included, in one fit).
``eager_ratio_in_run`` is the median of the ``FuseCallback()`` fit's pooled eager reference steps (the eager
side of its last epoch's speedup) over the eager-only fits' median step in the last epoch: 1 when the in-run
reference runs as fast as plain eager (``optimizer``: every fit's AdamW, fused or as torch chooses);
``reference_age`` is how many epochs old that pool's newest chunk was in the last epoch (``fuse/reference_age``);
``logged_by_epoch`` is every epoch's ``[speedup, low, high, reference age]`` as the ``FuseCallback()`` fit logged
them, and ``independent_by_epoch`` every epoch's independent ratio (the first holds the compile and the search),
so that a fit of many ``epochs`` shows how its pool narrows the interval past the first measurement;
``eager_ratio_low``/``eager_ratio_high`` is its 95% interval, ``reference_steps`` how many reference steps it has
and ``reference_chunks`` in how many chunks (moments of the run) they came, over which the logged interval spreads
where there are two or more (``reference_ms`` and ``reference_sizes``: the steps themselves and each chunk's
count, ``dense_ms`` and ``dense_sizes`` the dense fit's, and ``plan_step_ms`` the logged median plan step of the
last epoch, so that an interval can be recomputed from a record). A default reference has a handful, too few to
see a 3% difference in host-bound eager steps, so the dense fit measures the same ratio from many
(``eager_ratio_dense``, with its interval, and ``eager_ratio_by_position``: the same ratio for the first timed step
of each chunk after its lead-in, for the second, and so on), and
``eager_fits_ratio`` (the second eager-only fit's median step over the first's; ``eager_fits_mean_ratio``, of their
mean steps) says how far two plain eager fits of one process agree, with a ``FuseCallback()`` fit between them. With
``--eager-control`` a third eager-only fit runs first, before any compiled work, and ``eager_control_ratio`` is the
first one's median step over it: two plain eager fits with nothing between them, so that a slower eager after
compiled work (the process's state) tells from the machine's drift over the same minutes. With ``--reset-control``
one more eager-only fit runs right after the second, once the process has let go of its compiled state
(:func:`release_compiled_state`), and ``eager_reset_ratio`` (``eager_reset_cpu_ratio``: of CPU time) is its median
step over the second's: whether what the process holds after compiled work slows plain eager, from two fits one
moment of the host apart. Whether the host made them differ: ``eager_fits_cpu_ratio`` is the same ratio of the main
thread's CPU time per step (what each step asked of the host; ``eager_cpu_ratio_in_run`` and
``eager_cpu_ratio_dense``: the reference steps', of every epoch, over the eager-only fits', of the last;
``eager_cpu_by_position`` as ``eager_ratio_by_position``),
``spin_ms_by_fit`` the host's speed for Python just before each fit, in their order, and after the
last (:func:`harness.host_spin_ms`), and ``switches_by_fit`` how often a step of each lost its core to another
thread or process (involuntary context switches per step). ``--host-spins`` reads the same spin inside the fits
(:class:`HostSpins`): at the lead-in of every reference chunk and at every :data:`SPIN_EVERY`-th batch, so that
``spin_ms_reference`` (the ``FuseCallback()`` fit's lead-ins), ``spin_ms_dense_reference`` (the dense fit's),
``spin_ms_plan`` (its plan's steps, last epoch) and ``spin_ms_eager`` (the eager-only fits', last epoch) tell a
slower host at the reference's moments from a cost of the switch (the spins add a few ms to the fits' time, the
lead-ins' to the reference's own, so neither ``reference_cost`` nor ``reference_cost_in_run`` is read from such a
record: ``--coverage`` takes a case's cost from its newest record without them). Reading by reading,
``eager_by_spin`` pairs each spin of the eager-only fits' last epoch with the median step of its :data:`SPIN_EVERY`
batches, ``plan_by_spin`` the same for the ``eager_steps=0`` fit, and ``reference_by_spin``/``dense_by_spin`` each
reference chunk's lead-in spin with the median of the chunk's timed steps (``[spin ms, step ms]`` pairs): whether a
chunk ran slower than plain eager at the same speed of the host. ``allocs_per_step`` (CUDA) is the mean
``cudaMalloc`` calls a step of the reference steps, their lead-ins, the dense fit's reference steps, the eager-only
fits' and the plan's (:func:`allocs_per_step`): whether the reference meets memory the allocator had not cached,
which plain eager steps would not; ``reference_allocs`` and ``lead_in_allocs`` are the ``FuseCallback()`` fit's own,
step by step in batch order (``reference_allocs`` beside ``reference_ms``), to tell whether the lead-in took the
switch's allocations or the timed steps after it still met new sizes. On the GPU:

    python benchmarks/telemetry.py --models gpt,resnet18 --epoch-steps 50,200,1000 --budget-s 540
    python benchmarks/telemetry.py --models resnet18 --batches small --epoch-steps 200 --optimizer default
    python benchmarks/telemetry.py --models resnet18 --batches small --epoch-steps 1000 --host-spins
    python benchmarks/telemetry.py --models gpt,llama --batches small --epoch-steps 200 --eager-control --reset-control
    python benchmarks/telemetry.py --smoke --models gpt --batches small --epoch-steps 12   # CPU, the code path
"""

from __future__ import annotations

import gc
import statistics
import sys
from pathlib import Path

import harness
import lightning.pytorch as pl
import models
import numpy as np
import torch

from lightning_fuse import FuseCallback
from lightning_fuse.timing import EAGER, LEAD_IN

FIELDS = ("model", "batch_size", "epoch_steps", "optimizer", "logged", "logged_low", "logged_high", "independent",
          "independent_low", "independent_high", "independent_adjacent", "independent_mean", "reference_cost",
          "reference_cost_in_run", "eager_ratio_in_run", "eager_ratio_low", "eager_ratio_high", "reference_steps",
          "reference_chunks", "eager_ratio_dense", "eager_ratio_dense_low", "eager_ratio_dense_high",
          "eager_ratio_by_position", "eager_fits_ratio", "eager_fits_mean_ratio", "eager_control_ratio",
          "eager_fits_cpu_ratio", "eager_reset_ratio", "eager_reset_cpu_ratio", "eager_cpu_ratio_in_run",
          "eager_cpu_ratio_dense", "eager_cpu_by_position", "reference_ms", "reference_sizes", "dense_ms",
          "dense_sizes", "plan_step_ms", "spin_ms_by_fit", "spin_ms_eager", "spin_ms_reference",
          "spin_ms_dense_reference", "spin_ms_plan", "eager_by_spin", "plan_by_spin", "reference_by_spin",
          "dense_by_spin", "switches_by_fit", "reference_age", "allocs_per_step", "reference_allocs",
          "lead_in_allocs", "epochs", "logged_by_epoch", "independent_by_epoch", "error")  # fmt: skip
DENSE = {"eager_steps": 60, "reference_budget": 0.5}
"""The dense reference's FuseCallback arguments: up to 60 eager steps an epoch (a third of its steps at most)."""
SPIN_EVERY = 100
"""With ``--host-spins``, the host's speed is also read at the middle batch of every this many (a plan's or eager's)."""


def interval(numerator: list[float], denominator: list[float]) -> tuple[float | None, float | None]:
    """95% percentile-bootstrap interval of ``median(numerator) / median(denominator)`` (``None`` without scipy
    or with fewer than 2 steps a side)."""
    try:
        from scipy.stats import bootstrap
    except ImportError:
        return None, None
    if len(numerator) < 2 or len(denominator) < 2:
        return None, None

    def ratio(a: np.ndarray, b: np.ndarray, axis: int) -> np.ndarray:
        return np.median(a, axis=axis) / np.median(b, axis=axis)

    result = bootstrap((numerator, denominator), ratio, n_resamples=2000, method="percentile", random_state=0)
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def pooled_reference(callbacks: list) -> tuple[list[float], list[int], float | None]:
    """The FuseCallback's pooled eager reference steps (ms) at the fit's end, how many of them each chunk holds,
    oldest first, and the reference's share of the fit's training time by the callback's own account (timed steps
    and lead-ins, the verdict's ``reference cost``); ``([], [], None)`` without a FuseCallback."""
    fuse = next((cb for cb in callbacks if isinstance(cb, FuseCallback)), None)
    if fuse is None:
        return [], [], None
    return fuse.fit.pool.samples, fuse.fit.pool.chunks, fuse.fit.reference_cost


def by_position(steps: list[float], chunks: list[int], eager: list[float]) -> list[float] | None:
    """The median of each chunk's first timed step, of its second and so on, over ``median(eager)``: whether the
    eager steps right after a switch from the plan run slower than the later ones. The oldest chunk is left out
    (the pool may have cut its first steps); ``None`` without two chunks or an eager step.

    Example::

        >>> by_position([9, 9, 30, 20, 20, 32, 20, 22], [2, 3, 3], [20.0])  # the oldest chunk (9, 9) left out
        [1.55, 1.0, 1.05]
    """
    if len(chunks) < 2 or not eager:
        return None
    kept = iter(steps[chunks[0]:])
    rows = [[next(kept) for _ in range(size)] for size in chunks[1:]]
    columns = [[row[i] for row in rows if i < len(row)] for i in range(max(chunks[1:]))]
    return [statistics.median(column) / statistics.median(eager) for column in columns]


class HostSpins(pl.Callback):
    """The host's speed for Python (:func:`harness.host_spin_ms`) at moments inside a fit: at the untimed lead-in of
    every reference chunk of ``fuse``, and at the middle batch of every :data:`SPIN_EVERY` that is not a timed
    reference step. Listed after the FuseCallback, it reads the kind that callback gave the step. ``readings``:
    ``(moment, epoch, batch index in the epoch, ms)``, the moment ``"reference"`` (a lead-in), ``"plan"``,
    ``"search"`` (before the plan) or ``"eager"`` (a fit without ``fuse``).

    Example::

        >>> HostSpins(None).readings
        []
    """

    def __init__(self, fuse: FuseCallback | None) -> None:
        self.fuse, self.readings = fuse, []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, idx: int) -> None:
        fit = self.fuse.fit if self.fuse is not None else None
        if fit is not None and fit.plan is not None and fit.step_kind == LEAD_IN:
            moment = "reference"
        elif idx % SPIN_EVERY == min(SPIN_EVERY, trainer.num_training_batches) // 2 and (
                fit is None or fit.step_kind != EAGER):  # a timed reference step keeps its own time  # fmt: skip
            moment = "eager" if fit is None else "search" if fit.plan is None else "plan"
        else:
            return
        self.readings.append((moment, trainer.current_epoch, idx, harness.host_spin_ms(repeats=3)))


Reading = tuple[str, int, int, float]
"""A :class:`HostSpins` reading: (moment, epoch, batch index in the epoch, spin ms)."""


def spins(readings: list[Reading], moment: str, epoch: int | None = None) -> float | None:
    """The median spin of ``readings`` at ``moment`` (in ``epoch``, or any); ``None`` where there is none.

    Example::

        >>> spins([("plan", 0, 5, 3.0), ("plan", 1, 5, 2.0), ("plan", 1, 9, 2.2), ("reference", 1, 7, 4.0)], "plan", 1)
        2.1
    """
    kept = [ms for kind, at, _, ms in readings if kind == moment and epoch in (None, at)]
    return statistics.median(kept) if kept else None


def blocks_by_spin(readings: list[Reading], epoch_ms: dict[int, list[float]], moment: str,
                   epoch: int) -> list[list[float]]:  # fmt: skip
    """``[spin, median step]`` for each reading at ``moment`` in ``epoch``: the median over the
    :data:`SPIN_EVERY` batches that hold the reading (``epoch_ms``: each epoch's step ms by batch, no warmup).

    Example::

        >>> blocks_by_spin([("eager", 1, 50, 2.5), ("eager", 0, 50, 9.0)], {1: [10.0] * 99 + [30.0]}, "eager", 1)
        [[2.5, 10.0]]
    """
    times = epoch_ms.get(epoch, [])
    starts = [(ms, idx - idx % SPIN_EVERY) for kind, at, idx, ms in readings if kind == moment and at == epoch]
    return [[ms, statistics.median(times[start : start + SPIN_EVERY])] for ms, start in starts if start < len(times)]


def chunks_by_spin(readings: list[Reading], fit: dict, steps: int) -> list[list[float]]:
    """``[lead-in spin, median of the chunk's timed steps]`` for each reference chunk of ``fit`` (``steps`` batches
    an epoch; its ``reference_steps`` marked by :class:`models.ReferenceSteps`, its ``epoch_ms`` from the StepClock).

    Example::

        >>> fit = {"reference_steps": {3, 4, 5}, "epoch_ms": {0: [1.0, 1.0, 9.0, 20.0, 22.0, 21.0, 1.0]}}
        >>> chunks_by_spin([("reference", 0, 2, 2.4)], fit, steps=7)
        [[2.4, 21.0]]
    """
    times = by_batch(fit["epoch_ms"], steps)
    rows = []
    for kind, epoch, idx, ms in readings:
        if kind != "reference":
            continue
        batch, chunk = epoch * steps + idx + 1, []
        while batch in fit["reference_steps"] and batch in times:
            chunk.append(times[batch])
            batch += 1
        if chunk:
            rows.append([ms, statistics.median(chunk)])
    return rows


def by_batch(per_epoch: dict[int, list[float]], steps: int) -> dict[int, float]:
    """Per-epoch lists of step values (``steps`` batches an epoch) keyed by the fit's batch index instead.

    Example::

        >>> by_batch({0: [1.0, 2.0], 1: [3.0]}, steps=2)
        {0: 1.0, 1: 2.0, 2: 3.0}
    """
    return {epoch * steps + i: value for epoch, values in per_epoch.items() for i, value in enumerate(values)}


def reference_cpu_ms(fit: dict, steps: int) -> tuple[list[float], list[int]]:
    """The main thread's CPU milliseconds of each reference step of ``fit`` (``steps`` batches an epoch), and how
    many of them each chunk (a run of consecutive batches) holds, as :func:`pooled_reference` gives them."""
    marked = sorted(fit["reference_steps"])
    cpu = by_batch(fit["epoch_cpu_ms"], steps)
    kept = [batch for batch in marked if batch in cpu]
    chunks: list[int] = []
    for previous, batch in zip([None, *kept], kept):
        if previous == batch - 1:
            chunks[-1] += 1
        else:
            chunks.append(1)
    return [cpu[batch] for batch in kept], chunks


def allocs_per_step(fits: dict[str, dict], steps: int, epochs: int) -> dict[str, float | None] | None:
    """The mean ``cudaMalloc`` calls a step (the fits' ``device_allocs``, :class:`harness.StepClock`; ``None`` off
    CUDA) of the ``FuseCallback()`` fit's reference steps, of their chunks' lead-ins and of the dense fit's reference
    steps (every epoch), and of the eager-only fits' and the ``eager_steps=0`` fit's steps (the last epoch).

    Example::

        >>> fits = {name: {"device_allocs": [4, 0, 0, 1, 0], "reference_steps": {0, 3}, "lead_in_steps": {2}}
        ...         for name in ("fuse", "fuse_dense", "eager_1", "eager_2", "fuse_0")}
        >>> allocs_per_step(fits, steps=3, epochs=2)
        {'reference': 2.5, 'lead_in': 0, 'dense_reference': 2.5, 'eager': 0.5, 'plan': 0.5}
    """
    if fits["fuse"].get("device_allocs") is None:
        return None

    def last_epoch(*names: str) -> list[int]:
        return [count for name in names for count in fits[name]["device_allocs"][(epochs - 1) * steps:]]

    sides = {"reference": allocs_at(fits["fuse"], "reference_steps"),
             "lead_in": allocs_at(fits["fuse"], "lead_in_steps"),
             "dense_reference": allocs_at(fits["fuse_dense"], "reference_steps"),
             "eager": last_epoch("eager_1", "eager_2"), "plan": last_epoch("fuse_0")}  # fmt: skip
    return {side: statistics.mean(counts) if counts else None for side, counts in sides.items()}


def allocs_at(fit: dict, steps: str) -> list[int] | None:
    """A fit's ``cudaMalloc`` calls at its batches named by ``steps`` (``"lead_in_steps"``, ``"reference_steps"``), in
    batch order; ``None`` off CUDA.

    Example::

        >>> allocs_at({"device_allocs": [4, 0, 0, 1, 0], "reference_steps": {3, 0}}, "reference_steps")
        [4, 1]
    """
    allocs = fit.get("device_allocs")
    if allocs is None:
        return None
    return [allocs[batch] for batch in sorted(fit.get(steps, ())) if batch < len(allocs)]


def ratio_of_medians(numerator: list[float], denominator: list[float]) -> float | None:
    """``median(numerator) / median(denominator)``, or ``None`` when either side has no step."""
    return statistics.median(numerator) / statistics.median(denominator) if numerator and denominator else None


def ratio_of_means(numerator: list[float], denominator: list[float]) -> float | None:
    """``mean(numerator) / mean(denominator)``, or ``None`` when either side has no step: the ratio of the time the
    steps took, which moves with the share of steps a slow moment of the host held, where a median jumps between
    the host's two speeds once about half the steps ran at each.

    Example::

        >>> later, earlier = [2.0, 2.0, 3.6, 3.6, 3.6], [2.0, 2.0, 2.0, 3.6, 3.6]  # one step more in the slow moment
        >>> round(ratio_of_means(later, earlier), 2), ratio_of_medians(later, earlier)
        (1.12, 1.8)
    """
    return statistics.fmean(numerator) / statistics.fmean(denominator) if numerator and denominator else None


def steps_of(fits: dict[str, dict], name: str, epoch: int) -> list[float]:
    """The step ms of fit ``name``'s ``epoch`` (none where it ran no such epoch)."""
    return fits[name]["epoch_ms"].get(epoch, [])


def release_compiled_state() -> None:
    """Let go of what the process holds after compiled fits: dynamo's and inductor's caches and the CUDA graphs
    (:func:`torch.compiler.reset`; files on disk stay), unreachable objects, the CUDA allocator's unused blocks."""
    torch.compiler.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_fits(spec: dict) -> dict[str, dict]:
    """The fits of :func:`measure`, in order and in one process: ``eager_0`` (with ``eager_control``), ``eager_1``,
    ``fuse``, ``eager_2``, ``eager_3`` (with ``reset_control``: after :func:`release_compiled_state`), ``fuse_0``
    (``eager_steps=0``) and ``fuse_dense`` (:data:`DENSE`), each with its pooled reference, spins and marks."""
    epochs, steps = spec["epochs"], spec["epoch_steps"]
    control = [("eager_0", "eager", {})] if spec.get("eager_control") else []
    reset = [("eager_3", "eager", {})] if spec.get("reset_control") else []
    fits = {}
    order = (*control, ("eager_1", "eager", {}), ("fuse", "fuse", {}), ("eager_2", "eager", {}), *reset,
             ("fuse_0", "fuse", {"eager_steps": 0}), ("fuse_dense", "fuse", DENSE))
    for name, variant, fuse_kw in order:
        if name == "eager_3":
            release_compiled_state()
        task, loader = models.build(spec["model"], spec["batch_size"], spec["smoke"], steps,
                                    fused=spec.get("optimizer", "fused") == "fused")
        callbacks = models.apply_variant(task, variant, spec["smoke"], spec["cache_dir"], **fuse_kw)
        marks = [models.ReferenceSteps(callbacks[0])] if callbacks else []
        host = [HostSpins(callbacks[0] if callbacks else None)] if spec.get("host_spins") else []
        fits[name] = {**harness.fit(task, loader, steps=epochs * steps, warmup=0, callbacks=callbacks + marks + host,
                                    max_epochs=epochs), **models.fuse_info(callbacks),
                      "reference": pooled_reference(callbacks), "spins": host[0].readings if host else [],
                      "reference_steps": marks[0].reference if marks else set(),
                      "lead_in_steps": marks[0].lead_ins if marks else set()}  # fmt: skip
    return fits


def measure(spec: dict) -> dict:
    """The five fits (six or seven with ``eager_control``, ``reset_control``) of :func:`run_fits`; the last epoch of
    each counts."""
    epochs, steps = spec["epochs"], spec["epoch_steps"]
    fits = run_fits(spec)
    control, reset = "eager_0" in fits, "eager_3" in fits
    last = {name: steps_of(fits, name, epochs - 1) for name in fits}
    cpu = {name: fit["epoch_cpu_ms"].get(epochs - 1, []) for name, fit in fits.items()}
    eager_cpu = cpu["eager_1"] + cpu["eager_2"]
    dense_cpu, dense_cpu_chunks = reference_cpu_ms(fits["fuse_dense"], steps)
    eager, compiled = last["eager_1"] + last["eager_2"], last["fuse_0"]
    history = fits["fuse"]["history"][-1] if fits["fuse"]["history"] else {}
    low, high = interval(eager, compiled)
    (reference, chunks, own_cost), (dense, dense_chunks, _) = fits["fuse"]["reference"], fits["fuse_dense"]["reference"]
    in_run_low, in_run_high = interval(reference, eager)
    dense_low, dense_high = interval(dense, eager)
    return {
        "logged": history.get("fuse/speedup"), "logged_low": history.get("fuse/speedup_low"),
        "logged_high": history.get("fuse/speedup_high"),
        "independent": ratio_of_medians(eager, compiled), "independent_low": low, "independent_high": high,
        "independent_adjacent": ratio_of_medians(last["eager_2"], compiled),
        "independent_mean": ratio_of_means(eager, compiled),
        "reference_cost": sum(last["fuse"]) / sum(compiled) - 1 if last["fuse"] and compiled else None,
        "reference_cost_in_run": own_cost,
        "eager_ratio_in_run": ratio_of_medians(reference, eager), "eager_ratio_low": in_run_low,
        "eager_ratio_high": in_run_high, "reference_steps": len(reference),
        "reference_chunks": len(chunks), "reference_ms": reference, "reference_sizes": chunks, "dense_ms": dense,
        "dense_sizes": dense_chunks, "plan_step_ms": history.get("fuse/step_ms"),
        "eager_ratio_dense": ratio_of_medians(dense, eager), "eager_ratio_dense_low": dense_low,
        "eager_ratio_dense_high": dense_high, "eager_ratio_by_position": by_position(dense, dense_chunks, eager),
        "eager_fits_ratio": ratio_of_medians(last["eager_2"], last["eager_1"]),
        "eager_fits_mean_ratio": ratio_of_means(last["eager_2"], last["eager_1"]),
        "eager_control_ratio": ratio_of_medians(last["eager_1"], last["eager_0"]) if control else None,
        "eager_fits_cpu_ratio": ratio_of_medians(cpu["eager_2"], cpu["eager_1"]),
        "eager_reset_ratio": ratio_of_medians(last["eager_3"], last["eager_2"]) if reset else None,
        "eager_reset_cpu_ratio": ratio_of_medians(cpu["eager_3"], cpu["eager_2"]) if reset else None,
        "eager_cpu_ratio_in_run": ratio_of_medians(reference_cpu_ms(fits["fuse"], steps)[0], eager_cpu),
        "eager_cpu_ratio_dense": ratio_of_medians(dense_cpu, eager_cpu),
        "eager_cpu_by_position": by_position(dense_cpu, dense_cpu_chunks, eager_cpu),
        "spin_ms_by_fit": [*(fit["spin_ms"] for fit in fits.values()), harness.host_spin_ms()],
        "spin_ms_eager": spins(fits["eager_1"]["spins"] + fits["eager_2"]["spins"], "eager", epochs - 1),
        "spin_ms_reference": spins(fits["fuse"]["spins"], "reference"),
        "spin_ms_dense_reference": spins(fits["fuse_dense"]["spins"], "reference"),
        "spin_ms_plan": spins(fits["fuse"]["spins"], "plan", epochs - 1),
        "eager_by_spin": [row for name in ("eager_1", "eager_2") for row in
                          blocks_by_spin(fits[name]["spins"], fits[name]["epoch_ms"], "eager", epochs - 1)],
        "plan_by_spin": blocks_by_spin(fits["fuse_0"]["spins"], fits["fuse_0"]["epoch_ms"], "plan", epochs - 1),
        "reference_by_spin": chunks_by_spin(fits["fuse"]["spins"], fits["fuse"], steps),
        "dense_by_spin": chunks_by_spin(fits["fuse_dense"]["spins"], fits["fuse_dense"], steps),
        "switches_by_fit": [fit["switches_per_step"] for fit in fits.values()],
        "reference_age": history.get("fuse/reference_age"), "allocs_per_step": allocs_per_step(fits, steps, epochs),
        "reference_allocs": allocs_at(fits["fuse"], "reference_steps"),
        "lead_in_allocs": allocs_at(fits["fuse"], "lead_in_steps"),
        "epochs": epochs,
        "logged_by_epoch": [[row.get(f"fuse/{key}") for key in ("speedup", "speedup_low", "speedup_high",
                                                                 "reference_age")] for row in fits["fuse"]["history"]],
        "independent_by_epoch": [ratio_of_medians(steps_of(fits, "eager_1", epoch) + steps_of(fits, "eager_2", epoch),
                                                  steps_of(fits, "fuse_0", epoch)) for epoch in range(epochs)],
        "error": next((f"{name}: {fit['error']}" for name, fit in fits.items() if fit["error"]), None),
    }  # fmt: skip


def coverage(records: list[dict]) -> str:
    """The issue's checks, case by case and in all, as Markdown: each case's newest record (model, batch, epoch
    steps, optimizer) that has a logged interval and an independent ratio. A case is ``in`` where the independent
    ratio lies inside the logged interval, ``ovl`` where only their intervals overlap; the half-width is relative
    to the logged point; ``in-run`` is ``eager_ratio_in_run``, ``eager, eager`` the ``eager_fits_ratio`` (two plain
    eager fits of one process: how closely plain eager matches itself there, which bounds how closely a reference
    can be shown to match it), ``cost`` the ``reference_cost_in_run``; ``epochs`` the fit's ``epochs`` (records
    before the field ran the default, 2).

    Example::

        >>> rows = [{"model": "m", "batch_size": 8, "epoch_steps": 200, "logged": 5.0, "logged_low": 4.8,
        ...          "logged_high": 5.2, "independent": 5.1, "independent_low": 5.0, "independent_high": 5.2,
        ...          "eager_ratio_in_run": 1.02, "eager_fits_ratio": 1.05, "reference_cost_in_run": 0.012}]
        >>> print(coverage(rows).splitlines()[2])
        | m | 8 | 200 | fused | 2 | 5.00 (4.80-5.20) | 5.10 (5.00-5.20) | in | 4% | 1.02 | 1.05 | 1.2% |
        >>> print(coverage(rows).splitlines()[-1])
        Inside 1 of 1 (100%); overlapping 1 (100%); in-run within 3% 1 of 1 (two plain eager fits of one process \
within 3% of each other in 0 of the 1 that record it); half-width <= 5% on 200- and 1000-step epochs 1 of 1; \
reference cost <= 2% on 1000-step epochs 0 of the 0 that record it.
    """
    judged = [(case, record, *_judge(record)) for case, record in sorted(_newest(records).items())]
    verdicts = [verdict for _, _, verdict, _ in judged]
    widths = [width for case, _, _, width in judged if case[2] >= 200]
    costs = [r["reference_cost_in_run"] for case, r in _newest([r for r in records if not _spun(r)]).items()
             if case[2] >= 1000 and r.get("reference_cost_in_run") is not None]  # records before the field have none
    in_run = sum(_within_3_percent(r.get("eager_ratio_in_run")) for _, r, _, _ in judged)
    floors = [r["eager_fits_ratio"] for _, r, _, _ in judged if r.get("eager_fits_ratio") is not None]
    inside, overlap, cases = verdicts.count("in"), len(verdicts) - verdicts.count("out"), len(verdicts)
    spun = any(_spun(r) and r.get("reference_cost_in_run") is not None for _, r, _, _ in judged)
    spun_note = " † Counts the host spins read at its lead-ins: the check reads the case's newest record without them."
    return "\n".join([
        ("| model | batch | epoch | optimizer | epochs | logged (interval) | measured apart | | half-width | in-run "
         "| eager, eager | cost |"), "|---|---:|---:|---|---:|---|---|---|---:|---:|---:|---:|",
        *(_coverage_row(*row) for row in judged), "",
        (f"Inside {inside} of {cases} ({inside / max(cases, 1):.0%}); overlapping {overlap} "
         f"({overlap / max(cases, 1):.0%}); in-run within 3% {in_run} of {cases} (two plain eager fits of one process "
         f"within 3% of each other in {sum(map(_within_3_percent, floors))} of the {len(floors)} that record it); "
         f"half-width <= 5% on 200- and "
         f"1000-step epochs {sum(w <= 0.05 for w in widths)} of {len(widths)}; reference cost <= 2% on 1000-step "
         f"epochs {sum(c <= 0.02 for c in costs)} of the {len(costs)} that record it.{_control(judged)}"
         f"{spun_note if spun else ''}"),
    ])  # fmt: skip


def _control(judged: list[tuple]) -> str:
    """What the ``--eager-control`` and ``--reset-control`` records say: two plain eager fits with nothing between
    them, against two with a ``FuseCallback()`` fit between them, as medians over the cases that record both; and
    the eager fit after those, the compiled state let go, against the one before it.

    Example::

        >>> rows = [{"eager_control_ratio": 1.01, "eager_fits_ratio": 1.05, "eager_reset_ratio": 0.98},
        ...         {"eager_control_ratio": 0.99}]
        >>> _control([(None, row) for row in rows])
        ' Two plain eager fits with nothing between them: median 1.01, within 3% in 1 of 1; with a FuseCallback() \
fit between them, in the same cases: median 1.05; the compiled state let go after the second, a third over it: \
median 0.98, within 3% in 1 of 1.'
    """
    pairs = [(r["eager_control_ratio"], r["eager_fits_ratio"]) for _, r, *_ in judged
             if r.get("eager_control_ratio") is not None and r.get("eager_fits_ratio") is not None]
    if not pairs:
        return ""
    control, across = zip(*pairs)
    reset = [r["eager_reset_ratio"] for _, r, *_ in judged if r.get("eager_reset_ratio") is not None]
    released = (f"; the compiled state let go after the second, a third over it: median {statistics.median(reset):.2f}"
                f", within 3% in {sum(map(_within_3_percent, reset))} of {len(reset)}" if reset else "")
    return (f" Two plain eager fits with nothing between them: median {statistics.median(control):.2f}, within 3% "
            f"in {sum(map(_within_3_percent, control))} of {len(control)}; with a FuseCallback() fit between them, "
            f"in the same cases: median {statistics.median(across):.2f}{released}.")


def by_epoch(records: list[dict]) -> str:
    """Each epoch's logged interval, as Markdown, for the cases whose newest record (as :func:`coverage` picks
    them) ran more than two epochs: its half-width, ``*`` where that epoch's separate measurement fell outside
    it, and the reference's age in epochs in brackets where it was measured earlier. Empty without such a case.

    Example::

        >>> row = {"model": "m", "batch_size": 8, "epoch_steps": 1000, "logged": 2.0, "logged_low": 1.9,
        ...        "logged_high": 2.1, "independent": 2.0, "epochs": 3, "independent_by_epoch": [2.5, 2.0, 2.0],
        ...        "logged_by_epoch": [[2.0, 1.6, 2.4, 0], [2.0, 1.6, 2.4, 1], [2.0, 1.9, 2.1, 0]]}
        >>> print(by_epoch([row]).splitlines()[-1])
        | m | 8 | 1000 | fused | 20%* | 20% (1) | 5% |
    """
    long = [(case, r) for case, r in sorted(_newest(records).items()) if (r.get("epochs") or 2) > 2]
    if not long:
        return ""
    most = max(r["epochs"] for _, r in long)
    lines = ["| model | batch | epoch | optimizer | " + " | ".join(f"epoch {e}" for e in range(most)) + " |",
             "|---|---:|---:|---|" + "---:|" * most]  # fmt: skip
    for case, r in long:
        cells = [_epoch_cell(logged, truth) for logged, truth in zip(r["logged_by_epoch"], r["independent_by_epoch"])]
        lines.append(f"| {' | '.join(map(str, case))} | " + " | ".join(cells + ["-"] * (most - len(cells))) + " |")
    return "\n".join(lines)


def _epoch_cell(logged: list, truth: float | None) -> str:
    point, low, high, age = logged
    if None in (point, low, high):
        return "-"
    outside = "" if truth is None or low <= truth <= high else "*"
    width = (high - low) / 2 / point
    return (f"{width:.0%}" if width >= 0.01 else f"{width:.1%}") + outside + (f" ({age:.0f})" if age else "")


def _newest(records: list[dict]) -> dict[tuple, dict]:
    """Each case's newest record (model, batch, epoch steps, optimizer; none named: fused) that has a logged
    interval and an independent ratio."""
    newest, keys = {}, ("model", "batch_size", "epoch_steps", "optimizer")
    for record in records:
        if None not in (record.get("logged_low"), record.get("logged_high"), record.get("independent")):
            newest[tuple(record.get(key) or "fused" for key in keys)] = record
    return newest


def _spun(record: dict) -> bool:
    """Whether the ``FuseCallback()`` fit of a record read the host's speed at its reference's lead-ins
    (``--host-spins``, ``spin_ms_reference``): those spins count in the reference's time, so its
    ``reference_cost_in_run`` is not the reference's alone."""
    return record.get("spin_ms_reference") is not None


def _judge(record: dict) -> tuple[str, float]:
    """``in`` where a record's independent ratio lies inside its logged interval, ``ovl`` where only their intervals
    overlap, else ``out``; and the logged interval's half-width relative to its point."""
    low, high, truth = record["logged_low"], record["logged_high"], record["independent"]
    truth_low, truth_high = record.get("independent_low") or truth, record.get("independent_high") or truth
    verdict = "in" if low <= truth <= high else "ovl" if truth_low <= high and low <= truth_high else "out"
    return verdict, (high - low) / 2 / record["logged"]


def _within_3_percent(ratio: float | None) -> bool:
    """Whether a ratio of step times reads 1 within the issue's 3% (``None``, unmeasured: no)."""
    return ratio is not None and abs(ratio - 1) <= 0.03


def _coverage_row(case: tuple, r: dict, verdict: str, width: float) -> str:
    truth, cost = r["independent"], r.get("reference_cost_in_run")
    ratios = (r.get("eager_ratio_in_run"), r.get("eager_fits_ratio"))
    return (f"| {' | '.join(map(str, case))} | {r.get('epochs') or 2} | "
            f"{r['logged']:.2f} ({r['logged_low']:.2f}-{r['logged_high']:.2f}) | "
            f"{truth:.2f} ({r.get('independent_low') or truth:.2f}-{r.get('independent_high') or truth:.2f}) | "
            f"{verdict} | {width:.0%} | {' | '.join('-' if x is None else f'{x:.2f}' for x in ratios)} | "
            f"{'-' if cost is None else f'{cost:.1%}'}{'†' if cost is not None and _spun(r) else ''} |")


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "telemetry.jsonl", models="gpt,resnet18", batches="small,large")
    p.add_argument("--epoch-steps", default="50,200,1000", help="steps per epoch, a comma list")
    p.add_argument("--epochs", type=int, default=2, help="epochs per fit; the last one counts")
    p.add_argument("--optimizer", choices=("fused", "default"), default="fused",
                   help="AdamW(fused=True), or AdamW() with torch's choice (foreach on CUDA), as most users write it")
    p.add_argument("--host-spins", action="store_true", help="read the host's speed inside the fits (HostSpins)")
    p.add_argument("--eager-control", action="store_true",
                   help="a plain eager fit first, before any compiled work (eager_control_ratio)")
    p.add_argument("--reset-control", action="store_true",
                   help="a plain eager fit after eager_2 with the compiled state let go (eager_reset_ratio)")
    p.add_argument("--coverage", type=Path, help="print the issue's checks over these records (coverage), and stop")
    args = p.parse_args(argv)
    if args.coverage:
        records = harness.read_records(args.coverage)
        print(coverage(records))
        epochs = by_epoch(records)
        if epochs:
            print("\nEach epoch's half-width (* the separate measurement outside; (n) a reference n epochs old):\n")
            print(epochs)
        return 0
    groups = [[{"model": model, "batch_size": batch, "epoch_steps": int(steps), "epochs": args.epochs,
                "optimizer": args.optimizer, "host_spins": args.host_spins, "eager_control": args.eager_control,
                "reset_control": args.reset_control,
                "smoke": args.smoke}]
              for model, batch in models.regimes(args) for steps in args.epoch_steps.split(",")]
    return harness.run(args, "telemetry.py", measure, FIELDS, groups)


if __name__ == "__main__":
    sys.exit(main())
