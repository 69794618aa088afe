"""CPU smoke tests of the benchmark harnesses: every script's ``--smoke`` path, on tiny models.

Three scripts run end to end through their CLI, in background processes started once for the module: ``zoo.py``
(a compiling variant: a cold and a warm child process), ``multi_gpu.py`` and ``gradients.py`` (Lightning's
2-process DDP on gloo). The other scripts run their ``main`` in this process with the child launch replaced by a
direct call of their ``measure``: the same records, without paying a fresh interpreter per job. The harness's own
process handling (crashes, the budget, alternating order) is tested with stdlib-only child scripts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402
import models  # noqa: E402

from lightning_fuse.timing import COMPILED, EAGER, LEAD_IN  # noqa: E402

ENV = ["device", "machine", "torch", "run_started", "command", "commit"]
CLI = {
    "zoo": ["--models", "gpt", "--batches", "small", "--variants", "eager"],
    "multi_gpu": ["--models", "gpt", "--strategies", "ddp", "--batches", "small",
                  "--variants", "eager_fp32,fuse_idle", "--seed", "3"],
    "gradients": ["--models", "gpt", "--world-size", "2", "--variants", "eager"],
}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check(records: list[dict], fields: tuple[str, ...], count: int) -> None:
    assert len(records) == count, records
    for record in records:
        assert list(record) == [*fields, *ENV], "exactly the fields, in order"
        assert record["error"] is None, record["error"]
        assert record["device"] == "cpu" and record["command"].startswith("python ")


@pytest.fixture(scope="module", autouse=True)
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.Popen, Path]]:
    """Start both CLI smoke runs with the module's first test; the in-process tests run while they import torch."""
    out = tmp_path_factory.mktemp("cli")
    procs = {name: (subprocess.Popen([sys.executable, f"benchmarks/{name}.py", "--smoke", "--out", str(out / name),
                                      *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
                    out / name) for name, args in CLI.items()}  # fmt: skip
    yield procs
    for proc, _ in procs.values():
        proc.kill()


def _finished(run: tuple[subprocess.Popen, Path]) -> Path:
    proc, out = run
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-3000:]
    return out


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch):
    """Jobs run in this process: ``Runner.launch`` calls the script's ``measure`` (errors become records)."""

    def launch(self, script: str, spec: dict, env: dict | None = None, kind: str = "") -> dict:
        module = __import__(Path(script).stem)
        try:
            return module.measure(json.loads(json.dumps(spec)))
        except Exception as err:
            return {"error": harness.describe(err)}

    monkeypatch.setattr(harness.Runner, "launch", launch)


def test_zoo_cold_and_warm_and_the_table(tmp_path: Path, in_process) -> None:
    import zoo

    out = tmp_path / "zoo.jsonl"
    args = ["--smoke", "--models", "gpt", "--batches", "small", "--variants", "eager,fuse", "--out"]
    assert zoo.main([*args, str(out)]) == 0
    records = _records(out)
    _check(records, zoo.FIELDS, 2)
    assert [(r["batch_size"], r["variant"]) for r in records] == [(2, "eager"), (2, "fuse")]
    eager, fuse = records
    assert eager["setup_s_cold"] is None and eager["setup_s_warm"] > 0 and eager["plan"] is None
    assert fuse["setup_s_cold"] > 0 and fuse["setup_s_warm"] > 0 and fuse["plan"], "cold, then warm: two fits"
    assert 0 < fuse["compile_s_cold"] < fuse["setup_s_cold"], "the cold fit's search compiled its candidates"
    assert 0 <= fuse["compile_s_warm"] <= fuse["setup_s_warm"], "the warm fit compiles at most the cached plan"
    assert eager["compile_s_cold"] is None and eager["compile_s_warm"] is None, "no FuseCallback, nothing counted"
    for record in records:  # the warm fit's setup, step by step, on the setup's clock
        starts = record["batch_starts_s"]
        assert len(starts) == 4 and starts == sorted(starts), "each warmup batch's start, in order"
        assert 0 < record["train_start_s"] <= starts[0] and starts[-1] <= record["setup_s_warm"]
    text = harness.table([out])
    assert text.count("\n| gpt | recipes |") == 2 and "| model | source | batch_size | variant |" in text
    assert harness.main(["table", str(out)]) == 0


@pytest.mark.parametrize("variant", ["fuse_eager_random", "fuse_compiled_only"])
def test_a_compiling_variant_left_out_of_cold_runs_once_and_its_setup_is_the_cold_one(tmp_path: Path, in_process,
                                                                                       variant: str):  # fmt: skip
    import zoo

    out = tmp_path / "zoo.jsonl"
    args = ["--smoke", "--models", "gpt", "--batches", "small", "--variants", variant, "--cold", ""]
    assert zoo.main([*args, "--out", str(out)]) == 0
    (record,) = _records(out)
    assert record["setup_s_cold"] > 0 and record.get("setup_s_warm") is None, "one process, on an empty cache"
    assert record["variant"] == variant and record["plan"] and not record["error"], "the zoo's own variant runs fuse"
    if variant == "fuse_compiled_only":  # the whole network from the first step, as the warning's settings say
        assert "mode='reduce-overhead'" in record["ran"] and record["eager_step_ms_in_run"] is None


def test_zoo_checks_hold_fuse_to_the_fastest_one_liner_of_each_cases_newest_rows(tmp_path: Path, capsys) -> None:
    import zoo

    def row(model: str, variant: str, when: str = "2026-11-02", **fields: Any) -> dict:
        return {"model": model, "batch_size": 8, "variant": variant, "run_started": when, **fields}

    records = [
        row("a", "eager", step_ms=40.0), row("a", "compile", step_ms=20.0),
        row("a", "fuse", "2026-11-01", step_ms=30.0),  # older: the newer fuse row below counts
        row("a", "reduce_overhead", step_ms=10.0, setup_s_cold=40.0, setup_s_warm=12.0),
        row("a", "fuse", step_ms=11.0, setup_s_cold=80.0, setup_s_warm=8.0, plan="graph"),
        row("b", "eager", step_ms=40.0), row("b", "fuse", step_ms=44.0, plan="eager"),
        row("c", "eager", step_ms=40.0), row("c", "fuse", error="RuntimeError: boom"),
        row("c", "reduce_overhead", error="skipped: 7 s of the budget left"),
    ]  # fmt: skip
    text = zoo.checks(records)
    lines = text.splitlines()
    assert lines[2] == "| a | 8 | 40.00 | 10.00 (reduce_overhead) | 11.00 | graph | 0.28 | 1.10 | 2.00 | 0.10 (0.30) |"
    assert lines[3] == "| b | 8 | 40.00 | - | 44.00 | eager | 1.10 | - | - | - |", "no one-liner measured: left out"
    assert len(lines) == 6, "c's fuse crashed: no row of its own"
    assert lines[-1] == ("2 cases, 1 crashed fits (c 8 fuse); fuse <= 1.03x eager in 1 of 2; <= 1.05x the best "
                         "one-liner in 0 of 1, geometric mean 1.10; cold setup <= 1.5x reduce-overhead's in 0 of 1; "
                         "warm <= 0.25x cold in 1 of 1."), "a crash is named; a skip is none"  # fmt: skip
    out = tmp_path / "zoo.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert zoo.main(["--checks", str(out)]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_zoo_checks_mark_a_best_one_liner_whose_mean_step_is_slower_than_eager() -> None:
    """HF Wav2Vec2 under reduce-overhead on an H200: a median of 23 ms, a mean of 141 (half its steps re-recorded
    graphs). The check still holds fuse to the median; the mark and the closing line say what the median hides."""
    import zoo

    def row(variant: str, ms: float, **fields: Any) -> dict:
        return {"model": "w", "batch_size": 8, "variant": variant, "step_ms": ms, "run_started": "2026-11-02",
                **fields}  # fmt: skip

    records = [row("eager", 36.0), row("fuse", 33.0, plan="eager"),
               row("reduce_overhead", 24.0, step_ms_mean=140.0), row("reduce_overhead", 26.0, step_ms_mean=120.0),
               row("compile", 43.0, step_ms_mean=43.5)]  # fmt: skip
    lines = zoo.checks(records).splitlines()
    assert lines[2] == "| w | 8 | 36.00 | 25.00‡ (reduce_overhead) | 33.00 | eager | 0.92 | 1.32 | - | - |"
    assert lines[-1].endswith("in 0 of 1, geometric mean 1.32; cold setup <= 1.5x reduce-overhead's in 0 of 0; warm "
                              "<= 0.25x cold in 0 of 0. ‡ The best one-liner's mean step is slower than eager's: w at "
                              "8, reduce_overhead 130.0 ms against 36.0."), "the repeats' means pooled by their median"
    records[2:4] = [row("reduce_overhead", 24.0, step_ms_mean=30.0)]
    assert "‡" not in zoo.checks(records), "a mean faster than eager's: no mark"


