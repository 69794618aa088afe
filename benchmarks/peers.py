r"""FuseCallback against the alternatives a Lightning user has, on the recipe models, inside the Lightning Trainer.

Variants (all ``precision="bf16-mixed"``, TF32 on, random data already on the device):

- ``eager``; ``compile`` (``task.model.compile()``); ``reduce_overhead``
  (``task.model.compile(mode="reduce-overhead")``); ``regional`` (each repeated block ``.compile()``, as
  Accelerate's ``compile_regions``); ``fuse`` (``FuseCallback()``).
- Exploration: ``eager_callback`` (``FuseCallback(targets=[], cuda_graph=False)``: the callback's overhead alone),
  ``fuse_graph_only``, ``fuse_regional_graph``, ``fuse_full_graph``, ``fuse_full_autotune_graph``.

One GPU, from the repository root::

    python benchmarks/peers.py run --out benchmarks/results                  # everything, within --budget-s
    python benchmarks/peers.py report benchmarks/results/*.json > benchmarks/RESULTS.md
    python benchmarks/peers.py setup --model gpt --batch 8 --variant fuse --cache /tmp/c --steps 3   # one JSON line
    python benchmarks/peers.py steps --model gpt --batch 8 --variants eager,fuse --cache /tmp/c      # JSON lines
    python benchmarks/peers.py loss --model gpt --batch 8 --steps 200 --cache /tmp/c                 # one JSON line

``run`` works in two phases (see ``benchmarks/README.md``): (1) compile-heavy jobs in fresh processes, several at a
time on disjoint CPU cores: cold then warm setup of compile/reduce_overhead/regional/fuse at the small batch of each
model, and one cold "prewarm" of every other compiling (regime, variant) into its own cache directory, plus the
learning check; (2) with nothing else running, one process per regime times every variant, all caches warm.

This module imports only the standard library; the measuring code is in ``peers_measure.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
for _path in (str(HERE.parent), str(HERE)):  # `recipes`, `lightning_fuse` and `peers_measure` import from here
    if _path not in sys.path:
        sys.path.insert(0, _path)

CORE = ("eager", "compile", "reduce_overhead", "regional", "fuse")
EXTRA = ("eager_callback", "eager_callback_no_nvml", "fuse_graph_only", "fuse_regional_graph", "fuse_full_graph",
         "fuse_full_autotune_graph")
VARIANTS = CORE + EXTRA
ALTERNATIVES = ("eager", "compile", "reduce_overhead", "regional")
SETUP_VARIANTS = ("compile", "reduce_overhead", "regional", "fuse")  # cold + warm setup, small batch only
NOT_COMPILING = ("eager", "eager_callback", "eager_callback_no_nvml", "fuse_graph_only")
# Order of the timed runs of a regime: what the targets need first, in case the budget runs out.
TIMING_ORDER = ("eager", "fuse", "reduce_overhead", "compile", "regional", "eager_callback", "eager_callback_no_nvml",
                "fuse_graph_only",
                "fuse_regional_graph", "fuse_full_graph", "fuse_full_autotune_graph")
DEFAULT_REGIMES = ("resnet:16", "resnet:256", "gpt:8", "gpt:64")
MODEL_NAMES = {"resnet": "ResNet-18 (CIFAR)", "gpt": "GPT-8L"}

# The issue's targets for `fuse`.
SMALL_BATCH_RATIO = 0.80  # step time <= 0.80x the best alternative at small batch
LARGE_BATCH_RATIO = 0.87  # ... and <= 0.87x at large batch
SMALL_BATCH_SIZES = {"resnet": 16, "gpt": 8}  # the issue's small-batch regimes; larger batches are "large"
COLD_SETUP_RATIO = 0.5  # cold setup <= 0.5x full-model `compile` cold setup
WARM_SETUP_RATIO = 0.25  # warm setup <= 0.25x its own cold setup
CALLBACK_OVERHEAD = 0.01  # eager_callback step <= 1.01x eager

# Rough cold compile seconds on an H100 (perf-notes), used only to start the longest jobs first.
_EST_COLD_S = {"compile": 28, "reduce_overhead": 25, "regional": 20, "fuse": 30, "fuse_regional_graph": 30,
               "fuse_full_graph": 28, "fuse_full_autotune_graph": 150}  # fmt: skip
_EST_RESNET_EXTRA_S = {"regional": 20, "fuse": 16, "fuse_regional_graph": 16}  # ResNet's 7 distinct block graphs


def log(message: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ================================================================================================ CLI
def main(argv: Sequence[str] | None = None, results: TextIO | None = None) -> int:
    """Entry point. ``results`` receives the JSON lines of ``setup``/``steps``/``loss`` (default: stdout)."""
    args = _parser().parse_args(argv)
    if getattr(args, "cpus", None):
        os.sched_setaffinity(0, args.cpus)  # before torch starts any thread
    emit = _emitter(results or sys.stdout)
    if args.command == "report":
        return cmd_report(args.files, sys.stdout)
    if args.command == "run":
        return cmd_run(args, argv if argv is not None else sys.argv[1:])
    import peers_measure as pm  # torch, lightning: only for the subcommands that train

    pm.configure_process()
    command = "python benchmarks/peers.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    env = {**pm.environment(), "measure_command": command}
    if args.command == "setup":
        rec = pm.measure(args.model, args.batch, args.variant, warmup=0, steps=args.steps, cache_root=args.cache,
                         tiny=args.tiny, backend=args.backend, precision=args.precision,
                         sync_at=(0, args.steps - 1))  # fmt: skip
        emit({"event": "record", "kind": "setup", **env, **rec})
        return 0
    if args.command == "steps":
        return cmd_steps(args, pm, env, emit)
    if args.command == "loss":
        cache = args.cache or tempfile.mkdtemp(prefix="peers-loss-")
        rec = pm.loss_check(args.model, args.batch, args.steps, cache_root=cache, tiny=args.tiny,
                            backend=args.backend, precision=args.precision)  # fmt: skip
        emit({"event": "record", **env, **rec})
        log(_loss_line(rec))
        return 0
    raise AssertionError(args.command)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="peers.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tiny", action="store_true", help="tiny model sizes (CPU smoke test)")
        p.add_argument("--backend", default="inductor", help="torch.compile backend of every compiling variant")
        p.add_argument("--precision", default="bf16-mixed", help="Lightning Trainer precision")
        p.add_argument("--cpus", type=_cpu_list, default=None, help=argparse.SUPPRESS)  # set by `run`

    run = sub.add_parser("run", help="everything: setup jobs, step times, learning check; writes OUT/<device>.json")
    run.add_argument("--out", required=True, help="directory for <device-slug>.json and logs/")
    run.add_argument("--regimes", default=",".join(DEFAULT_REGIMES), type=_regimes, help="model:batch,...")
    run.add_argument("--variants", default=",".join(VARIANTS), type=_variants, help="comma-separated variants")
    run.add_argument("--steps", type=int, default=100, help="timed steps per variant")
    run.add_argument("--warmup", type=int, default=15, help="untimed steps first (compile, CUDA-graph capture)")
    run.add_argument("--setup-steps", type=int, default=3, help="steps of each setup job")
    run.add_argument("--budget-s", type=float, default=520.0, help="hard wall-clock limit of the whole run")
    run.add_argument("--jobs", type=int, default=0, help="concurrent setup jobs in phase 1 (0: CPUs // 3, at most 5)")
    run.add_argument("--cache", default=None, help="parent of this run's fresh cache directory (default: $TMPDIR)")
    run.add_argument("--keep-cache", action="store_true", help="keep the compile caches after the run")
    run.add_argument("--no-loss", dest="loss", action="store_false", help="skip the eager-vs-fuse learning check")
    run.add_argument("--loss-steps", type=int, default=200, help="steps of the learning check")
    run.add_argument("--tag", default="", help="suffix of the output file name")
    run.add_argument("--logs", default=None, help="directory of the per-process logs (default: OUT/logs)")
    run.add_argument("--plan-only", action="store_true", help="print the jobs and exit")
    common(run)

    setup = sub.add_parser("setup", help="one setup measurement in this (fresh) process; prints one JSON line")
    setup.add_argument("--model", required=True, choices=tuple(MODEL_NAMES))
    setup.add_argument("--batch", required=True, type=int)
    setup.add_argument("--variant", required=True, choices=VARIANTS)
    setup.add_argument("--cache", required=True, help="cache root; this job uses <root>/<model>-<batch>/<variant>")
    setup.add_argument("--steps", type=int, default=3)
    common(setup)

    steps = sub.add_parser("steps", help="step times of several variants of one regime, in this process")
    steps.add_argument("--model", required=True, choices=tuple(MODEL_NAMES))
    steps.add_argument("--batch", required=True, type=int)
    steps.add_argument("--variants", default=",".join(VARIANTS), type=_variants)
    steps.add_argument("--cache", required=True, help="cache root (same layout as `setup`)")
    steps.add_argument("--steps", type=int, default=100)
    steps.add_argument("--warmup", type=int, default=15)
    steps.add_argument("--deadline", type=float, default=math.inf, help="epoch seconds; later variants are skipped")
    common(steps)

    loss = sub.add_parser("loss", help="eager vs fuse final loss from the same seed and data; one JSON line")
    loss.add_argument("--model", default="gpt", choices=tuple(MODEL_NAMES))
    loss.add_argument("--batch", type=int, default=8)
    loss.add_argument("--steps", type=int, default=200)
    loss.add_argument("--cache", default=None, help="cache root (same layout as `setup`); default: a temp dir")
    common(loss)

    report = sub.add_parser("report", help="markdown tables from result files")
    report.add_argument("files", nargs="+")
    return parser


def _regimes(text: str) -> list[tuple[str, int]]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        model, _, batch = item.partition(":")
        if model not in MODEL_NAMES or not batch.isdigit() or int(batch) < 1:
            raise argparse.ArgumentTypeError(f"regime {item!r} must be model:batch with model in {list(MODEL_NAMES)}")
        out.append((model, int(batch)))
    if not out:
        raise argparse.ArgumentTypeError("no regime given; e.g. --regimes gpt:8,resnet:16")
    return out


def _variants(text: str) -> list[str]:
    out = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in out if v not in VARIANTS]
    if unknown or not out:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    return [v for v in VARIANTS if v in out]  # canonical order: eager first, the costliest compile last


def _cpu_list(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c != ""]


def _emitter(stream: TextIO):
    def emit(obj: dict[str, Any]) -> None:
        stream.write(json.dumps(obj, default=str) + "\n")
        stream.flush()

    return emit


# ================================================================================================ steps (one regime)
def cmd_steps(args: argparse.Namespace, pm: Any, env: dict[str, Any], emit) -> int:
    """Time every variant of one regime in this process; stop early (exit 3) if CUDA became unusable."""
    eager_ms = None
    for variant in sorted(args.variants, key=TIMING_ORDER.index):
        est_s = 5 + (args.warmup + args.steps) * (eager_ms or 20.0) / 1e3
        if time.time() + est_s > args.deadline:
            emit({"event": "record", "kind": "steps", **env, "model": args.model, "batch_size": args.batch,
                  "variant": variant, "error": "skipped: time budget exhausted"})  # fmt: skip
            continue
        emit({"event": "start", "variant": variant})
        rec = pm.measure(args.model, args.batch, variant, warmup=args.warmup, steps=args.steps, cache_root=args.cache,
                         tiny=args.tiny, backend=args.backend, precision=args.precision, sample_gpu=True)  # fmt: skip
        if variant == "eager" and rec.get("step_ms"):
            eager_ms = rec["step_ms"]
        emit({"event": "record", "kind": "steps", **env, **rec})
        if rec.get("fatal"):
            return 3
    return 0


# ================================================================================================ run
@dataclass
class Job:
    """One fresh-process setup measurement of phase 1."""

    kind: str  # "cold", "warm", "prewarm" or "loss"
    model: str
    batch: int
    variant: str
    argv: list[str]
    priority: tuple
    after: Job | None = None
    status: str = "pending"  # pending, running, done, failed, skipped
    result: dict[str, Any] | None = None
    error: str | None = None
    wall_s: float | None = None
    cpus: list[int] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    started: float = 0.0
    out_path: Path | None = None

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.model}-{self.batch}-{self.variant}"

    @property
    def ok(self) -> bool:
        return self.status == "done" and self.result is not None and not self.result.get("error")


class Run:
    """State of one `run`: its settings, phase-1 jobs, phase-2 step records, and writing the results."""

    def __init__(self, args: argparse.Namespace, argv: Sequence[str]) -> None:
        self.args = args
        self.t0 = time.time()
        self.deadline = self.t0 + args.budget_s
        self.command = "python benchmarks/peers.py " + shlex.join(argv)
        self.out = Path(args.out)
        self.logs = Path(args.logs) if args.logs else self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        if args.cache:
            Path(args.cache).mkdir(parents=True, exist_ok=True)
        self.cache = Path(tempfile.mkdtemp(prefix="peers-cache-", dir=args.cache))  # fresh: cold means cold
        self.cpus = sorted(os.sched_getaffinity(0))
        self.lanes = args.jobs or max(1, min(5, len(self.cpus) // 3))
        self.cores_per_job = max(1, len(self.cpus) // self.lanes)
        self.small = {m: min(b for mm, b in args.regimes if mm == m) for m, _ in args.regimes}
        self.jobs: list[Job] = []
        self.steps: dict[tuple[str, int, str], dict[str, Any]] = {}
        self.loss: dict[str, Any] | None = None
        self.slug = _device_slug()
        name = self.slug + (f"-{args.tag}" if args.tag else "")
        self.path = self.out / f"{name}.json"
        for n in range(2, 100):  # never overwrite an earlier run's results
            if not self.path.exists():
                break
            self.path = self.out / f"{name}-{n}.json"

    # -------------------------------------------------------------------------------------------- phase 1 plan
    def common_argv(self) -> list[str]:
        argv = ["--backend", self.args.backend, "--precision", self.args.precision]
        return argv + (["--tiny"] if self.args.tiny else [])

    def plan_jobs(self) -> None:
        regimes, variants = self.args.regimes, self.args.variants
        compiling = [v for v in variants if v not in NOT_COMPILING]
        for model, batch in dict.fromkeys(regimes):
            for variant in compiling:
                est = _EST_COLD_S[variant] + (_EST_RESNET_EXTRA_S.get(variant, 0) if model == "resnet" else 0)
                tier = 3 if variant == "fuse_full_autotune_graph" else 2 if variant in EXTRA else 0
                argv = ["setup", "--model", model, "--batch", str(batch), "--variant", variant, "--cache",
                        str(self.cache), "--steps", str(self.args.setup_steps), *self.common_argv()]  # fmt: skip
                if variant in SETUP_VARIANTS and batch == self.small[model]:
                    cold = Job("cold", model, batch, variant, argv, (tier, 1, -est, -batch))
                    warm = Job("warm", model, batch, variant, argv, (tier, 0, 0, 0), after=cold)
                    self.jobs += [cold, warm]
                else:  # longest first; large batch first (where autotuning can pay)
                    self.jobs.append(Job("prewarm", model, batch, variant, argv, (tier, 1, -est, -batch)))
        if self.args.loss:
            # It reuses the gpt fuse cache, so it must run after that cache's cold and warm measurements.
            after = next((j for j in self.jobs if j.kind == "warm" and j.model == "gpt" and j.variant == "fuse"), None)
            argv = ["loss", "--model", "gpt", "--batch", str(after.batch if after else 8),
                    "--steps", str(self.args.loss_steps), "--cache", str(self.cache), *self.common_argv()]  # fmt: skip
            self.jobs.append(Job("loss", "gpt", after.batch if after else 8, "fuse", argv, (1, 0, 0, 0), after=after))
        self.jobs.sort(key=lambda j: j.priority)

    def phase2_estimate_s(self) -> float:
        """Seconds phase 2 needs: a process per regime, then per variant a trainer, a warm compile and the steps."""
        n_steps = self.args.warmup + self.args.steps
        per_variant = sum(2.0 if v in NOT_COMPILING else 5.0 for v in self.args.variants)
        if self.args.tiny:
            return len(self.args.regimes) * (10 + per_variant / 2)
        return len(self.args.regimes) * (10 + per_variant + len(self.args.variants) * n_steps * 0.012)

    # -------------------------------------------------------------------------------------------- phase 1 run
    def run_phase1(self) -> None:
        reserve = self.phase2_estimate_s() + 5
        deadline = self.deadline - reserve
        log(f"phase 1: {len(self.jobs)} setup jobs, {self.lanes} at a time on {self.cores_per_job} CPU cores each, "
            f"until +{deadline - self.t0:.0f}s ({reserve:.0f}s kept for step timing)")  # fmt: skip
        free = list(self.cpus)
        running: list[Job] = []
        while True:
            for job in list(running):
                if job.proc.poll() is not None:
                    self._finish(job)
                    running.remove(job)
                    free += job.cpus
            if time.time() >= deadline:
                for job in running:
                    self._kill(job, "killed: time budget exhausted")
                    free += job.cpus
                for job in self.jobs:
                    if job.status == "pending":
                        job.status, job.error = "skipped", "skipped: time budget exhausted"
                break
            for job in self.jobs:
                if job.status != "pending":
                    continue
                # a warm job needs its cold job's compile; the learning check only waits for its cache to be free
                if job.after is not None and job.after.status in ("failed", "skipped") and job.kind == "warm":
                    job.status, job.error = "skipped", f"skipped: {job.after.name} {job.after.status}"
                    continue
                if job.after is not None and job.after.status in ("pending", "running"):
                    continue
                if len(free) < self.cores_per_job:
                    break
                job.cpus, free = free[: self.cores_per_job], free[self.cores_per_job :]
                self._start(job)
                running.append(job)
            if not running and not any(j.status == "pending" for j in self.jobs):
                break
            time.sleep(0.2)

    def _start(self, job: Job) -> None:
        job.out_path = self.logs / f"{job.name}.jsonl"
        env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=str(len(job.cpus)), OMP_NUM_THREADS=str(len(job.cpus)))
        argv = [sys.executable, str(Path(__file__).resolve()), *job.argv, "--cpus", ",".join(map(str, job.cpus))]
        with open(job.out_path, "w") as out, open(self.logs / f"{job.name}.log", "w") as err:
            job.proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, start_new_session=True, cwd=HERE.parent)
        job.status, job.started = "running", time.time()

    def _finish(self, job: Job) -> None:
        job.wall_s = round(time.time() - job.started, 2)
        _kill_group(job.proc, quiet=True)  # anything left in its process group (compile workers)
        records = _read_records(job.out_path)
        job.result = records[-1] if records else None
        code = job.proc.returncode
        if job.result is None:
            job.status, job.error = "failed", f"exit code {code}: {_log_tail(self.logs / f'{job.name}.log')}"
        else:
            job.status = "done" if not job.result.get("error") else "failed"
            job.error = job.result.get("error")
        if job.kind == "loss" and job.result is not None:
            self.loss = job.result
        took = job.result.get("setup_s") if job.result else None
        log(f"{job.name}: {job.status} in {job.wall_s:.0f}s" + (f", setup {took:.1f}s" if took else "")
            + (f" ({job.error})" if job.error else ""))  # fmt: skip
        self.write()

    def _kill(self, job: Job, reason: str) -> None:
        _kill_group(job.proc)
        job.wall_s = round(time.time() - job.started, 2)
        job.status, job.error = "skipped", reason
        log(f"{job.name}: {reason} after {job.wall_s:.0f}s")

    # -------------------------------------------------------------------------------------------- phase 2
    def run_phase2(self) -> None:
        regimes = list(dict.fromkeys(self.args.regimes))
        for index, (model, batch) in enumerate(regimes):
            runnable = []
            for variant in self.args.variants:
                reason = self._not_ready(model, batch, variant)
                if reason:
                    self.steps[(model, batch, variant)] = {"error": reason}
                else:
                    runnable.append(variant)
            share = (self.deadline - 5 - time.time()) / (len(regimes) - index)
            regime_deadline = time.time() + share
            attempts = 0
            while runnable and attempts < 3 and time.time() < regime_deadline - 5:
                attempts += 1
                runnable = self._steps_process(model, batch, runnable, regime_deadline)
            for variant in runnable:
                self.steps.setdefault((model, batch, variant), {"error": "skipped: time budget exhausted"})
            self.write()

    def _not_ready(self, model: str, batch: int, variant: str) -> str | None:
        """Why a compiling variant is not timed: its cache was not warmed in phase 1 (or that failed)."""
        if variant in NOT_COMPILING:
            return None
        job = next((j for j in self.jobs if j.model == model and j.batch == batch and j.variant == variant
                    and j.kind in ("warm", "prewarm")), None)  # fmt: skip
        if job is None or job.ok:
            return None
        cold = job.after if job.kind == "warm" else None
        if cold is not None and cold.ok:
            return None  # the cold job compiled it: the cache is warm
        source = cold if cold is not None else job
        return f"not timed: its setup job {source.status} ({source.error})"

    def _steps_process(self, model: str, batch: int, variants: list[str], deadline: float) -> list[str]:
        """Run one `steps` process; return the variants it did not get to (to retry after a crash)."""
        tag = f"steps-{model}-{batch}-{len(list(self.logs.glob(f'steps-{model}-{batch}*.log')))}"
        out_path, log_path = self.logs / f"{tag}.jsonl", self.logs / f"{tag}.log"
        argv = [sys.executable, str(Path(__file__).resolve()), "steps", "--model", model, "--batch", str(batch),
                "--variants", ",".join(variants), "--cache", str(self.cache), "--steps", str(self.args.steps),
                "--warmup", str(self.args.warmup), "--deadline", f"{deadline:.1f}", *self.common_argv()]  # fmt: skip
        log(f"phase 2: {model} bs {batch}: timing {', '.join(variants)} (until +{deadline - self.t0:.0f}s)")
        with open(out_path, "w") as out, open(log_path, "w") as err:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, start_new_session=True, cwd=HERE.parent)
        killed = False
        try:  # grace: the variant in flight may finish, within the run's hard limit
            proc.wait(timeout=max(1.0, min(deadline + 20, self.deadline) - time.time()))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            killed = True
        _kill_group(proc, quiet=True)  # anything left in its process group (compile workers)
        started = None
        for line in _read_lines(out_path):
            if line.get("event") == "start":
                started = line["variant"]
            elif line.get("event") == "record":
                self.steps[(model, batch, line["variant"])] = line
                started = None
                if line.get("step_ms"):
                    log(f"  {model} bs {batch} {line['variant']}: {line['step_ms']:.2f} ms/step"
                        + (f" ({line['error']})" if line.get("error") else ""))  # fmt: skip
                elif line.get("error"):
                    log(f"  {model} bs {batch} {line['variant']}: {line['error']}")
        if started is not None:  # it died or was killed inside this variant
            why = "killed: time budget exhausted" if killed else (
                f"process died (exit code {proc.returncode}): {_log_tail(log_path)}")  # fmt: skip
            self.steps[(model, batch, started)] = {"error": why}
            log(f"  {model} bs {batch} {started}: {why}")
        return [v for v in variants if (model, batch, v) not in self.steps]

    # -------------------------------------------------------------------------------------------- results
    def records(self) -> list[dict[str, Any]]:
        meta = {
            "command": self.command, "run_started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.t0)),
            "run_elapsed_s": round(time.time() - self.t0, 1), "budget_s": self.args.budget_s,
            "setup_jobs_concurrent": self.lanes, "setup_job_cores": self.cores_per_job,
            "machine_cpus": len(self.cpus), "precision": self.args.precision, "backend": self.args.backend,
            "tiny": self.args.tiny,
        }  # fmt: skip
        env_keys = ("device", "torch", "lightning", "triton", "cuda", "python")
        env = next((r for r in [*self.steps.values(), *(j.result or {} for j in self.jobs)] if r.get("device")), {})
        out = []
        for model, batch in dict.fromkeys(self.args.regimes):
            for variant in self.args.variants:
                step = self.steps.get((model, batch, variant))
                rec = {"kind": "step", "model": model, "batch_size": batch, "variant": variant,
                       **{k: env.get(k) for k in env_keys}, **meta}  # fmt: skip
                keep = ("step_ms", "step_ms_p10", "step_ms_p90", "iter_ms", "timed_steps", "warmup_steps", "timing",
                        "first_step_s", "peak_mem_gb", "gpu_util", "gpu_util_max", "sm_active", "tensor_active",
                        "fuse", "dynamo", "warnings", "measure_command", "error")  # fmt: skip
                rec.update({k: None for k in keep})
                if step is None:
                    rec["error"] = "not run yet"
                else:
                    rec.update({k: step.get(k) for k in keep})
                rec.update(self._setup_fields(model, batch, variant))
                rec["cache_state"] = self._cache_state(model, batch, variant)
                out.append(rec)
        loss_job = next((j for j in self.jobs if j.kind == "loss"), None)
        if self.loss is not None:
            loss = {k: v for k, v in self.loss.items() if k != "event"}
            out.append({**loss, **meta, "kind": "loss", "variant": "loss_check"})
        elif loss_job is not None and loss_job.status not in ("pending", "running"):
            out.append({"kind": "loss", "variant": "loss_check", "model": loss_job.model,
                        "batch_size": loss_job.batch, "agree": None, "error": loss_job.error, **meta})  # fmt: skip
        return out

    def _job(self, kind: str, model: str, batch: int, variant: str) -> Job | None:
        return next((j for j in self.jobs if (j.kind, j.model, j.batch, j.variant) == (kind, model, batch, variant)),
                    None)  # fmt: skip

    def _setup_fields(self, model: str, batch: int, variant: str) -> dict[str, Any]:
        fields: dict[str, Any] = {"setup_s_cold": None, "setup_s_warm": None, "ready_s_cold": None,
                                  "ready_s_warm": None, "setup_at_batch": None, "setup_s_cold_here": None,
                                  "setup_error": None}  # fmt: skip
        if variant in NOT_COMPILING:
            fields["setup_error"] = "no compile (see first_step_s)"
            return fields
        small = self.small[model]
        cold, warm = self._job("cold", model, small, variant), self._job("warm", model, small, variant)
        own = self._job("cold", model, batch, variant) or self._job("prewarm", model, batch, variant)
        if cold is None and own is not None:  # extras: a cold measurement in this regime, no warm one
            cold, small = own, batch
        if cold is not None:
            fields["setup_at_batch"] = small
            if cold.ok:
                fields.update(setup_s_cold=cold.result.get("setup_s"), ready_s_cold=cold.result.get("ready_s"))
            else:
                fields["setup_error"] = f"cold: {cold.error or cold.status}"
        if warm is not None and warm.ok:
            fields.update(setup_s_warm=warm.result.get("setup_s"), ready_s_warm=warm.result.get("ready_s"))
        elif warm is not None and warm.status != "pending":
            fields["setup_error"] = (fields["setup_error"] or "") + f" warm: {warm.error or warm.status}"
        if own is not None and own.ok:
            fields["setup_s_cold_here"] = own.result.get("setup_s")
        return fields

    def _cache_state(self, model: str, batch: int, variant: str) -> str:
        if variant in NOT_COMPILING:
            return "no compile"
        job = self._job("warm", model, batch, variant) or self._job("prewarm", model, batch, variant)
        if job is not None and (job.ok or (job.after is not None and job.after.ok)):
            return f"warm: compiled into the same cache by {job.name if job.ok else job.after.name} in phase 1"
        return "cold: no phase-1 compile finished"

    def write(self) -> None:
        self._rename_for_device()
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.records(), indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


    def _rename_for_device(self) -> None:
        """Name the file after torch's device name once a child has reported it (nvidia-smi may be missing)."""
        device = next((r.get("device") for r in [*self.steps.values(), *(j.result or {} for j in self.jobs)]
                       if r.get("device")), None)  # fmt: skip
        slug = re.sub(r"[^a-z0-9]+", "-", (device or "").lower()).strip("-")
        if not device or device.startswith("cpu") and self.slug == "cpu" or slug == self.slug:
            return
        path = self.out / (slug + (f"-{self.args.tag}" if self.args.tag else "") + ".json")
        if path.exists():
            return
        if self.path.exists():
            os.replace(self.path, path)
        self.path, self.slug = path, slug

    def describe_plan(self) -> str:
        lines = [f"{len(self.jobs)} phase-1 jobs ({self.lanes} at a time, {self.cores_per_job} cores each), "
                 f"phase 2 estimated at {self.phase2_estimate_s():.0f}s of the {self.args.budget_s:.0f}s budget:"]
        for job in self.jobs:
            after = f" (after {job.after.name})" if job.after else ""
            lines.append(f"  {job.name}{after}: python benchmarks/peers.py {shlex.join(job.argv)}")
        for model, batch in dict.fromkeys(self.args.regimes):
            lines.append(f"  steps-{model}-{batch}: {', '.join(self.args.variants)}")
        return "\n".join(lines)


