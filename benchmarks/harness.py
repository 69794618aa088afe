"""The one harness of the benchmarks: each variant in its own process, one step clock, JSON lines, Markdown tables.

A script turns its CLI into jobs; a :class:`Runner` launches each job as ``python <script> --child '<spec>'``
within the time budget (what does not fit is recorded as skipped, a process that runs past it prints its stacks
and is killed), and appends one JSON object a line to the results file, with ``device``, ``torch``,
``run_started`` and ``command``; ``--logs`` keeps each child's output, written as it runs.
In the child, :func:`serve` runs the script's ``measure(spec)``, which trains with :func:`fit`: a Lightning fit
timed by :class:`StepClock`, whose exception becomes the record's ``error`` (a crash never stops the run).

Render results as a Markdown table (each key's newest run counts; the median of its repeats):

    python benchmarks/harness.py table benchmarks/results/zoo.jsonl > benchmarks/results/zoo.md
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import resource
import shlex
import signal
import site
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lightning_fuse.timing import SKIPPED, StepTimer  # noqa: E402

RECORD = "@record "
"""Prefix of the child's result line on stdout (libraries print there too)."""
KEYS = ("model", "source", "pattern", "strategy", "world_size", "batch_size", "epoch_steps", "optimizer", "seed",
        "data", "scheduler", "variant")
"""Fields that name what a record measured; the table keeps the newest record of each combination."""
ENV = ("device", "machine", "torch", "run_started", "command", "commit", "bytecode")
LIST_CELL = 8
"""A table shows a list of more values than this (a fit's step times) by its length: the records hold them."""
STACKS_AT = "HARNESS_STACKS_AT"
"""A child still running at this time (``time.time()``) prints its threads' stacks (:func:`serve`): the budget's
kill comes :data:`STACKS_GRACE_S` later."""
STACKS_GRACE_S = 3.0
BUDGET_SKIP = "skipped:"
"""How the ``error`` of a job the budget left out begins (:meth:`Runner.launch`): no crash (:func:`crashed`)."""
LOSS_WINDOW = 10
"""``final_loss`` is the mean loss of the fit's last this many steps."""
WITHIN_RATIO = 2.0
"""Held to full precision, a variant may lie up to this many times as far from it as eager does: another correct
rounding, not a defect (``gradients.py``'s steps, ``multi_gpu.py``'s loss curves)."""
BF16_RTOL = 0.016
"""The least relative gap that counts as beyond bf16's tolerance: ``torch.testing.assert_close``'s default
``rtol`` for ``bfloat16``. Where two references agree more closely than that, a tolerance taken from their gap
alone would call a rounding difference a defect (``multi_gpu.py``'s loss curves)."""


def environment() -> dict[str, str]:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "machine": machine(), "torch": torch.__version__,
            "run_started": datetime.now().isoformat(timespec="seconds"), "command": shlex.join(["python", *sys.argv]),
            "commit": _commit()}  # fmt: skip