def test_zoo_checks_mark_a_ratio_whose_rows_come_from_different_calls() -> None:
    """HF Bloom on an H200: the table paired one session's cold `fuse` setup (43.5 s) with the next session's
    `reduce_overhead` one (38.2 s, 33.9 the session before): 1.14, read as if side by side."""
    import zoo

    def row(variant: str, when: str, **fields: Any) -> dict:
        return {"model": "b", "batch_size": 8, "variant": variant, "step_ms": 10.0, "run_started": when, **fields}

    records = [row("eager", "2026-11-29T18:00", step_ms=40.0), row("fuse", "2026-11-29T18:00", setup_s_cold=43.5),
               row("reduce_overhead", "2026-11-29T20:00", setup_s_cold=38.2)]  # fmt: skip
    lines = zoo.checks(records).splitlines()
    assert lines[2] == "| b | 8 | 40.00 | 10.00 (reduce_overhead) | 10.00 | - | 0.25 | 1.00* | 1.14* | - |"
    assert lines[-1].endswith(" * 2 ratios pair rows of different calls, not side by side.")
    records[2]["run_started"] = "2026-11-29T18:00"
    assert "*" not in zoo.checks(records), "one call: side by side"


def test_pattern_checks_hold_fuse_to_eager_and_the_one_line_and_buckets_to_the_unbucketed_fits(tmp_path, capsys):
    """The checks also mark a one line whose final loss missed eager's, naming both losses (it still holds fuse), and
    show a user's compile's logged speedup, against eager, without holding it to their separate fits, and a pooled
    run's range of final losses."""
    import patterns

    def row(pattern: str, variant: str, **fields: Any) -> dict:
        return {"model": "llama", "pattern": pattern, "batch_size": 8, "variant": variant, "steps": 100,
                "run_started": "2026-11-02", **fields}  # fmt: skip

    varying = {"wall_s": 90.0, "compile_s": 60.0}
    records = [
        row("lora", "eager", step_ms=50.0, final_loss=10.2),
        row("lora", "fuse", step_ms=9.0, final_loss=10.9, speedup_logged=5.5, speedup_low=5.0, speedup_high=6.0),
        row("varying_length", "eager", step_ms=60.0, final_loss=2.0, wall_s=20.0),
        row("varying_length", "reduce_overhead", step_ms=10.0), row("varying_length", "compile", step_ms=9.0),
        row("lora", "reduce_overhead", step_ms=9.0, final_loss=12.0),
        row("varying_length", "fuse", step_ms=12.0, final_loss=2.01, most_recompiles=3, speedup_logged=18.7,
            speedup_low=13.6, speedup_high=26.6, **varying),
        row("varying_length_buckets", "fuse", step_ms=11.0, final_loss=2.02, graphs=3, most_recompiles=0, **varying),
        row("moe", "eager", step_ms=90.0, final_loss=1.0, steps=230),
        row("moe", "fuse", step_ms=99.0, final_loss=2.0), row("two_optimizers", "fuse", error="RuntimeError: boom"),
        # the eager fit is the user's compile; the logged speedup is against eager: shown, not held; two repeats
        row("precompiled", "eager", step_ms=20.0, final_loss=2.1),
        row("precompiled", "eager", step_ms=20.0, final_loss=2.0),
        row("precompiled", "fuse", step_ms=10.0, final_loss=2.0, speedup_logged=6.0, speedup_low=5.5, speedup_high=6.5),
    ]  # fmt: skip
    text = patterns.checks(records)
    lines = text.splitlines()
    assert lines[2:7] == [
        ("| llama | lora | 8 | 50.00 | 9.00 | - | 0.18 | 1.00† reduce_overhead | 10.9 / 10.2 | - | - | - | "
         "5.50 (5.00-6.00) / 5.56 |"),
        # eager's 230 steps: no loss to hold
        "| llama | moe | 8 | 90.00 | 99.00 | - | 1.10 | - | - | - | - | - | - |",
        # a pooled run's loss: the last repeat's, their range in brackets
        "| llama | precompiled | 8 | 20.00 | 10.00 | - | 0.50 | - | 2 / 2 (2-2.1) | - | - | - | 6.00 (5.50-6.50) / - |",
        ("| llama | varying_length | 8 | 60.00 | 12.00 | - | 0.20 | 1.33 compile | 2.01 / 2 | 3 | - | 90 / 80 | "
         "18.70 (13.60-26.60) / 5.00 |"),
        ("| llama | varying_length_buckets | 8 | 60.00 | 11.00 | - | 0.18 | 1.22 compile | 2.02 / 2 | 0 | 3 | 90 / 80 "
         "| - |"),
    ]  # fmt: skip
    assert lines[-1] == (
        "5 cases, 1 crashed fits (llama two_optimizers 8 fuse); fuse <= eager in 4 of 5; <= 1.05x the best one "
        "line in 1 of 3; final loss within bf16's tolerance of eager's in 3 of 4; varying lengths: <= 2 "
        "recompiles of a region in 0 of 1, <= one graph a bucket in 1 of 1, wall <= eager's + compiling in 0 of 2; the "
        "logged interval holds the separate fits' ratio in 1 of 2. † The one line's final loss missed eager's: lora "
        "(12 / 10.2).")
    out = tmp_path / "patterns.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert patterns.main(["--checks", str(out)]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_pattern_checks_leave_out_fits_from_another_machine():
    """On two H200 machines minutes apart, DeBERTa's eager fit ran 92.7 and 61.3 ms a step: fuse against an eager
    fit or a one line from another machine is no pair (rows from before ``machine`` was recorded still pair)."""
    import patterns

    def row(variant: str, step_ms: float, **fields: Any) -> dict:
        return {"model": "deberta", "pattern": "varying_length", "batch_size": 16, "variant": variant, "steps": 100,
                "step_ms": step_ms, "run_started": "2026-11-30", "final_loss": 0.69, "wall_s": 20.0, **fields}

    fuse = row("fuse", 36.0, machine="b2", compile_s=90.0, speedup_logged=1.5, speedup_low=1.2, speedup_high=1.8)
    records = [row("eager", 60.0, machine="b2"), fuse, row("compile", 71.0, machine="a1")]
    lines = patterns.checks(records).splitlines()
    assert lines[2].startswith("| deberta | varying_length | 16 | 60.00 | 36.00 | - | 0.60 | 0.51§ compile |")
    assert "fuse <= eager in 1 of 1; <= 1.05x the best one line in 0 of 0" in lines[-1]
    assert lines[-1].endswith("§ Not counted, fuse's fit and these ran on another machine: deberta varying_length "
                              "(the one line).")
    records[0]["machine"] = "a1"
    lines = patterns.checks(records).splitlines()
    assert lines[2].endswith("| 0.60§ | 0.51§ compile | 0.69 / 0.69 | - | - | 20 / 110§ | 1.50 (1.20-1.80) / - |")
    assert "fuse <= eager in 0 of 0; <= 1.05x the best one line in 0 of 0; final loss within bf16's tolerance of " \
           "eager's in 1 of 1" in lines[-1]
    assert "wall <= eager's + compiling in 0 of 0; the logged interval holds the separate fits' ratio in 0 of 0" \
        in lines[-1]
    assert lines[-1].endswith("deberta varying_length (eager and the one line).")
    for record in records:
        del record["machine"]
    assert "fuse <= eager in 1 of 1; <= 1.05x the best one line in 1 of 1" in patterns.checks(records).splitlines()[-1]