def cmd_run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    run = Run(args, argv)
    run.plan_jobs()
    if args.plan_only:
        print(run.describe_plan())
        shutil.rmtree(run.cache, ignore_errors=True)
        return 0
    log(f"writing {run.path}; caches in {run.cache}; budget {args.budget_s:.0f}s")
    try:
        run.run_phase1()
        run.run_phase2()
    finally:
        run.write()
        if not args.keep_cache:
            shutil.rmtree(run.cache, ignore_errors=True)
    records = json.loads(run.path.read_text())
    print(short_table(records))
    print()
    for line in target_lines(records):
        print(line)
    print(f"\nFull results: {run.path} (elapsed {time.time() - run.t0:.0f}s of a {args.budget_s:.0f}s budget)")
    return 0


def _device_slug() -> str:
    """The GPU's name as nvidia-smi gives it (torch's name is the same), made file-safe; "cpu" without a GPU."""
    name = "cpu"
    if shutil.which("nvidia-smi"):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        select = ["-i", visible] if visible.isdigit() else []
        try:
            found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", *select],
                                   capture_output=True, text=True, timeout=20).stdout.strip().splitlines()  # fmt: skip
            name = found[0] if found else name
        except (OSError, subprocess.SubprocessError):
            pass
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def _kill_group(proc: subprocess.Popen, quiet: bool = False) -> None:
    """Stop a child we started and its own process group (inductor's compile workers).

    ``quiet``: the child has exited; only send SIGKILL to whatever is left in its group.
    """
    if quiet:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _read_lines(path: Path | None) -> list[dict[str, Any]]:
    if path is None or not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _read_records(path: Path | None) -> list[dict[str, Any]]:
    return [line for line in _read_lines(path) if line.get("event") == "record"]