def machine() -> str | None:
    """The host this process runs on: its kernel's boot id, the same for every process and container on it until it
    restarts (``None`` where the kernel does not say). Rows of one machine compare side by side; rows of two differ
    by the hosts' speeds as well: on two H200 machines, minutes apart, DeBERTa's eager fit ran 92.7 and 61.3 ms a
    step (``results/patterns-h200.jsonl``)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8] or None
    except OSError:
        return None


def other_machines(row: dict, other: dict) -> bool:
    """Whether two rows ran on machines known to differ (:func:`machine`; rows from before it was recorded are not).

    Example::

        >>> rows = ({"machine": "a1"}, {"machine": "b2"}), ({"machine": "a1"}, {}), ({}, {})
        >>> [other_machines(*pair) for pair in rows]
        [True, False, False]
    """
    return None not in (row.get("machine"), other.get("machine")) and row["machine"] != other["machine"]


def _commit() -> str | None:
    """The checkout's commit, with ``+dirty`` where files differ from it (``None`` outside a git checkout), or
    ``$BENCH_COMMIT`` where set: a machine handed a copy of the tree may have a ``.git`` whose HEAD is not it."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def describe(err: BaseException) -> str:
    """The first line of an exception, with its type: what a record's ``error`` says."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def parser(doc: str, out: str, *, models: str | None = None, batches: str | None = None, variants: Sequence[str] = (),
           steps: int | None = None, warmup: int | None = None) -> argparse.ArgumentParser:
    """The options every script shares, and those it names a default for; the script adds its own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / out, help="JSON lines to append")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip what does not fit in this many seconds")
    p.add_argument("--repeats", type=int, default=1, help="run every job again, in reverse order on odd repeats")
    p.add_argument("--smoke", action="store_true", help="tiny models, a few steps, CPU: the code path only")
    p.add_argument("--logs", type=Path, help="keep each child process's output in this folder")
    p.add_argument("--child", help=argparse.SUPPRESS)
    if models:
        p.add_argument("--models", default=models, help="a comma list (models.py lists them)")
    if batches:
        p.add_argument("--batches", default=batches, help="small, large or numbers, a comma list")
    if variants:
        p.add_argument("--variants", default="all",
                       help=f"a comma list of {', '.join(variants)}, or all; they run in this order")
    if steps:
        p.add_argument("--steps", type=int, default=steps, help="training steps (optimizer steps)")
    if warmup:
        p.add_argument("--warmup", type=int, default=warmup, help="untimed first steps")
    return p


def run(args: argparse.Namespace, script: str, measure: Callable[[dict], dict], fields: Sequence[str],
        groups: Iterable[Sequence[dict]], launch: Callable[[Runner, dict, dict], dict] | None = None) -> int:
    """A script's main once parsed: the child's side (``--child``), or every job, each with a fresh compile cache.

    ``launch(runner, spec, env)`` replaces the single ``Runner.launch`` of a job (the zoo's cold and warm pair),
    which otherwise weighs the budget by the job's ``variant`` (an eager fit, which compiles nothing, is not skipped
    for the time a compiled one took).
    """
    if args.child:
        return serve(measure, args.child)
    runner = Runner(args.out, fields, args.budget_s, args.logs)
    bytecode = {} if args.smoke else bytecode_env()
    if bytecode:
        runner.env["bytecode"] = f"compiled ahead into {bytecode['PYTHONPYCACHEPREFIX']}"
    launch = launch or (lambda runner, spec, env: runner.launch(script, spec, env, kind=spec.get("variant", "")))
    for spec in schedule(groups, args.repeats):
        with cache_env() as (env, cache):
            runner.write({**spec, **launch(runner, {**spec, "cache_dir": cache}, {**env, **bytecode})})
    return 0


def bytecode_env(prefix: Path = Path(tempfile.gettempdir()) / "bench-pycache") -> dict[str, str]:
    """Where this machine writes no bytecode (``PYTHONDONTWRITEBYTECODE``: the lent GPU machines set it, and their
    packages ship no ``.pyc``), the children's environment for bytecode compiled once, ahead of them, into a prefix
    folder (``PYTHONPYCACHEPREFIX``); ``{}`` where bytecode is written as usual.

    Without it every child compiles the Python it imports from source, as no ``pip install`` leaves a user's
    machine, and a compiling variant imports much more of torch than eager does: on an H200, Lightning's training
    began 1.9-2.3 s after a warm MobileNet fit's compile call with it and 3.5-3.9 s without (the RESULTS' fifty-third
    session). The checkout itself is left out.
    """
    if not os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return {}
    env = {"PYTHONPYCACHEPREFIX": str(prefix), "PYTHONDONTWRITEBYTECODE": ""}
    paths = {Path(p).resolve() for p in [*site.getsitepackages(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
             if p}  # fmt: skip
    packages = sorted(str(p) for p in paths if p.is_dir() and p != ROOT and ROOT not in p.parents)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *packages], env={**os.environ, **env},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)  # fmt: skip
    return env