def test_regional_finds_the_repeated_blocks() -> None:
    from recipes.models import GPT, resnet18_cifar

    assert {type(b).__name__ for b in models.repeated_blocks(resnet18_cifar())} == {"BasicBlock"}
    assert len(models.repeated_blocks(resnet18_cifar())) == 8, "layer1..layer4, 2 each"
    gpt = GPT(vocab_size=256, max_seq_len=16, n_layer=3, d_model=32, n_head=4)
    assert models.repeated_blocks(gpt) == list(gpt.blocks)
    with pytest.raises(ValueError, match="none of eager"):
        models.apply_variant(models.build("gpt", 2, True, 2)[0], "fast", smoke=True)


@pytest.mark.parametrize("model", list(models.MODELS))
def test_every_model_builds_with_its_loss(model: str) -> None:
    for library in models.MODELS[model][0].split("+"):  # "transformers+peft": both, or the model is skipped
        if library not in ("torchvision", "recipes"):
            pytest.importorskip(library)
    task, loader = models.build(model, 2, smoke=True, length=2)
    with torch.no_grad():
        loss = task.training_step(next(iter(loader)), 0)
    assert loss.ndim == 0 and loss > 0 and len(loader) == 2


def test_patterns_every_pattern(tmp_path: Path, in_process) -> None:
    pytest.importorskip("transformers")
    import patterns

    out = tmp_path / "patterns.jsonl"
    names = [name for name in patterns.PATTERNS if name not in ("precompiled", "varying_length_buckets")]
    argv = ["--smoke", "--patterns", ",".join(names), "--models", "llama,gpt", "--variants", "eager", "--out", str(out)]
    assert patterns.main(argv) == 0
    records = _records(out)
    lora = [r for r in records if r["pattern"] == "lora"]
    if lora and lora[0]["error"]:  # peft missing: an error record, the run goes on
        assert "peft" in lora[0]["error"]
        records.remove(lora[0])
    _check(records, patterns.FIELDS, len(records))
    by_pattern = {r["pattern"]: r for r in records}
    assert set(by_pattern) >= set(names) - {"lora"}
    assert by_pattern["accumulate_clip"]["steps"] == 4 * 4, "4 micro-batches per optimizer step"
    assert by_pattern["two_optimizers"]["steps"] == 4, "two optimizer steps per batch"
    assert all(r["final_loss"] > 0 for r in records)


def test_varying_lengths_cut_a_classifiers_batches_and_keep_its_labels() -> None:
    pytest.importorskip("transformers")
    import patterns

    task, _ = models.build("bert", 2, smoke=True, length=2)
    full = task.data.batches[0]["input_ids"].shape[1]
    patterns.varying_length(3)(task, {})
    lengths = {batch["input_ids"].shape[1] for batch in task.data.batches}
    assert len(task.data.batches) == 3 * models.DISTINCT_BATCHES and max(lengths) <= full
    for batch in task.data.batches:
        assert batch["labels"].shape == (2,), "a classifier's labels are one per row, never cut nor masked"
        assert batch["attention_mask"].shape == batch["input_ids"].shape
        assert batch["attention_mask"][0].all(), "the first row is the batch's longest"
    with torch.no_grad():
        assert task.training_step(task.data.batches[0], 0) > 0


def test_a_fuse_pattern_records_plan_and_recompiles(tmp_path: Path, in_process) -> None:
    import patterns

    out = tmp_path / "patterns.jsonl"
    assert patterns.main(["--smoke", "--patterns", "moe", "--variants", "fuse", "--out", str(out)]) == 0
    (record,) = _records(out)
    _check([record], patterns.FIELDS, 1)
    assert record["plan"] and record["recompiles"] is not None
    times = record["step_times"]
    assert times and all(ms > 0 for ms in times) and record["cpu_ms"] > 0
    assert record["step_ms"] == pytest.approx(statistics.median(times), abs=0.01), "the same steps, in batch order"
    assert all(0 <= step < len(times) for step in record["reference_steps"])


def test_patterns_run_the_variants_in_the_order_asked(tmp_path: Path, in_process, monkeypatch) -> None:
    import patterns

    ran: list[str] = []
    monkeypatch.setattr(patterns, "measure", lambda spec: ran.append(spec["variant"]) or {})
    argv = ["--smoke", "--patterns", "moe", "--variants", "compile,eager", "--repeats", "2", "--out"]
    assert patterns.main([*argv, str(tmp_path / "patterns.jsonl")]) == 0
    assert ran == ["compile", "eager", "eager", "compile"], "as asked, then reversed: drift falls on both sides"


def test_patterns_fuse_unsampled_is_fuse_without_its_sampler_and_only_where_asked(tmp_path: Path, in_process,
                                                                                 monkeypatch) -> None:  # fmt: skip
    import patterns

    measure, ran = patterns.measure, []
    monkeypatch.setattr(patterns, "measure", lambda spec: ran.append(spec["variant"]) or {})
    out = str(tmp_path / "patterns.jsonl")
    assert patterns.main(["--smoke", "--patterns", "moe,precompiled", "--models", "gpt,llama", "--out", out]) == 0
    assert ran == [*patterns.ALL_VARIANTS, "eager", "fuse"], "`all` leaves it out"
    ran.clear()
    argv = ["--smoke", "--patterns", "precompiled", "--models", "llama", "--variants", "compile,fuse_unsampled"]
    assert patterns.main([*argv, "--out", out]) == 0
    assert ran == ["fuse_unsampled"], "where fuse runs; precompiled has no compile variant"
    asked: list[tuple[str, dict]] = []
    monkeypatch.setattr(models, "apply_variant", lambda task, variant, *args, **kw: asked.append((variant, kw)) or [])
    spec = {"model": "gpt", "pattern": "moe", "batch_size": 2, "variant": "fuse_unsampled", "steps": 4,
            "warmup": 2, "smoke": True, "cache_dir": None}  # fmt: skip
    record = measure(spec)
    assert asked == [("fuse", {"gpu_sample_hz": 0})] and record["final_loss"] > 0


def test_patterns_fuse_warm_records_the_whole_cold_fuse_fit_it_runs_on_its_cache(tmp_path, in_process, monkeypatch):
    """One call gives the cold and the warm fit of the same cache, at the cost of those two fits."""
    import patterns

    ran: list[tuple[str, int, str]] = []
    monkeypatch.setattr(patterns, "measure", lambda spec: ran.append((spec["variant"], spec["steps"],
                                                                      spec["cache_dir"])) or {"step_ms": len(ran)})
    out = tmp_path / "patterns.jsonl"
    argv = ["--smoke", "--patterns", "varying_length_each", "--models", "llama", "--variants", "fuse_warm", "--out"]
    assert patterns.main([*argv, str(out)]) == 0
    (cold, warm) = ran
    assert cold[:2] == ("fuse", 4) and warm[:2] == ("fuse_warm", 4), "the cold fit is a whole fuse fit"
    assert cold[2] == warm[2], "one compile cache and decision for both"
    assert [(r["variant"], r["step_ms"]) for r in _records(out)] == [("fuse", 1), ("fuse_warm", 2)]
    monkeypatch.setattr(patterns, "measure", lambda spec: {"error": "RuntimeError: boom"})
    assert patterns.main([*argv, str(out)]) == 0
    failed = [(r["variant"], r["error"]) for r in _records(out)[2:]]
    assert failed == [("fuse", "RuntimeError: boom"), ("fuse_warm", "RuntimeError: boom")], "its own, and the warm's"
    with pytest.raises(SystemExit, match="without fuse"):
        patterns.main([*argv[:-2], "fuse,fuse_warm", "--out", str(out)])