def _log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(line.strip()[:200] for line in text[-lines:]) or "(empty log)"


# ================================================================================================ report
def cmd_report(files: Iterable[str], stream: TextIO) -> int:
    sections = []
    for name in files:
        try:
            records = json.loads(Path(name).read_text())
        except (OSError, json.JSONDecodeError) as err:
            print(f"peers.py report: cannot read {name}: {err}", file=sys.stderr)
            return 2
        sections.append(render_markdown(records, Path(name).name))
    stream.write("\n\n".join(sections) + "\n")
    return 0


def _fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _regimes_of(records: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return list(dict.fromkeys((r["model"], r["batch_size"]) for r in records if r.get("kind", "step") == "step"))


def _by_variant(records: list[dict[str, Any]], model: str, batch: int) -> dict[str, dict[str, Any]]:
    return {r["variant"]: r for r in records
            if r.get("kind", "step") == "step" and r["model"] == model and r["batch_size"] == batch}  # fmt: skip


def _ok_ms(rec: dict[str, Any] | None) -> float | None:
    return rec.get("step_ms") if rec and not rec.get("error") else None


def _best_alternative(rows: dict[str, dict[str, Any]]) -> tuple[str | None, float | None]:
    timed = [(rows[v]["step_ms"], v) for v in ALTERNATIVES if v in rows and _ok_ms(rows[v])]
    if not timed:
        return None, None
    ms, name = min(timed)
    return name, ms


def regime_targets(records: list[dict[str, Any]], model: str, batch: int) -> list[tuple[str, str]]:
    """``(verdict, text)`` for each target of the issue in one regime: PASS, FAIL or MISSING."""
    rows = _by_variant(records, model, batch)
    small = batch <= SMALL_BATCH_SIZES.get(model, min(b for m, b in _regimes_of(records) if m == model))
    fuse, eager = rows.get("fuse"), rows.get("eager")
    fuse_ms, eager_ms = _ok_ms(fuse), _ok_ms(eager)
    best_name, best_ms = _best_alternative(rows)
    out: list[tuple[str, str]] = []
    verdict = _verdict
    ratio = SMALL_BATCH_RATIO if small else LARGE_BATCH_RATIO
    ok = None if fuse_ms is None or best_ms is None else fuse_ms <= ratio * best_ms
    detail = (f"{fuse_ms:.2f} ms vs {ratio:.2f} x {best_name} {best_ms:.2f} ms = {ratio * best_ms:.2f} ms "
              f"({fuse_ms / best_ms:.2f}x)" if ok is not None else _why_missing(fuse, "fuse"))  # fmt: skip
    out.append((verdict(ok), f"fuse step <= {ratio:.2f}x best alternative ({'small' if small else 'large'} batch): "
                             f"{detail}"))  # fmt: skip
    ok = None if fuse_ms is None or eager_ms is None else fuse_ms <= eager_ms
    detail = f"{fuse_ms:.2f} vs {eager_ms:.2f} ms" if ok is not None else _why_missing(fuse if not fuse_ms else eager)
    out.append((verdict(ok), f"fuse never slower than eager: {detail}"))
    compile_rec = rows.get("compile")
    cold, compile_cold = (fuse or {}).get("setup_s_cold"), (compile_rec or {}).get("setup_s_cold")
    at = (fuse or {}).get("setup_at_batch")
    if at is not None and at != batch:  # setup was measured (and is judged) at another batch of this model
        cold = compile_cold = None
        out.append(("", f"setup targets: measured at bs {at}, see there"))
        return out + _callback_target(rows, eager_ms)
    ok = None if cold is None or compile_cold is None else cold <= COLD_SETUP_RATIO * compile_cold
    detail = (f"{cold:.1f} s vs {COLD_SETUP_RATIO} x {compile_cold:.1f} s = {COLD_SETUP_RATIO * compile_cold:.1f} s"
              if ok is not None else "no cold setup of fuse and compile")  # fmt: skip
    out.append((verdict(ok), f"fuse cold setup <= {COLD_SETUP_RATIO}x compile cold setup (bs {at}): {detail}"))
    warm = (fuse or {}).get("setup_s_warm")
    ok = None if cold is None or warm is None else warm <= WARM_SETUP_RATIO * cold
    detail = (f"{warm:.1f} s vs {WARM_SETUP_RATIO} x {cold:.1f} s = {WARM_SETUP_RATIO * cold:.1f} s"
              if ok is not None else "no cold/warm setup of fuse")  # fmt: skip
    out.append((verdict(ok), f"fuse warm setup <= {WARM_SETUP_RATIO}x its cold setup (bs {at}): {detail}"))
    return out + _callback_target(rows, eager_ms)


def _verdict(ok: bool | None) -> str:
    return "MISSING" if ok is None else "PASS" if ok else "FAIL"


def _callback_target(rows: dict[str, dict[str, Any]], eager_ms: float | None) -> list[tuple[str, str]]:
    """eager_callback (FuseCallback with nothing to compile or graph) costs at most 1% of an eager step."""
    if "eager_callback" not in rows:
        return []
    callback_ms = _ok_ms(rows["eager_callback"])
    ok = None if callback_ms is None or eager_ms is None else callback_ms <= (1 + CALLBACK_OVERHEAD) * eager_ms
    detail = (f"{callback_ms:.2f} vs {eager_ms:.2f} ms ({100 * (callback_ms / eager_ms - 1):+.1f}%)"
              if ok is not None else _why_missing(rows["eager_callback"], "eager_callback"))  # fmt: skip
    return [(_verdict(ok), f"callback overhead on eager <= {100 * CALLBACK_OVERHEAD:.0f}%: {detail}")]


def _why_missing(rec: dict[str, Any] | None, name: str = "") -> str:
    if rec is None:
        return f"{name or 'variant'} not in this run"
    return f"{rec.get('variant', name)}: {rec.get('error') or 'no step time'}"


def target_lines(records: list[dict[str, Any]]) -> list[str]:
    lines = []
    for model, batch in _regimes_of(records):
        rows = _by_variant(records, model, batch)
        if "fuse" not in rows:
            continue
        for verdict, text in regime_targets(records, model, batch):
            if verdict:
                lines.append(f"{verdict:7s} {model} bs {batch}: {text}")
    for rec in records:
        if rec.get("kind") == "loss":
            lines.append(_loss_line(rec))
    return lines


def _loss_line(rec: dict[str, Any]) -> str:
    if rec.get("agree") is None:
        return f"MISSING learning check: {rec.get('error')}"
    verdict = "PASS" if rec["agree"] else "FAIL"
    return (f"{verdict:7s} learning check ({rec['model']} bs {rec['batch_size']}, {rec['steps']} steps): final loss "
            f"(mean of last {rec['window']}) eager {rec['eager_loss']:.4f}, fuse {rec['fuse_loss']:.4f}, relative "
            f"difference {100 * rec['rel_diff']:.2f}% (< {100 * rec['tolerance']:.0f}%); first losses "
            f"{_fmt(rec.get('eager_first_loss'), 3)} / {_fmt(rec.get('fuse_first_loss'), 3)}")  # fmt: skip


def _note(rec: dict[str, Any]) -> str:
    notes = []
    if rec.get("error"):
        notes.append(str(rec["error"])[:140])
    fuse = rec.get("fuse") or {}
    if fuse:
        if fuse.get("fallbacks"):
            notes.append(f"{len(fuse['fallbacks'])} region(s) fell back to eager")
        if fuse.get("graph_disabled"):
            notes.append(f"no CUDA graph: {str(fuse['graph_disabled'])[:80]}")
        elif "CUDA graph: on" in (fuse.get("plan") or "") and not fuse.get("graph_captured"):
            notes.append("CUDA graph not captured")
    dynamo = rec.get("dynamo") or {}
    if dynamo.get("graph_breaks"):
        notes.append(f"{dynamo['graph_breaks']} graph break(s)")
    return "; ".join(notes).replace("|", "/")


def render_markdown(records: list[dict[str, Any]], source: str = "") -> str:
    """One markdown section per result file: a table per regime, the targets, the learning check."""
    steps = [r for r in records if r.get("kind", "step") == "step"]
    first = next((r for r in steps if r.get("device")), steps[0] if steps else {})
    lines = [f"## {first.get('device', 'unknown device')}" + (f" (`{source}`)" if source else ""), ""]
    warmup = next((r.get("warmup_steps") for r in steps if r.get("warmup_steps") is not None), "?")
    timed = max((r.get("timed_steps") or 0 for r in steps), default=0)
    timing = next((r.get("timing") for r in steps if r.get("timing")), "?")
    lines += [
        f"torch {first.get('torch')}, lightning {first.get('lightning')}, triton {first.get('triton')}, "
        f"CUDA {first.get('cuda') or '- (CPU run)'}, Python {first.get('python')}. Inside the Lightning Trainer, "
        f"`precision=\"{first.get('precision', 'bf16-mixed')}\"`, TF32 on, "
        f"backend `{first.get('backend', 'inductor')}`, "
        "random data already on the device.",
        "",
        f"- **step ms**: median over {timed} steps after {warmup} warmup steps, `{timing}` at "
        "`on_train_batch_start`/`on_train_batch_end` (forward, backward, optimizer and LR scheduler step); "
        "**iter ms**: start to next start (the whole loop iteration). All variants of a regime ran in one "
        "process, after their compile caches were filled in phase 1 (warm).",
        f"- **setup s**: from the variant's `compile()` call (FuseCallback: `trainer.fit`) to the end of the first "
        f"step (synchronised), in a fresh process; "
        f"cold = empty inductor/Triton/FuseCallback caches, warm = the same caches again. Measured at the small "
        f"batch of each model ({first.get('setup_jobs_concurrent', '?')} such processes at a time, "
        f"{first.get('setup_job_cores', '?')} CPU cores each); a dagger marks a value measured at another batch.",
        f"- Command: `{first.get('command', '?')}`",
        "",
    ]
    verdicts: list[str] = []
    for model, batch in _regimes_of(records):
        rows = _by_variant(records, model, batch)
        eager_ms = _ok_ms(rows.get("eager"))
        best_name, best_ms = _best_alternative(rows)
        tiny = " (tiny sizes, smoke test)" if any(r.get("tiny") for r in rows.values()) else ""
        lines += [f"### {MODEL_NAMES.get(model, model)}{tiny}, batch {batch}", ""]
        lines += ["| variant | step ms | iter ms | vs eager | vs best alt | setup cold s | setup warm s | peak GB "
                  "| GPU util % | notes |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for variant in sorted(rows, key=lambda v: VARIANTS.index(v) if v in VARIANTS else len(VARIANTS)):
            rec = rows[variant]
            ms = _ok_ms(rec)
            dagger = "†" if rec.get("setup_at_batch") not in (None, batch) else ""
            name = f"**{variant}**" if variant == "fuse" else variant
            name += " (best alt)" if variant == best_name else ""
            lines.append(
                f"| {name} | {_fmt(ms)} | {_fmt(rec.get('iter_ms') if ms else None)} "
                f"| {_fmt(eager_ms / ms if ms and eager_ms else None, 2, 'x')} "
                f"| {_fmt(ms / best_ms if ms and best_ms else None, 2, 'x')} "
                f"| {_fmt(rec.get('setup_s_cold'), 1)}{dagger if rec.get('setup_s_cold') else ''} "
                f"| {_fmt(rec.get('setup_s_warm'), 1)}{dagger if rec.get('setup_s_warm') else ''} "
                f"| {_fmt(rec.get('peak_mem_gb'), 2)} | {_fmt(rec.get('gpu_util'), 0)} | {_note(rec)} |"
            )
        lines.append("")
        if "fuse" in rows:
            for verdict, text in regime_targets(records, model, batch):
                verdicts.append(verdict)
                lines.append(f"- **{verdict}** {text}" if verdict else f"- {text}")
            lines.append("")
    for rec in records:
        if rec.get("kind") == "loss":
            line = _loss_line(rec)
            verdicts.append(line.split()[0])
            lines += ["### Learning check", "", f"- **{line.split()[0]}** {line.split(None, 1)[1]}",
                      f"- data: {rec.get('data')}", ""]  # fmt: skip
    counts = {v: verdicts.count(v) for v in ("PASS", "FAIL", "MISSING") if verdicts.count(v)}
    lines.insert(2, "Targets: " + (", ".join(f"{n} {v}" for v, n in counts.items()) or "none evaluated") + "\n")
    return "\n".join(lines).rstrip() + "\n"


def short_table(records: list[dict[str, Any]]) -> str:
    """A compact text table for the end of `run`."""
    head = f"{'regime':14s} {'variant':26s} {'step ms':>8s} {'xeager':>7s} {'xbest':>6s} {'cold s':>7s} " \
           f"{'warm s':>7s} {'mem GB':>7s} {'util%':>5s}  notes"  # fmt: skip
    lines = [head, "-" * len(head)]
    for model, batch in _regimes_of(records):
        rows = _by_variant(records, model, batch)
        eager_ms = _ok_ms(rows.get("eager"))
        _, best_ms = _best_alternative(rows)
        for variant, rec in rows.items():
            ms = _ok_ms(rec)
            x_eager, x_best = eager_ms / ms if ms and eager_ms else None, ms / best_ms if ms and best_ms else None
            lines.append(
                f"{model + ' bs ' + str(batch):14s} {variant:26s} {_fmt(ms):>8s} {_fmt(x_eager):>7s} "
                f"{_fmt(x_best):>6s} "
                f"{_fmt(rec.get('setup_s_cold'), 1):>7s} {_fmt(rec.get('setup_s_warm'), 1):>7s} "
                f"{_fmt(rec.get('peak_mem_gb')):>7s} {_fmt(rec.get('gpu_util'), 0):>5s}  {_note(rec)[:70]}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("setup", "steps", "loss"):
        # Results go to the real stdout; anything else printed in this process (inductor's autotune tables, say)
        # goes to stderr, so that the parent can read stdout as JSON lines.
        results_stream = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        code = main(results=results_stream)
        results_stream.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: inductor's worker pools can take seconds to shut down
    sys.exit(main())