def split(text: str, allowed: Sequence[str]) -> list[str]:
    """A comma list checked against ``allowed`` (``all``: every one)."""
    names = list(allowed) if text == "all" else [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise SystemExit(f"unknown {unknown}; choose from {', '.join(allowed)}")
    return names


def schedule(groups: Iterable[Sequence[dict]], repeats: int) -> Iterator[dict]:
    """Every group's jobs (the variants of one model and batch), reversed on odd repeats to balance drift."""
    groups = list(groups)
    for repeat in range(repeats):
        for group in groups:
            yield from (reversed(group) if repeat % 2 else group)


@contextmanager
def cache_env() -> Iterator[tuple[dict[str, str], str]]:
    """A fresh compile cache, removed afterwards: the environment for inductor and Triton, FuseCallback's dir.

    What cannot be removed is left: after a child was killed at the budget, something of it still wrote there on an
    H200 (compile workers, likely), and the removal raised ``Directory not empty: 'triton'``: the run ended with a
    traceback, and a job after it would not have run (the RESULTS' sixty-ninth session)."""
    with tempfile.TemporaryDirectory(prefix="bench-cache-", ignore_cleanup_errors=True) as root:
        yield {"TORCHINDUCTOR_CACHE_DIR": f"{root}/inductor", "TRITON_CACHE_DIR": f"{root}/triton"}, f"{root}/fuse"


class Runner:
    """Launches child processes within ``budget_s`` and appends their records to ``out``.

    Args:
        out: The JSON-lines file.
        fields: A record's fields, in order, before the environment's; a missing one is written as ``null``.
        budget_s: Seconds for the whole run. A job is skipped when less is left than the longest process of its
            kind so far took (``kind``: a cold compile is not a warm one), and killed (with its process group) when
            it runs past the end.
        logs: Keep each child's stdout and stderr there, numbered on from the logs already in it.
    """

    def __init__(self, out: Path, fields: Sequence[str], budget_s: float, logs: Path | None = None) -> None:
        self.out, self.fields, self.logs = Path(out), tuple(fields), logs
        self.deadline = time.monotonic() + budget_s
        self.longest: dict[str, float] = {}
        self.env = environment()
        self.launched = len(list(logs.glob("*.log"))) if logs and logs.is_dir() else 0  # numbered on, never over

    def launch(self, script: str, spec: dict, env: dict[str, str] | None = None, kind: str = "") -> dict:
        """Run ``python script --child spec``; its record, or one whose ``error`` says why there is none."""
        left, longest = self.deadline - time.monotonic(), self.longest.get(kind, 0.0)
        if left <= max(longest, 1.0):
            return {"error": f"{BUDGET_SKIP} {left:.0f} s of the budget left, the longest such process took "
                             f"{longest:.0f} s"}
        argv = [sys.executable, str(ROOT / "benchmarks" / script), "--child", json.dumps(spec)]
        start = time.monotonic()
        self.launched += 1
        with self._output(script) as out:  # written as the child runs: a killed call's log still holds its output
            out.write(f"{argv}\n")
            out.flush()
            stacks_at = time.time() + left - STACKS_GRACE_S
            child_env = {**os.environ, **(env or {}), STACKS_AT: f"{stacks_at:.1f}"}
            proc = subprocess.Popen(argv, cwd=ROOT, env=child_env, text=True, start_new_session=True, stdout=out,
                                    stderr=subprocess.STDOUT)  # fmt: skip
            try:
                proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: DDP ranks and compile workers too
                proc.wait()
            out.seek(0)
            lines = out.read().splitlines()
        self.longest[kind] = max(longest, time.monotonic() - start)
        records = [json.loads(line[len(RECORD) :]) for line in lines if line.startswith(RECORD)]
        if records:
            return records[-1]
        if time.time() >= stacks_at:  # killed at the budget, or brought down by dumping its stacks just before
            return {"error": f"killed: ran past the time budget ({left:.0f} s)"}
        tail = ([line for line in lines[1:] if line.strip()] or ["no output"])[-1]
        return {"error": f"process died (exit code {proc.returncode}): {tail}"[:300]}

    @contextmanager
    def _output(self, script: str) -> Iterator[Any]:
        """The file a child's stdout and stderr go to: in ``logs`` if kept, else a temporary one."""
        if not self.logs:
            with tempfile.TemporaryFile("w+") as f:
                yield f
            return
        self.logs.mkdir(parents=True, exist_ok=True)
        with (self.logs / f"{self.launched:03d}-{Path(script).stem}.log").open("w+") as f:
            yield f

    def write(self, record: dict) -> dict:
        row = {**{field: record.get(field) for field in self.fields}, **self.env}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with self.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        shown = {k: v for k, v in row.items() if k not in ENV and v is not None}
        print(json.dumps(shown), flush=True)
        return row


def serve(measure: Callable[[dict], dict], spec: str) -> int:
    """The child's side: run ``measure(spec)`` and print its record (rank 0 only, under DDP)."""
    if STACKS_AT in os.environ:  # a fit that hangs says where, before :class:`Runner` kills it
        faulthandler.dump_traceback_later(max(float(os.environ[STACKS_AT]) - time.time(), 0.1))
    torch.set_float32_matmul_precision("high")  # TF32 on, as a GPU user would have it
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # no variant drops to eager
    try:
        record = measure(json.loads(spec))
    except Exception as err:  # building the model, say: still a record
        record = {"error": describe(err)}
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(RECORD + json.dumps(record), flush=True)
    return 0


class StepClock(pl.Callback):
    """Times every training batch from its start to the next one's start, with one clock for every variant.

    :class:`~lightning_fuse.timing.StepTimer` marks each start with a CUDA event (read once, after the fit: no
    per-step sync), or ``time.perf_counter`` on CPU. The first ``warmup`` batches are untimed; ``setup_s`` runs
    from ``started`` to the start of the first timed batch (synchronised). List the clock first among the
    callbacks, so that the other callbacks' per-step work falls inside the steps. The loss of the last
    :data:`LOSS_WINDOW` steps is kept (copied: a CUDA graph would overwrite it).

    Where the setup goes: ``train_start_s``, when Lightning's training starts, and ``batch_starts_s``, when each of
    the first ``warmup`` batches starts, both on the setup's clock (seconds from ``started``) and both the host's
    (not synchronised: work the host queued shows in a later gap), so that the step that loads or compiles the plan,
    or captures its graph, stands out. The host's side of each step is kept too, to tell a slower host from slower
    work: the main thread's CPU time per step (``epoch_cpu_ms``, ``cpu_ms``: what the step asked of the host), and
    how often the kernel took the CPU from that thread (``switches_per_step``, involuntary context switches;
    ``None`` off Linux). On CUDA, each timed step's new device memory (``device_allocs``: the caching allocator's
    ``cudaMalloc`` calls, driver calls a step whose memory is cached never makes) tells a step that met sizes the
    allocator had not cached.
    """

    def __init__(self, warmup: int, started: float) -> None:
        self.warmup, self.started = warmup, started
        self.batches = 0
        self.setup_s: float | None = None
        self.train_start_s: float | None = None
        self.batch_starts_s: list[float] = []
        self.times: dict[str, list[float]] = {}
        self.cpu_marks: list[tuple[str, float]] = []  # (the step's kind, the main thread's CPU time at its start)
        self.alloc_marks: list[tuple[str, int]] = []  # (the step's kind, the device allocations before it; CUDA)
        self.losses: deque[torch.Tensor] = deque(maxlen=LOSS_WINDOW)
        self.timer: StepTimer | None = None
        self.switches_at_start: int | None = None  # involuntary context switches before the first timed step
        self.switches: int | None = None  # and during the timed steps

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_start_s = time.perf_counter() - self.started
        self.timer = StepTimer(pl_module.device)
        self.timer.reserve(max(trainer.max_steps, 1) * trainer.accumulate_grad_batches)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self.batches < self.warmup:
            self.batch_starts_s.append(time.perf_counter() - self.started)
        if self.batches == self.warmup:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize()  # the setup ends when the warmup's work is done, not when it is queued
            self.setup_s = time.perf_counter() - self.started
        self.timer.start()
        kind = str(trainer.current_epoch) if self.batches >= self.warmup else SKIPPED
        self.timer.stop(kind)
        self.cpu_marks.append((kind, time.thread_time()))
        if pl_module.device.type == "cuda":
            self.alloc_marks.append((kind, device_allocs(pl_module.device)))
        if self.batches == self.warmup:
            self.switches_at_start = involuntary_switches()
        self.batches += 1

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:  # fmt: skip
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and trainer.max_steps - trainer.global_step <= LOSS_WINDOW:
            self.losses.append(loss.detach() * trainer.accumulate_grad_batches)  # Lightning divided it; a copy

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.times = self.timer.collect()
        start = self.switches_at_start
        self.switches = involuntary_switches() - start if start is not None and start >= 0 else None

    def result(self) -> dict[str, Any]:
        steps = [ms for epoch in sorted(self.times, key=int) for ms in self.times[epoch]]
        losses = [float(loss) for loss in self.losses]
        quartiles = statistics.quantiles(steps, n=4) if len(steps) > 1 else [None, None, None]
        cpu = self.cpu_per_epoch()
        cpu_steps = [ms for epoch_cpu in cpu.values() for ms in epoch_cpu]
        return {"step_ms": statistics.median(steps) if steps else None, "steps": self.batches,
                "step_ms_q1": quartiles[0], "step_ms_q3": quartiles[2],
                "step_ms_mean": statistics.mean(steps) if steps else None,  # a median hides re-recorded graphs
                "timed_steps": len(steps), "setup_s": self.setup_s,
                "train_start_s": None if self.train_start_s is None else round(self.train_start_s, 3),
                "batch_starts_s": [round(at, 3) for at in self.batch_starts_s],  # both to the ms: their order holds
                "final_loss": statistics.mean(losses) if losses else None,
                "epoch_ms": {int(epoch): ms for epoch, ms in self.times.items()}, "epoch_cpu_ms": cpu,
                "cpu_ms": statistics.median(cpu_steps) if cpu_steps else None,
                "switches_per_step": None if not cpu_steps or self.switches is None else self.switches / len(cpu_steps),
                "device_allocs": [count for _, count in _timed_deltas(self.alloc_marks)] or None}

    def cpu_per_epoch(self) -> dict[int, list[float]]:
        """The main thread's CPU milliseconds of each timed step, by epoch; like the step times, a step runs from
        its batch's start to the next one's, so the last step (no next start) is left out."""
        cpu: dict[int, list[float]] = {}
        for kind, seconds in _timed_deltas(self.cpu_marks):
            cpu.setdefault(int(kind), []).append(seconds * 1e3)
        return cpu


def _timed_deltas(marks: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Each timed step's kind and the change, from its start to the next step's, in a value marked at every batch's
    start (the last step, with no next start, is left out).

    Example::

        >>> _timed_deltas([(SKIPPED, 5), ("0", 7), ("0", 10), ("1", 18)])
        [('0', 3), ('0', 8)]
    """
    return [(kind, end - begin) for (kind, begin), (_, end) in zip(marks, marks[1:]) if kind != SKIPPED]


def device_allocs(device: torch.device) -> int:
    """The caching allocator's ``cudaMalloc`` calls so far on CUDA ``device``, read from its statistics as it gives
    them (every step reads it: :func:`torch.cuda.memory_stats` would flatten them all in Python first)."""
    return torch.cuda.memory_stats_as_nested_dict(device).get("num_device_alloc", 0)


def involuntary_switches() -> int:
    """How often, so far, the kernel took the CPU from this thread while it could still run (-1 where
    ``RUSAGE_THREAD`` is missing, off Linux): another process or thread wanted the core."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_nivcsw if who is not None else -1


def host_spin_ms(repeats: int = 5) -> float:
    """The median milliseconds of a fixed pure-Python workload: this host's speed for Python at this moment, the
    yardstick of host-bound steps (a fit's steps and this spin slow down together when the host does).

    Example::

        >>> host_spin_ms() > 0
        True
    """
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sum(i * i for i in range(50_000))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def fit(task: pl.LightningModule, loader: Any, *, steps: int, warmup: int, callbacks: Sequence[pl.Callback] = (),
        started: float | None = None, **trainer_kw: Any) -> dict[str, Any]:  # fmt: skip
    """Train ``task`` for ``steps`` optimizer steps under a :class:`StepClock`; an exception becomes ``error``.

    The Trainer runs ``precision="bf16-mixed"`` on CUDA (``32-true`` elsewhere), no logger, checkpoints,
    progress bar or validation; ``trainer_kw`` overrides any of that. ``peak_gb`` is CUDA's peak allocation
    over the fit; ``wall_s`` the fit's duration; ``spin_ms`` the host's speed just before it (:func:`host_spin_ms`).
    """
    cuda = torch.cuda.is_available() and trainer_kw.get("accelerator", "auto") != "cpu"
    spin_ms = host_spin_ms()
    clock = StepClock(warmup, started if started is not None else time.perf_counter())
    options = {"accelerator": "auto", "devices": 1, "precision": "bf16-mixed" if cuda else "32-true",
               "max_steps": steps, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
               "enable_model_summary": False, "num_sanity_val_steps": 0, "limit_val_batches": 0}  # fmt: skip
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start, error = time.perf_counter(), None
    try:
        pl.Trainer(**{**options, **trainer_kw}, callbacks=[clock, *callbacks]).fit(task, loader)
    except Exception as err:
        error = describe(err)
    wall_s = time.perf_counter() - start
    peak_gb = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {**clock.result(), "wall_s": wall_s, "peak_gb": peak_gb, "spin_ms": spin_ms, "error": error}


def read_records(path: Path | str) -> list[dict]:
    """The records of a results file, one JSON object a line (blank lines skipped)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def table(paths: Sequence[Path]) -> str:
    """One Markdown table per file: each key's newest run (its repeats pooled), then the machines and commands."""
    parts = []
    for path in paths:
        records = read_records(path)
        rows = newest_rows(records)
        columns = [c for c in dict.fromkeys(c for r in [*records, *rows] for c in r) if c not in ENV]
        lines = [f"### {Path(path).name}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
        fields = ("run_started", "device", "machine", "torch", "commit", "bytecode", "command")
        runs = sorted({tuple(r.get(k) for k in fields) for r in rows}, key=str)
        lines += [""] + [f"- {when}, {device}{f' (machine {machine})' if machine else ''}, torch {version}"
                         f"{f', commit {commit}' if commit else ''}{f', bytecode {bytecode}' if bytecode else ''}: "
                         f"`{command}`" for when, device, machine, version, commit, bytecode, command in runs]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def newest_rows(records: Sequence[dict]) -> list[dict]:
    """Each key's (:data:`KEYS`) newest run, its repeats pooled (:func:`pooled`), in the order of their keys.

    Example::

        >>> old = {"model": "m", "variant": "fuse", "step_ms": 9.0, "run_started": "2026-11-01"}
        >>> new = [{**old, "step_ms": ms, "run_started": "2026-11-02"} for ms in (3.0, 5.0)]
        >>> [row["step_ms"] for row in newest_rows([old, *new])]
        [4.0]
    """
    keys = [key for key in KEYS if any(key in r for r in records)]
    newest: dict[tuple, list[dict]] = {}
    for record in records:
        key, when = tuple(record.get(k) for k in keys), record.get("run_started", "")
        kept = newest.setdefault(key, [record])
        if when > kept[0].get("run_started", ""):
            newest[key] = [record]
        elif when == kept[0].get("run_started", "") and record is not kept[0]:
            kept.append(record)
    return sorted(map(pooled, newest.values()), key=lambda r: tuple(str(r.get(k)) for k in keys))


def measured_cases(rows: Iterable[dict], fields: Sequence[str]) -> tuple[dict[tuple, dict[str, dict]], list[str]]:
    """``rows`` (e.g. :func:`newest_rows`) that measured a step time, by case (their values of ``fields``) and then
    by variant; and the fits that crashed (:func:`crashed`), each named by its case and variant.

    Example::

        >>> rows = [{"model": "m", "variant": "eager", "step_ms": 3.0}, {"model": "m", "variant": "fuse", "error": "x"}]
        >>> cases, crashes = measured_cases(rows, ["model"])
        >>> list(cases[("m",)]), crashes
        (['eager'], ['m fuse'])
    """
    cases: dict[tuple, dict[str, dict]] = {}
    crashes = []
    for row in rows:
        case = tuple(row[field] for field in fields)
        if crashed(row):
            crashes.append(" ".join(map(str, [*case, row["variant"]])))
        if row.get("step_ms") is not None and not row.get("error"):
            cases.setdefault(case, {})[row["variant"]] = row
    return cases, crashes


def checks_report(header: str, separator: str, judged: Sequence[dict], crashes: Sequence[str], verdicts: str) -> str:
    """An issue's checks as Markdown: a table (``header``, ``separator`` and each judged case's ``line``), then one
    line with how many cases, the crashed fits named (:func:`measured_cases`), and ``verdicts``.

    Example::

        >>> print(checks_report("| m |", "|---|", [{"line": "| a |"}], ["b fuse"], "fuse <= eager in 1 of 1."))
        | m |
        |---|
        | a |
        <BLANKLINE>
        1 cases, 1 crashed fits (b fuse); fuse <= eager in 1 of 1.
    """
    named = f" ({', '.join(crashes)})" if crashes else ""
    summary = f"{len(judged)} cases, {len(crashes)} crashed fits{named}; {verdicts}"
    return "\n".join([header, separator, *(case["line"] for case in judged), "", summary])


def judged_values(judged: Sequence[dict], names: Sequence[str]) -> dict[str, list]:
    """Each check's values (by name) over the cases that judged it: a case's ``None`` is a check it could not make.

    Example::

        >>> judged_values([{"a": 1.0, "b": None}, {"a": 2.0, "b": 3.0}], ["a", "b"])
        {'a': [1.0, 2.0], 'b': [3.0]}
    """
    return {name: [case[name] for case in judged if case[name] is not None] for name in names}


def figure(value: float | None, digits: int = 2) -> str:
    """A checks table's cell: ``value`` to ``digits`` decimals, or ``-`` where there is none.

    Example::

        >>> figure(3.14159), figure(0.0151, 3), figure(None)
        ('3.14', '0.015', '-')
    """
    return "-" if value is None else f"{value:.{digits}f}"


def passing(values: Sequence[Any], limit: float | None = None) -> str:
    """How many of ``values`` pass, as ``"k of n"``: those at most ``limit``, or (no limit) those true.

    Example::

        >>> passing([0.9, 1.1], limit=1.0), passing([True, False, True])
        ('1 of 2', '2 of 3')
    """
    passed = [value <= limit for value in values] if limit is not None else [bool(value) for value in values]
    return f"{sum(passed)} of {len(passed)}"


def crashed(record: dict) -> bool:
    """Whether ``record``'s job failed: an ``error`` that is not the budget's skip (:data:`BUDGET_SKIP`).

    Example::

        >>> crashed({"error": "RuntimeError: boom"}), crashed({"error": "skipped: 7 s of the budget left"})
        (True, False)
    """
    error = record.get("error")
    return bool(error) and not error.startswith(BUDGET_SKIP)


POOLED_MEDIANS = ("step_ms_mean", "setup_s_cold", "setup_s_warm", "compile_s_cold", "compile_s_warm")
"""A record's fields that its repeats pool by their median, as ``step_ms`` is (not the last repeat's alone: Wav2Vec2's
two cold `fuse` setups of one H200 run read 68.1 and 60.1 s, and the table showed the last)."""


def pooled(run: Sequence[dict]) -> dict:
    """One row for a key's records from one run (``--repeats``): the last one, with ``step_ms`` the median of the
    repeats that measured one, ``step_ms_range`` their least and greatest and ``repeats`` how many (a single
    fit's quartiles dropped; each of :data:`POOLED_MEDIANS` the median of the repeats', ``None`` where one lacks it).
    Where every repeat has a ``final_loss``, ``final_loss_range`` is their least and greatest where these differ at
    three digits (``final_loss`` stays the last repeat's: on an H200, three bf16-true fits of one compiled variant
    ended 2.56-2.69 where eager's ended 2.53-2.55). Records that failed or were skipped count only when no repeat
    measured.

    Example::

        >>> row = pooled([{"step_ms": 3.0}, {"step_ms": 1.0}, {"step_ms": 2.0}, {"error": "skipped"}])
        >>> row["step_ms"], row["step_ms_range"], row["repeats"]
        (2.0, '1.00-3.00', 3)
        >>> pooled([{"step_ms": 3.0, "setup_s_cold": 68.1}, {"step_ms": 1.0, "setup_s_cold": 60.1}])["setup_s_cold"]
        64.1
        >>> row = pooled([{"step_ms": 3.0, "final_loss": 2.647}, {"step_ms": 1.0, "final_loss": 2.562}])
        >>> row["final_loss"], row["final_loss_range"]
        (2.562, '2.56-2.65')
    """
    measured = [r for r in run if r.get("step_ms") is not None and not r.get("error")]
    if len(measured) < 2:
        return (measured or list(run))[-1]
    times = [r["step_ms"] for r in measured]
    one_fit = {k: None for k in ("step_ms_q1", "step_ms_q3") if k in measured[-1]}
    for field in (f for f in POOLED_MEDIANS if f in measured[-1]):
        values = [r.get(field) for r in measured]
        one_fit[field] = statistics.median(values) if None not in values else None
    losses = sorted(r["final_loss"] for r in measured if r.get("final_loss") is not None)
    ends = (f"{losses[0]:.3g}", f"{losses[-1]:.3g}") if len(losses) == len(measured) else None
    if ends and ends[0] != ends[1]:
        one_fit["final_loss_range"] = "-".join(ends)
    return {**measured[-1], **one_fit, "step_ms": statistics.median(times),
            "step_ms_range": f"{min(times):.2f}-{max(times):.2f}", "repeats": len(times)}  # fmt: skip


def _cell(value: Any) -> str:
    """A value as a table cell: a list longer than :data:`LIST_CELL` (each step's time, say) by its length only.

    Example::

        >>> _cell(0.01234), _cell([1.0] * 99), _cell(None)
        ('0.0123', '99 values (in the .jsonl)', '-')
    """
    if value is None:
        return "-"
    if isinstance(value, list) and len(value) > LIST_CELL:
        return f"{len(value)} values (in the .jsonl)"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) >= 0.1 else f"{value:.3g}"
    return str(value).replace("|", "/")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Render benchmark results (JSON lines) as Markdown tables.")
    p.add_argument("command", choices=["table"])
    p.add_argument("paths", nargs="+", type=Path)
    args = p.parse_args(argv)
    print(table(args.paths), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