def test_telemetry_seven_fits(tmp_path: Path, in_process) -> None:
    import telemetry

    out = tmp_path / "telemetry.jsonl"
    argv = ["--smoke", "--models", "gpt", "--batches", "small", "--epoch-steps", "10", "--host-spins",
            "--eager-control", "--reset-control", "--out", str(out)]  # fmt: skip
    assert telemetry.main(argv) == 0
    (record,) = _records(out)
    _check([record], telemetry.FIELDS, 1)
    assert record["independent"] > 0 and record["reference_cost"] is not None
    if record["logged"] is not None:  # the logged history was read: its last epoch says how old its reference is
        assert record["reference_age"] >= 0 and record["eager_ratio_in_run"] > 0
    assert record["reference_steps"] >= 0 and record["eager_fits_ratio"] > 0 and record["eager_fits_cpu_ratio"] > 0
    assert record["independent_adjacent"] > 0 and record["eager_control_ratio"] > 0, "a third plain eager fit, first"
    assert record["eager_reset_ratio"] > 0 and record["eager_reset_cpu_ratio"] > 0, "a fourth, the compiled state gone"
    assert record["independent_mean"] > 0 and record["eager_fits_mean_ratio"] > 0, "the ratios of the steps' time too"
    assert record["epochs"] == 2 and len(record["independent_by_epoch"]) == 2, "every epoch's own ratio"
    assert record["independent_by_epoch"][-1] == record["independent"], "the last epoch's is the record's"
    assert len(record["logged_by_epoch"]) in (0, 2) and all(len(row) == 4 for row in record["logged_by_epoch"])
    if record["logged_by_epoch"]:
        assert record["logged_by_epoch"][-1][0] == record["logged"], "the last epoch's is the record's"
    assert len(record["reference_ms"]) == sum(record["reference_sizes"]) == record["reference_steps"], "recomputable"
    assert len(record["dense_ms"]) == sum(record["dense_sizes"])
    assert record["reference_cost_in_run"] is None or 0 <= record["reference_cost_in_run"] < 1
    for ratio in ("eager_cpu_ratio_in_run", "eager_cpu_ratio_dense"):  # None where a fit took no reference step
        assert record[ratio] is None or record[ratio] > 0
    if record["eager_ratio_dense"] is not None:  # the dense fit took reference steps: their host side is read too
        assert record["eager_cpu_ratio_dense"] is not None
    fit = {"reference_steps": {1, 2, 5}, "epoch_cpu_ms": {0: [5.0, 6.0, 7.0], 1: [8.0, 9.0, 10.0]}}  # 2 epochs of 3
    assert telemetry.reference_cpu_ms(fit, steps=3) == ([6.0, 7.0, 10.0], [2, 1]), "two chunks: batches 1-2, then 5"
    assert record["reference_allocs"] is None and record["lead_in_allocs"] is None, "CUDA's counts: none on a CPU"
    fuse_fit = SimpleNamespace(plan=object(), steps=0, step_kind=None)
    marks = models.ReferenceSteps(SimpleNamespace(fit=fuse_fit))
    for step, kind in enumerate((COMPILED, LEAD_IN, EAGER, EAGER, COMPILED)):
        fuse_fit.steps, fuse_fit.step_kind = step, kind
        marks.on_train_batch_start(None, None, None, step)
    assert (marks.lead_ins, marks.reference) == ({1}, {2, 3}), "the chunk's lead-in apart from its timed steps"
    fit = {"device_allocs": [0, 5, 2, 0, 0], "reference_steps": marks.reference, "lead_in_steps": marks.lead_ins}
    assert (telemetry.allocs_at(fit, "reference_steps"), telemetry.allocs_at(fit, "lead_in_steps")) == ([2, 0], [5])
    assert len(record["spin_ms_by_fit"]) == 8 and all(ms > 0 for ms in record["spin_ms_by_fit"]), "seven and after"
    assert len(record["switches_by_fit"]) == 7
    assert record["spin_ms_eager"] > 0, "each eager-only fit's middle batch reads the host"
    for moment in ("spin_ms_reference", "spin_ms_dense_reference", "spin_ms_plan"):  # None where no such step ran
        assert record[moment] is None or record[moment] > 0
    assert all(len(pair) == 2 for pair in record["eager_by_spin"]), "[spin ms, step ms] pairs"
    readings = [("reference", 0, 2, 4.0), ("plan", 1, 50, 2.0), ("reference", 1, 5, 5.0), ("plan", 1, 150, 2.4)]
    assert telemetry.spins(readings, "reference") == 4.5 and telemetry.spins(readings, "plan", epoch=0) is None
    steps = {1: [3.0] * 100 + [4.0] * 100}
    assert telemetry.blocks_by_spin(readings, steps, "plan", 1) == [[2.0, 3.0], [2.4, 4.0]], "each its own 100"
    fit = {"reference_steps": {3, 4, 12, 13}, "epoch_ms": {0: [1.0, 1.0, 8.0, 20.0, 22.0], 1: [1.0, 1.0, 21.0, 23.0]}}
    assert telemetry.chunks_by_spin(readings, fit, steps=5) == [[4.0, 21.0]], "batch 10 has no chunk after it"
    if importlib.util.find_spec("scipy"):
        assert record["independent_low"] <= record["independent"] <= record["independent_high"]
        if len(record["dense_ms"]) >= 2:  # an interval needs two steps a side; a dropped plan may leave one
            assert record["eager_ratio_dense_low"] <= record["eager_ratio_dense"] <= record["eager_ratio_dense_high"]
    positions = record["eager_ratio_by_position"]
    assert positions is None or all(ratio > 0 for ratio in positions)
    low, high = telemetry.interval([10.0, 11.0, 12.0, 10.5], [5.0, 5.5, 5.2, 5.1])
    assert 1.5 < low <= high < 2.5
    assert telemetry.by_position([9.0, 30.0, 20.0, 32.0, 20.0], [1, 2, 2], [20.0]) == [1.55, 1.0]
    assert telemetry.by_position([30.0, 20.0], [2], [20.0]) is None, "one chunk: nothing to compare"


def test_whole_step_and_overhead(tmp_path: Path, in_process) -> None:
    import overhead
    import whole_step

    out = tmp_path / "whole_step.jsonl"
    variants = "fuse,lightning_loop,eager_fp32,fuse_emulated_casts"
    assert whole_step.main(["--smoke", "--models", "gpt", "--variants", variants, "--out", str(out)]) == 0
    record, loop, fp32, emulated = _records(out)
    _check([record, loop, fp32, emulated], whole_step.FIELDS, 4)
    assert emulated["variant"] == "fuse_emulated_casts" and emulated["ran"] and emulated["param_gap"] < 0.1
    assert record["step_ms"] > 0 and record["floor_ms"] is None, "no CUDA kernels on CPU"
    assert record["final_loss"] > 0 and record["eager_final_loss"] > 0
    assert 0 <= record["param_gap"] < 0.1, "the same training, compiled or not"
    assert loop["variant"] == "lightning_loop" and 0 < loop["step_ms"] and loop["param_gap"] is None
    assert fp32["variant"] == "eager_fp32" and fp32["ran"] is None and fp32["param_gap"] < 0.1, "CPU: 32-true twice"
    report = whole_step.checks([record, loop, fp32, emulated]).splitlines()
    assert report[-1].startswith("1 cases, 0 crashed fits"), report[-1]
    assert re.search(r"parameters within full precision's gap in [01] of 1, final loss in [01] of 1; with eager's "
                     r"dropout masks \(fuse_eager_random in fuse's place where measured\), [01] of 1 and [01] of 1",
                     report[-1])  # fmt: skip
    out = tmp_path / "overhead.jsonl"
    assert overhead.main(["--smoke", "--variants", "no_nvml", "--out", str(out)]) == 0
    (record,) = _records(out)
    _check([record], overhead.FIELDS, 1)
    assert record["mean_us"] > 0


CHILD = """
import faulthandler, json, os, sys, time
spec = json.loads(sys.argv[2])
if spec["do"] == "hang":
    faulthandler.dump_traceback_later(float(os.environ["HARNESS_STACKS_AT"]) - time.time())  # as harness.serve
    time.sleep(60)
if spec["do"] == "dump_and_die":  # a DDP rank can crash as its stacks are dumped, and take the others down
    time.sleep(max(float(os.environ["HARNESS_STACKS_AT"]) - time.time(), 0) + 0.5)
    os.kill(os.getpid(), 9)
if spec["do"] == "raise":
    raise RuntimeError("broken variant")
if spec["do"] == "die":
    os._exit(3)
if spec["do"] == "sleep":
    time.sleep(60)
if spec["do"] == "nap":
    time.sleep(3)
print("@record " + json.dumps({"step_ms": 1.5, "error": None}))
"""


def test_runner_records_crashes_and_goes_on(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    runner = harness.Runner(tmp_path / "out.jsonl", ("variant", "step_ms", "error"), budget_s=30)
    for do in ("ok", "raise", "die", "ok"):
        runner.write({"variant": do, **runner.launch(str(script), {"do": do})})
    ok, raised, died, again = _records(tmp_path / "out.jsonl")
    assert ok["step_ms"] == 1.5 and ok["error"] is None and again["error"] is None, "a crash never stops the run"
    assert raised["error"] == "process died (exit code 1): RuntimeError: broken variant"
    assert died["error"].startswith("process died (exit code 3)")
    assert list(ok) == ["variant", "step_ms", "error", *ENV]


def test_runner_budget_kills_and_skips(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    runner = harness.Runner(tmp_path / "out.jsonl", ("error",), budget_s=3)
    start = time.monotonic()
    assert runner.launch(str(script), {"do": "sleep"})["error"].startswith("killed: ran past the time budget")
    assert time.monotonic() - start < 10
    assert runner.launch(str(script), {"do": "ok"})["error"].startswith("skipped:")


def test_runner_keeps_the_output_and_the_stacks_of_a_child_it_kills(tmp_path: Path) -> None:
    """The log is written as the child runs, and a child killed at the budget prints where it stood first."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    runner = harness.Runner(tmp_path / "out.jsonl", ("error",), budget_s=4, logs=tmp_path / "logs")
    assert runner.launch(str(script), {"do": "hang"})["error"].startswith("killed: ran past the time budget")
    (log,) = (tmp_path / "logs").iterdir()
    assert log.name == "001-child.log"
    assert "Thread" in log.read_text() and "child.py" in log.read_text(), "the hung child's stack"


def test_a_second_runner_on_the_same_logs_folder_keeps_the_first_ones_logs(tmp_path: Path) -> None:
    """Two commands of one device call wrote 001-multi_gpu.log each, and the second's replaced the first's."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    for _ in range(2):
        harness.Runner(tmp_path / "out.jsonl", ("error",), budget_s=30, logs=tmp_path / "logs").launch(
            str(script), {"do": "ok"})
    assert sorted(log.name for log in (tmp_path / "logs").iterdir()) == ["001-child.log", "002-child.log"]


def test_runner_calls_a_child_that_dies_after_its_stacks_were_dumped_a_budget_kill(tmp_path: Path) -> None:
    """On 2 GPUs a rank died of its stack dump at the budget's end, and Lightning killed the other: said as such."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    runner = harness.Runner(tmp_path / "out.jsonl", ("error",), budget_s=4)
    error = runner.launch(str(script), {"do": "dump_and_die"})["error"]
    assert error.startswith("killed: ran past the time budget"), error


def test_runner_budget_weighs_each_kind_of_process_by_its_own_kind(tmp_path: Path) -> None:
    """A long cold compile must not skip the short warm process after it."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    runner = harness.Runner(tmp_path / "out.jsonl", ("error",), budget_s=5)
    assert runner.launch(str(script), {"do": "nap"}, kind="cold")["error"] is None  # 3 s of the 5
    assert runner.launch(str(script), {"do": "ok"})["error"] is None  # no warm one yet: it runs
    assert runner.launch(str(script), {"do": "nap"}, kind="cold")["error"].startswith("skipped:")


def test_a_run_weighs_the_budget_by_each_jobs_variant(tmp_path: Path, monkeypatch) -> None:
    """A 200-s compiled fit must not skip the 25-s eager fit after it (it did, twice, on the GPU)."""
    kinds = []
    monkeypatch.setattr(harness.Runner, "launch", lambda self, script, spec, env, kind="": kinds.append(kind) or {})
    args = harness.parser("doc", "x.jsonl", variants=("eager", "fuse")).parse_args(["--out", str(tmp_path / "x")])
    groups = [[{"model": "m", "variant": "fuse"}, {"model": "m", "variant": "eager"}]]
    assert harness.run(args, "patterns.py", lambda spec: {}, ("model", "variant"), groups) == 0
    assert kinds == ["fuse", "eager"]


def test_where_the_machine_writes_no_bytecode_the_children_get_it_compiled_ahead(tmp_path: Path, monkeypatch):
    """The lent GPU machines set ``PYTHONDONTWRITEBYTECODE`` and ship no ``.pyc``: every child compiled the Python
    it imported from source, a compiling variant much more of it than eager."""
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    assert harness.bytecode_env(tmp_path / "pyc") == {}  # bytecode is written as usual: nothing to do
    packages = tmp_path / "site-packages"
    (packages / "pkg").mkdir(parents=True)
    (packages / "pkg" / "mod.py").write_text("X = 1\n")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONPATH", str(harness.ROOT))  # the checkout itself is left alone
    monkeypatch.setattr(harness.site, "getsitepackages", lambda: [str(packages)])
    env = harness.bytecode_env(tmp_path / "pyc")
    assert env == {"PYTHONPYCACHEPREFIX": str(tmp_path / "pyc"), "PYTHONDONTWRITEBYTECODE": ""}
    compiled = {p.name.split(".")[0] for p in (tmp_path / "pyc").rglob("*.pyc")}
    assert "mod" in compiled and "harness" not in compiled  # (and what compileall itself imported)
    show = "import sys; print(sys.flags.dont_write_bytecode, sys.pycache_prefix)"
    flags = subprocess.run([sys.executable, "-c", show], env={**os.environ, **env}, capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    assert flags == ["0", str(tmp_path / "pyc")]  # the children write and read there


def test_profiled_steps_end_one_batch_before_the_timed_ones(monkeypatch) -> None:
    """The window opens at its first batch's start and closes at the start of the last untimed batch (warmup - 1)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # the CUDA path, on a CPU
    profiled = models.ProfiledSteps.before_timed(warmup=6, steps=3)
    module = SimpleNamespace(device=torch.device("cuda"))
    opened = []
    for batch in range(8):
        profiled.on_train_batch_start(None, module, None, batch)
        opened.append(profiled.window.active)
        torch.ones(4).sum()
        profiled.on_train_batch_end(None, module, None, None, batch)
    assert opened == [False, False, True, True, True, False, False, False], "batches 2-4: then batch 5, untimed"
    assert set(profiled.result) == {"kernels_per_step", "gpu_busy_frac", "syncs_per_step", "gpu_ms_per_step"}
    assert profiled.result["kernels_per_step"] == 0 and profiled.result["syncs_per_step"] == 0, "no GPU here"


def test_step_clock_keeps_the_host_side_of_each_step() -> None:
    """The main thread's CPU time per step follows the work the step asks of the host: 100 ms of CPU burnt in the
    training step add to it, where 100 ms of sleep add only to the step's time. (The smoke step's own CPU time
    moves by tens of milliseconds on a busy 2-core machine: the wait stands well above that. Torch's thread pool is
    held to one thread, as its waits for busy workers spin on the main thread: on a loaded machine they added
    over 100 ms.)"""

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    wait_s, half_ms = 0.1, 50
    results, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, wait in (("burns", burn), ("sleeps", time.sleep)):
            task, loader = models.build("gpt", 2, smoke=True, length=6)
            loss_fn = task.loss_fn
            task.loss_fn = lambda model, batch, wait=wait, loss_fn=loss_fn: (wait(wait_s), loss_fn(model, batch))[1]
            results[name] = harness.fit(task, loader, steps=6, warmup=1, accelerator="cpu")
    finally:
        torch.set_num_threads(threads)
    burns, sleeps = results["burns"], results["sleeps"]
    assert len(burns["epoch_cpu_ms"][0]) == burns["timed_steps"] == 4, "timed steps less the last, as epoch_ms"
    assert burns["device_allocs"] is None, "device memory is counted on CUDA only"
    assert burns["cpu_ms"] - sleeps["cpu_ms"] > half_ms, (burns["cpu_ms"], sleeps["cpu_ms"])
    assert sleeps["step_ms"] - sleeps["cpu_ms"] > half_ms, (sleeps["step_ms"], sleeps["cpu_ms"])
    assert burns["spin_ms"] > 0
    switches = burns["switches_per_step"]
    assert switches is None if not hasattr(resource, "RUSAGE_THREAD") else switches >= 0


def test_fit_turns_an_exception_into_error() -> None:
    task, loader = models.build("gpt", 2, smoke=True, length=4)
    task.loss_fn = lambda model, batch: 1 / 0
    result = harness.fit(task, loader, steps=4, warmup=1)
    assert result["error"] == "ZeroDivisionError: division by zero" and result["step_ms"] is None


def test_schedule_alternates_and_table_keeps_the_newest(tmp_path: Path) -> None:
    groups = [[{"v": "a"}, {"v": "b"}], [{"v": "c"}, {"v": "d"}]]
    assert [job["v"] for job in harness.schedule(groups, 2)] == ["a", "b", "c", "d", "b", "a", "d", "c"]
    path = tmp_path / "r.jsonl"
    env = {"device": "cpu", "torch": "2", "command": "python x"}
    lines = [{"model": "m", "variant": "eager", "step_ms": ms, "error": None, **env, "run_started": when}
             for ms, when in ((3.0, "2026-01-02"), (2.0, "2026-01-01"))]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    text = harness.table([path])
    assert "| m | eager | 3.00 | - |" in text and "2.00" not in text, "the newest run counts, not the last line"
    assert "- 2026-01-02, cpu, torch 2: `python x`" in text


def test_table_pools_the_repeats_of_the_newest_run(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    env = {"device": "cpu", "torch": "2", "command": "python x --repeats 3"}
    runs = [(9.0, None, "2026-01-01"), (3.0, None, "2026-01-02"), (1.0, None, "2026-01-02"),
            (None, "skipped: 5 s of the budget left", "2026-01-02"), (2.0, None, "2026-01-02")]  # fmt: skip
    lines = [{"model": "m", "variant": "fuse", "step_ms": ms, "step_ms_q1": ms, "error": error, **env,
              "run_started": when} for ms, error, when in runs]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    text = harness.table([path])
    header = next(line for line in text.splitlines() if line.startswith("| model"))
    assert header.endswith("| step_ms_range | repeats |")
    assert "| m | fuse | 2.00 | - | - | 1.00-3.00 | 3 |" in text, "the median of the three measured repeats"
    assert "9.00" not in text and "skipped" not in text


def test_zoo_in_a_child_process(cli_runs: dict) -> None:
    import zoo

    (record,) = _records(_finished(cli_runs["zoo"]))
    _check([record], zoo.FIELDS, 1)
    assert record["model"] == "gpt" and record["source"] == "recipes" and record["variant"] == "eager"
    assert record["step_ms"] > 0 and record["setup_s_warm"] > 0 and record["setup_s_cold"] is None
    assert record["peak_gb"] is None, "no CUDA: no peak memory"
    assert "--smoke --out" in record["command"]


def test_multi_gpu_ddp_on_gloo(cli_runs: dict) -> None:
    import multi_gpu

    records = _records(_finished(cli_runs["multi_gpu"]))
    _check(records, multi_gpu.FIELDS, 2)
    for record in records:
        assert record["strategy"] == "ddp" and record["world_size"] == 2 and record["step_ms"] > 0
        assert record["seed"] == 3, "the record names the initialisation and batches it ran"
        assert record["final_loss"] > 0
        assert record["loss_ranks"][0] != record["loss_ranks"][1], "each rank trains on its own batches"
        curves = record["loss_curves"]
        assert len(curves) == 2 and len(curves[0]) == len(curves[1]) > 1, "every rank's curve, gathered on rank zero"
        assert curves[0][-1] == pytest.approx(record["loss_ranks"][0], rel=0.5)
        assert record["loss_steps"] == pytest.approx(curves[0], rel=1e-3), "four steps: a block a step, rank zero's"
    full_precision, idle = records
    assert full_precision["eager_steps"] is None, "no FuseCallback, no step under force_eager"
    assert idle["eager_steps"] and set(idle["eager_steps"]) <= set(range(4)), "its eager reference steps, by number"
    assert full_precision["variant"] == "eager_fp32" and full_precision["plan"] is None
    assert idle["variant"] == "fuse_idle" and idle["plan"] == "eager", "the callback ran, and compiled nothing"
    assert idle["loss_curves"] == full_precision["loss_curves"], "on CPU both are eager in full precision"


def test_multi_gpu_checks_divide_only_default_fits_newest_rows_from_one_device(tmp_path: Path, capsys) -> None:
    import multi_gpu

    def row(model: str, variant: str, ms: float | None, device: str = "H200", **fields: Any) -> dict:
        return {"model": model, "strategy": "ddp", "batch_size": 8, "variant": variant, "step_ms": ms,
                "device": device, "run_started": "2026-11-02", **fields}  # fmt: skip

    records = [
        row("a", "eager", 40.0, step_ms_q1=38.0, step_ms_q3=42.0), row("a", "eager", 44.0),  # repeats: pooled
        row("a", "compile", 20.0, step_ms_q1=19.0, step_ms_q3=21.0),
        row("a", "fuse", 30.0, run_started="2026-11-01"),  # older: the newer fuse row below counts
        row("a", "fuse", 10.0, plan="compile+graph"),
        row("a", "fuse", 99.0, data="markov", scheduler=True),  # another fit: not the speed checks'
        row("b", "eager", 40.0), row("b", "compile", 30.0, device="H100"), row("b", "fuse", 44.0, plan="eager"),
        row("c", "eager", 40.0), row("c", "fuse", None, error="RuntimeError: boom"),
        row("c", "compile", None, error="skipped: 7 s of the budget left"),
    ]  # fmt: skip
    text = multi_gpu.checks(records)
    lines = text.splitlines()
    assert lines[2] == ("| a | ddp | 8 | 42.00 (40.00-44.00) | 20.00 (19.0-21.0) | 10.00 | compile+graph | 0.24 | 0.50 "
                        "| H200 |"), "the repeats' median and range; one fit's quartiles"
    assert lines[3] == "| b | ddp | 8 | 40.00 | 30.00 | 44.00 | eager | 1.10 | - | H100 / H200 |", "compile elsewhere"
    assert len(lines) == 6, "c's fuse crashed: no row of its own"
    assert lines[-1] == ("2 cases, 1 crashed fits (c ddp 8 fuse); fuse <= eager in 1 of 2; <= compile in 1 of 1, "
                         "geometric mean 0.50; 1 cases with a side on another device, left out of that ratio.")
    out = tmp_path / "multi_gpu.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert multi_gpu.main(["--checks", str(out)]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_multi_gpus_own_variants_run_a_variant_of_the_zoo_with_settings_fuse_accepts() -> None:
    import multi_gpu

    from lightning_fuse.options import FuseOptions

    for name, (variant, trainer_kw, fuse_kw) in multi_gpu.DERIVED.items():
        assert name in multi_gpu.VARIANTS and variant in models.VARIANTS
        assert set(trainer_kw) <= {"precision", "deterministic"}
        FuseOptions(**fuse_kw)  # raises on a setting FuseCallback refuses


def test_the_whole_steps_and_the_zoos_own_variants_run_fuse_with_settings_it_accepts() -> None:
    import whole_step
    import zoo

    from lightning_fuse.options import FuseOptions

    for benchmark in (whole_step, zoo):
        for name, (variant, fuse_kw) in benchmark.DERIVED.items():
            assert name in benchmark.VARIANTS and variant == "fuse"
            FuseOptions(**fuse_kw)  # raises on a setting FuseCallback refuses


def test_a_variant_with_matmul_flags_sets_them_for_every_benchmark_that_runs_it() -> None:
    import multi_gpu

    matmul = torch.backends.cuda.matmul  # no monkeypatch: its undo cannot find the flag torch computes
    before = matmul.allow_bf16_reduced_precision_reduction
    task, _ = models.build("gpt", 2, smoke=True, length=1)
    try:
        assert multi_gpu.apply_derived(task, "eager_exact_reductions", smoke=True, cache_dir=None) == ("eager", [], {})
        assert matmul.allow_bf16_reduced_precision_reduction is False
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


def test_rank_losses_keeps_every_steps_loss_and_names_the_steps_run_under_force_eager() -> None:
    import multi_gpu

    losses, trainer = multi_gpu.RankLosses(), SimpleNamespace(global_step=0)
    losses.on_before_optimizer_step(trainer, None, None)
    with torch.compiler.set_stance("force_eager"):  # as FuseCallback's eager reference steps run
        trainer.global_step = 1
        losses.on_before_optimizer_step(trainer, None, None)
    assert losses.eager_steps == [1]
    losses.losses = [torch.tensor(1.234567), torch.tensor(0.0123456)]
    assert losses.rounded() == [1.235, 0.01235], "four significant digits"


def test_a_variants_loss_gap_is_held_to_what_full_precision_moves_eager_by() -> None:
    import multi_gpu

    def record(variant: str, rank0: list[float], rank1: list[float], batch: int = 8, seed: int | None = None) -> dict:
        return {"model": "gpt", "strategy": "ddp", "batch_size": batch, "seed": seed, "variant": variant,
                "loss_curves": [rank0, rank1]}  # fmt: skip

    records = [record("eager", [4.0, 2.0], [4.0, 3.0]), record("eager_fp32", [4.0, 2.1], [4.0, 3.0]),
               record("fuse", [4.0, 2.0], [4.0, 3.3]), record("compile", [4.04, 2.0], [4.0, 3.0]),
               record("fuse", [1.0, 1.0], [1.0, 1.0], batch=32), {"variant": "eager", "loss_curves": None},
               record("eager", [4.0, 1.0], [4.0, 1.0], seed=2), record("fuse", [4.0, 1.5], [4.0, 1.0], seed=2)]
    records += [{**record(variant, [4.0, 2.0], [4.0, curve]), "device": "H200"}
                for variant, curve in (("eager", 3.0), ("fuse", 4.0))]  # newer, on another GPU
    records += [{**record(variant, [4.0, curve], [4.0, curve]), "data": "markov", "scheduler": True}
                for variant, curve in (("eager", 2.0), ("fuse", 2.2))]  # newer, another fit
    table = multi_gpu.loss_gaps(records).splitlines()
    assert table[0] == "| model | strategy | batch | seed | fit | device | eager_fp32 | compile | fuse |"
    assert table[2:] == ["| gpt | ddp | 8 | 0 | markov+lr | - | - | - | 0.10 |",
                         "| gpt | ddp | 8 | 0 | random | - | 0.05 | 0.01 (within) | 0.10 (beyond) |",
                         "| gpt | ddp | 8 | 0 | random | H200 | - | - | 0.33 |",
                         "| gpt | ddp | 8 | 2 | random | - | - | - | 0.50 |"], "rank 1 counts; own eager for each"


def test_a_variant_closer_to_full_precision_than_eager_is_within_against_full_precision() -> None:
    import multi_gpu

    curves = {"eager": [4.0, 2.4], "eager_fp32": [4.0, 2.0], "fuse": [4.0, 2.1], "compile": [4.0, 3.0]}
    records = [{"model": "gpt", "strategy": "ddp", "batch_size": 8, "variant": variant, "loss_curves": [curve]}
               for variant, curve in curves.items()]  # fmt: skip
    against_eager = multi_gpu.loss_gaps(records).splitlines()
    assert against_eager[-1] == "| gpt | ddp | 8 | 0 | random | - | 0.17 | 0.25 (beyond) | 0.12 (within) |"
    against_fp32 = multi_gpu.loss_gaps(records, against="eager_fp32").splitlines()
    assert against_fp32[0] == "| model | strategy | batch | seed | fit | device | eager | compile | fuse |"
    assert against_fp32[-1] == "| gpt | ddp | 8 | 0 | random | - | 0.20 | 0.50 (beyond) | 0.05 (within) |"


def test_fuse_within_counts_the_cases_that_judge_fuse_and_the_fits_that_learn_apart() -> None:
    import multi_gpu

    curves = {"random": {"eager": 2.4, "eager_fp32": 2.0, "fuse": 3.0}, "markov": {"eager": 2.4, "eager_fp32": 2.0,
                                                                                  "fuse": 2.1}}  # fmt: skip
    records = [{"model": "gpt", "strategy": "ddp", "batch_size": 8, "variant": variant, "loss_curves": [[4.0, end]],
                **({"data": "markov"} if fit == "markov" else {})}
               for fit, ends in curves.items() for variant, end in ends.items()]  # fmt: skip
    records.append({**records[-1], "model": "vit"})  # no eager of its own: nothing to judge it by
    assert multi_gpu.fuse_within(records, "eager_fp32") == (
        "fuse within in 1 of 2 cases; on fits that learn (Markov text), in 1 of 1.")  # fmt: skip
    assert multi_gpu.fuse_within(records) == "fuse within in 1 of 2 cases; on fits that learn (Markov text), in 1 of 1."


def test_where_eager_and_full_precision_agree_closer_than_bf16_a_gap_within_bf16s_tolerance_is_within() -> None:
    import multi_gpu

    curves = {"eager": [4.0, 2.0], "eager_fp32": [4.0, 2.001], "fuse": [4.0, 2.006], "compile": [4.0, 2.05]}
    records = [{"model": "gpt", "strategy": "ddp", "batch_size": 8, "variant": variant, "loss_curves": [curve]}
               for variant, curve in curves.items()]  # fmt: skip
    rows = {against: multi_gpu.loss_gaps(records, against=against).splitlines()[-1]
            for against in ("eager", "eager_fp32")}  # fmt: skip
    assert rows["eager"].endswith("| 0.0005 | 0.02 (beyond) | 0.003 (within) |"), "gaps under 0.01 keep two digits"
    assert rows["eager_fp32"].endswith("| 0.0005 | 0.02 (beyond) | 0.0025 (within) |")


def test_against_float32_reductions_every_variant_is_held_to_bf16s_rtol() -> None:
    import multi_gpu

    curves = {"eager_exact_reductions": [4.0, 2.0], "eager": [4.0, 2.2], "fuse": [4.0, 2.03],
              "eager_repeat": [4.0, 2.21]}  # fuse 1.5% away: within bf16's rtol (1.6%)
    records = [{"model": "gpt", "strategy": "ddp", "batch_size": 8, "variant": variant, "loss_curves": [curve]}
               for variant, curve in curves.items()]  # fmt: skip
    table = multi_gpu.loss_gaps(records, against="eager_exact_reductions").splitlines()
    assert table[0] == "| model | strategy | batch | seed | fit | device | eager | fuse | eager_repeat |", "no judge"
    assert table[-1] == "| gpt | ddp | 8 | 0 | random | - | 0.10 (beyond) | 0.01 (within) | 0.10 (beyond) |"


def test_by_epoch_lists_only_long_fits_and_leaves_unlogged_epochs_blank() -> None:
    import telemetry

    def record(epochs: int, logged: list) -> dict:
        return {"model": "gpt", "batch_size": 8, "epoch_steps": 200, "logged": 2.0, "logged_low": 1.8,
                "logged_high": 2.2, "independent": 2.0, "epochs": epochs, "logged_by_epoch": logged,
                "independent_by_epoch": [2.0] * epochs}  # fmt: skip

    assert telemetry.by_epoch([record(2, [[2.0, 1.8, 2.2, 0]] * 2)]) == "", "two epochs: the coverage table says all"
    long = {**record(3, [[None, None, None, None], [2.0, 1.8, 2.2, 1]]), "model": "bert"}
    rows = telemetry.by_epoch([long, record(4, [[2.0, 1.99, 2.01, 0]] * 4)]).splitlines()
    assert rows[0].endswith("| epoch 0 | epoch 1 | epoch 2 | epoch 3 |"), "as many columns as the longest fit"
    assert rows[2] == "| bert | 8 | 200 | fused | - | 10% (1) | - | - |", "an epoch without a logged interval: -"
    assert rows[3] == "| gpt | 8 | 200 | fused | 0.5% | 0.5% | 0.5% | 0.5% |", "under 1%: one decimal"


def test_coverage_reads_the_reference_cost_from_the_newest_record_without_in_fit_spins() -> None:
    import telemetry

    case = {"model": "gpt", "batch_size": 8, "epoch_steps": 1000, "logged": 7.0, "logged_low": 6.0,
            "logged_high": 8.0, "independent": 7.1}  # fmt: skip
    plain = {**case, "reference_cost_in_run": 0.016, "spin_ms_reference": None}
    spun = {**case, "reference_cost_in_run": 0.026, "spin_ms_reference": 4.0}
    table = telemetry.coverage([plain, spun]).splitlines()
    assert table[2].endswith("| 2.6%† |"), "the newest record's row, its cost marked as counting the spins"
    assert "reference cost <= 2% on 1000-step epochs 1 of the 1 that record it" in table[-1], "the older one's 1.6%"
    assert table[-1].endswith("the check reads the case's newest record without them.")
    assert "of the 0 that record it" in telemetry.coverage([spun]).splitlines()[-1], "spun alone: no cost to read"
    assert "†" not in telemetry.coverage([plain]), "nothing spun, no mark"


def test_markov_text_has_the_chains_structure_and_only_causal_lms_take_it() -> None:
    import models

    torch.manual_seed(0)
    text = torch.stack([b["input_ids"] for b in models.markov_batches(batch=4, seq=64, vocab=5000, count=8)])
    assert text.shape == (8, 4, 64) and text.unique().numel() <= models.MARKOV_TOKENS
    pairs = torch.stack([text[..., :-1].flatten(), text[..., 1:].flatten()], 1)
    followers = {int(a): set() for a in pairs[:, 0]}
    for a, b in pairs.tolist():
        followers[a].add(b)
    assert max(map(len, followers.values())) <= models.MARKOV_SUCCESSORS, "a token has more successors than the chain"
    task, _ = models.build("gpt2", 2, smoke=True, length=3, markov=3)
    assert len(task.data.batches) == 3 and task.data.batches[0]["labels"] is task.data.batches[0]["input_ids"]
    with pytest.raises(ValueError, match="causal LMs"):
        models.build("resnet18", 2, smoke=True, length=3, markov=3)


def test_gradients_held_to_full_precision_under_ddp_on_gloo(cli_runs: dict) -> None:
    import gradients

    (record,) = _records(_finished(cli_runs["gradients"]))
    _check([record], gradients.FIELDS, 1)
    assert record["strategy"] == "ddp" and record["world_size"] == 2 and record["checked"] == 6
    assert record["grad_err"] == record["eager_grad_err"] > 0, "eager is its own bf16 reference; CPU autocast rounds"
    assert record["grad_err_ratio"] == 1.0 and record["within"] is True
    assert [row[0] for row in record["step_errors"]] == list(range(6))


def test_gradients_of_the_compiled_variants_are_eagers_own(tmp_path: Path, in_process) -> None:
    import gradients

    out = tmp_path / "gradients.jsonl"
    assert gradients.main(["--smoke", "--models", "gpt", "--variants", "eager,compile,fuse_forced_graph",
                           "--check-every", "2", "--out", str(out)]) == 0  # fmt: skip
    records = _records(out)
    _check(records, gradients.FIELDS, 3)
    for record in records:
        assert record["checked"] == 3 and [row[0] for row in record["step_errors"]] == [0, 2, 4]
        assert record["within"] is True and record["grad_err_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert records[2]["plan"] == "regions", "the forced plan ran (no graph on a CPU)"


class _StaleGradients(pl.Callback):
    """A defect to catch: from the second step on, the optimizer sees the previous step's gradients."""

    def __init__(self) -> None:
        self.held: list[torch.Tensor] | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        params = [p for p in pl_module.model.parameters() if p.grad is not None]
        now = [p.grad.clone() for p in params]
        if self.held is not None:
            for p, old in zip(params, self.held):
                p.grad.copy_(old)
        self.held = now


def test_a_gradient_defect_is_beyond_and_named() -> None:
    import gradients

    task, loader = models.build("gpt", 2, smoke=True, length=4)
    check = gradients.GradientCheck()
    result = harness.fit(task, loader, steps=4, warmup=1, callbacks=[_StaleGradients(), check], accelerator="cpu",
                         precision="bf16-mixed")  # fmt: skip
    assert result["error"] is None
    summary = check.summary()
    first, *later = summary["step_errors"]
    assert first[1] == first[2], "the first step's gradients are the step's own"
    assert all(err > 10 * eager_err for _, err, eager_err in later), "stale gradients are far beyond rounding"
    assert summary["within"] is False and summary["grad_err_ratio"] > harness.WITHIN_RATIO
    assert summary["worst"] in dict(task.model.named_parameters())


def test_the_gradient_check_refuses_accumulation_and_a_zero_interval() -> None:
    import gradients

    task, loader = models.build("gpt", 2, smoke=True, length=4)
    result = harness.fit(task, loader, steps=2, warmup=1, callbacks=[gradients.GradientCheck()], accelerator="cpu",
                         accumulate_grad_batches=2)  # fmt: skip
    assert "accumulate_grad_batches=1" in result["error"]
    with pytest.raises(SystemExit):
        gradients.main(["--smoke", "--check-every", "0"])


def test_relative_errors_and_an_inconclusive_reference() -> None:
    import gradients

    one, two = torch.ones(2), torch.full((2,), 2.0)
    assert gradients.relative_errors([one, None, None], [two, None, one]) == [0.5, 0.0, float("inf")]
    check = gradients.GradientCheck()
    check.rows = [{"step": 0, "err": 0.9, "eager_err": 0.8, "worst": "w"}]
    assert check.summary()["within"] is None, "eager's own error is beyond INCONCLUSIVE: full precision tells nothing"
    check.rows = [{"step": 0, "err": 0.01, "eager_err": 0.02, "worst": "w"}]
    assert check.summary()["within"] is True and check.summary()["grad_err_ratio"] == 0.5


def test_a_record_names_the_commit_it_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine handed a copy of the tree may have a stale ``.git``: ``$BENCH_COMMIT`` names the commit sent."""
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    assert harness.environment()["commit"] == "abc1234"
    monkeypatch.delenv("BENCH_COMMIT")
    assert harness.environment()["commit"] != "abc1234"
