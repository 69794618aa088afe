"""Tests for lightning_fuse.report: the ``lightning-fuse report`` command on recorded (synthetic) TensorBoard runs.

The runs are written the way FuseCallback and the recipes write them: ``fuse/`` scalars with step = epoch, the
end-of-fit ``fuse/summary`` text, and Hydra's ``.hydra/overrides.yaml`` beside the ``tb/`` folder.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from lightning_fuse.__main__ import main
from lightning_fuse.report import format_table, plot_runs, summarise
from lightning_fuse.runs import NoRunsError, Run, load_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(directory: Path, scalars: dict[str, list[float]], texts: dict[str, str] | None = None) -> None:
    """Log ``scalars`` (tag -> one value per epoch) the way FuseCallback does: step = epoch; then ``texts``."""
    writer = SummaryWriter(log_dir=str(directory))
    for tag, values in scalars.items():
        for epoch, value in enumerate(values):
            writer.add_scalar(tag, value, global_step=epoch)
    for tag, text in (texts or {}).items():
        writer.add_text(tag, text, global_step=len(next(iter(scalars.values()), [])))
    writer.close()


def _hydra_run(folder: Path, overrides: list[str], scalars: dict[str, list[float]], **texts: str) -> Path:
    """A recipe run: ``folder/.hydra/overrides.yaml`` and the events in ``folder/tb``, as recipes/train.py writes."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {item}\n" for item in overrides) or "[]\n")
    _write_run(folder / "tb", scalars, {f"fuse/{tag}": text for tag, text in texts.items()})
    return folder / "tb"


def _md_rows(output: str) -> dict[str, dict[str, str]]:
    """The rows of a markdown table in ``output``, by run name, as {header: cell}."""
    lines = [line for line in output.splitlines() if line.startswith("|")]
    split = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return {row[0]: dict(zip(split[0], row)) for row in split[2:]}


def _report_md(*paths: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, dict[str, str]], str]:
    assert main(["report", *map(str, paths), "--format", "md"]) == 0
    out = capsys.readouterr().out
    return _md_rows(out), out


@pytest.fixture
def two_logdirs(tmp_path: Path) -> tuple[Path, Path]:
    """dir1 is a GPU run itself; dir2 holds a CPU run (no GPU metrics) two levels down, and a non-fuse run."""
    dir1, dir2 = tmp_path / "gpu_run", tmp_path / "experiments"
    _write_run(
        dir1,
        {
            "fuse/speedup": [1.1, 1.5, 1.3],
            "fuse/step_ms": [12.0, 10.0, 11.0],
            "fuse/gpu_util": [80.0, 95.0, 90.0],
            "fuse/mfu": [0.30, 0.42, 0.40],
            "fuse/compile_s": [20.0, 21.5, 21.5],
            "train_loss": [3.0, 2.0, 1.0],
        },
    )
    _write_run(
        dir2 / "cpu" / "version_0",
        {"fuse/speedup": [2.0, 0.9, 1.8], "fuse/step_ms": [5.0, 4.0, 4.5], "fuse/compile_s": [3.0, 3.0, 3.0]},
    )
    _write_run(dir2 / "baseline", {"train_loss": [1.0, 0.5]})
    return dir1, dir2


def test_report_table(two_logdirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    dir1, dir2 = two_logdirs
    assert main(["report", str(dir1), str(dir2)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for column in ("run", "status", "epochs", "speedup", "step ms", "GPU util %", "MFU %", "compile s"):
        assert column in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == {"gpu_run", "cpu/version_0"}, "runs are named below their LOGDIR; non-fuse runs skipped"
    assert rows["gpu_run"] == ["gpu_run", "-", "3", "1.30x", "11.00", "90", "40.0", "21.5"]
    assert rows["cpu/version_0"] == ["cpu/version_0", "-", "3", "1.80x", "4.50", "-", "-", "3.0"]


def test_a_cpu_only_table_has_no_gpu_columns(two_logdirs: tuple[Path, Path], capsys) -> None:
    rows, out = _report_md(two_logdirs[1], capsys=capsys)
    assert "GPU util" not in out and "MFU" not in out
    assert rows["cpu/version_0"]["speedup"] == "1.80x"


def test_runs_are_named_by_their_hydra_overrides_or_logger_folders(tmp_path: Path, capsys) -> None:
    sweep = tmp_path / "multirun" / "2026-01-05" / "10-31-02"
    scalars = {"fuse/speedup": [2.0], "fuse/compiled": [1.0]}
    _hydra_run(sweep / "0", ["fuse=auto", "experiment=small_batch"], scalars)
    _hydra_run(sweep / "1", [], scalars)
    _write_run(tmp_path / "multirun" / "lightning_logs" / "version_3", scalars)  # a plain Lightning run
    _write_run(tmp_path / "multirun" / "2026-01-06" / "0" / "tb", scalars)  # a sweep job whose .hydra was deleted
    rows, _ = _report_md(tmp_path / "multirun", capsys=capsys)
    expected = {"fuse=auto experiment=small_batch", "(defaults)", "lightning_logs/version_3", "2026-01-06/0/tb"}
    assert set(rows) == expected
    # pointing at the tb folder itself finds the overrides one folder up
    assert [run.name for run in load_runs([sweep / "0" / "tb"])] == ["fuse=auto experiment=small_batch"]


def test_overrides_every_run_shares_are_said_once_above_the_table(tmp_path: Path, capsys) -> None:
    scalars = {"fuse/speedup": [2.0], "fuse/compiled": [1.0]}
    for job, fuse in enumerate(("auto", "measure_only")):
        _hydra_run(tmp_path / str(job), ["model=gpt", f"fuse={fuse}", "trainer.max_steps=50"], scalars)
    rows, out = _report_md(tmp_path, capsys=capsys)
    assert set(rows) == {"fuse=auto", "fuse=measure_only"}
    assert out.startswith("Overrides of every run: model=gpt trainer.max_steps=50\n")


def test_runs_sharing_a_name_get_their_path(tmp_path: Path) -> None:
    scalars = {"fuse/speedup": [2.0]}
    first, second = (_hydra_run(tmp_path / name, ["fuse=auto"], scalars) for name in "ab")
    names = [run.name for run in load_runs([first, second])]
    assert names == [f"(shared overrides only) [{first}]", f"(shared overrides only) [{second}]"]
    assert [run.name for run in load_runs([tmp_path])] == names  # one LOGDIR holding both


def test_dropped_measure_only_and_never_compiled_runs_are_flagged(tmp_path: Path, capsys) -> None:
    _hydra_run(  # the plan ran epochs 0-1 and was dropped at the end of epoch 1, which logs the drop
        tmp_path / "dropped", ["fuse=auto", "run=dropped"],
        {"fuse/speedup": [2.0, 2.4, 1.0, 1.0], "fuse/step_ms": [5.0, 4.0, 10.0, 10.0],
         "fuse/compiled": [1, 1, 0, 0], "fuse/plan_dropped": [0, 1, 1, 1]},
    )  # fmt: skip
    _hydra_run(  # an older run: no fuse/compiled, but its summary text says when the plan was dropped
        tmp_path / "dropped_text", ["run=dropped_text"], {"fuse/speedup": [3.0, 0.8, 1.0], "fuse/step_ms": [3.0] * 3},
        summary="**FuseCallback** plan: regions: torch.compile(mode=default); CUDA graph: off (measured 0.80x of "
        "eager: eager from epoch 2)",
    )  # fmt: skip
    eager = {"fuse/speedup": [1.01, 0.99], "fuse/step_ms": [10.0, 10.4], "fuse/compiled": [0, 0]}
    _hydra_run(tmp_path / "measure", ["fuse=measure_only"], eager)
    _hydra_run(tmp_path / "measure_text", ["run=measure_text"], eager, summary="plan: measure only (eager, timed)")
    _hydra_run(tmp_path / "eager", ["run=never"], eager)
    rows, out = _report_md(tmp_path, capsys=capsys)
    dropped = rows["fuse=auto run=dropped"]
    assert (dropped["status"], dropped["epochs"], dropped["speedup"]) == ("dropped in epoch 1", "2/4", "2.2x")
    assert dropped["step ms"] == "4.50", "medians pool only the epochs that ran the compiled plan"
    legacy = rows["run=dropped_text"]
    assert (legacy["status"], legacy["epochs"], legacy["speedup"]) == ("dropped in epoch 1", "2/3", "1.90x")
    assert (legacy["plan"], dropped["plan"]) == ("regions", "-"), "the plan its summary names (none: no summary)"
    for name in ("fuse=measure_only", "run=measure_text"):
        assert (rows[name]["status"], rows[name]["speedup"], rows[name]["step ms"]) == ("measure only", "-", "10.20")
        assert rows[name]["plan"] == "eager"
    assert (rows["run=never"]["status"], rows["run=never"]["speedup"]) == ("never compiled", "-")
    assert "dropped in epoch N: the plan measured slower than eager" in out
    assert "measure only: an eager run" in out and "never compiled: every epoch ran eagerly" in out


def test_measure_only_is_read_from_the_hydra_config_too(tmp_path: Path) -> None:
    tb = _hydra_run(tmp_path / "custom", ["fuse=mine"], {"fuse/speedup": [1.0], "fuse/step_ms": [9.0]})
    (tmp_path / "custom" / ".hydra" / "config.yaml").write_text("fuse:\n  targets: []\n  cuda_graph: false\n")
    assert summarise(load_runs([tb])[0])["status"] == "measure only"


def test_medians_pool_only_the_compiled_epochs_and_show_the_interval(tmp_path: Path, capsys) -> None:
    _hydra_run(  # epoch 2 ran eagerly without a drop (e.g. the plan was being measured): it is left out
        tmp_path / "run", ["fuse=auto"],
        {"fuse/speedup": [3.3, 3.5, 1.0, 3.4], "fuse/speedup_low": [3.1, 3.3, 0.9, 3.2],
         "fuse/speedup_high": [3.5, 3.7, 1.1, 3.6], "fuse/step_ms": [3.0, 2.9, 10.0, 3.1],
         "fuse/compiled": [1, 1, 0, 1]},
    )  # fmt: skip
    rows, _ = _report_md(tmp_path, capsys=capsys)
    assert rows["fuse=auto"]["speedup"] == "3.4x (3.2-3.6)"
    assert (rows["fuse=auto"]["status"], rows["fuse=auto"]["epochs"], rows["fuse=auto"]["step ms"]) == (
        "compiled", "3/4", "3.00",
    )  # fmt: skip


def test_a_finished_run_whose_summary_says_nothing_of_a_drop_compiled(tmp_path: Path) -> None:
    tb = _hydra_run(tmp_path / "r", [], {"fuse/speedup": [2.0, 2.2]}, summary="**FuseCallback** plan: regions: ...")
    assert summarise(load_runs([tb])[0])["status"] == "compiled"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    return struct.unpack(">II", data[16:24])


def test_report_plot_has_a_gpu_panel_only_with_gpu_data(two_logdirs: tuple[Path, Path], tmp_path: Path) -> None:
    both, cpu = tmp_path / "both.png", tmp_path / "cpu.png"
    assert main(["report", *map(str, two_logdirs), "--plot", str(both)]) == 0
    assert main(["report", str(two_logdirs[1]), "--plot", str(cpu)]) == 0
    (wide, _), (narrow, _) = _png_size(both), _png_size(cpu)
    assert wide > 1.5 * narrow, "two panels with GPU data, the speedup panel alone without"


def test_a_plot_without_a_path_goes_beside_the_runs(two_logdirs: tuple[Path, Path], tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where one stands (the repository root in the quickstart) stays clean
    assert main(["report", str(two_logdirs[1]), "--plot"]) == 0
    assert (two_logdirs[1] / "fuse.png").is_file() and not (tmp_path / "fuse.png").exists()


def test_plot_of_flagged_runs(tmp_path: Path) -> None:
    png = tmp_path / "flagged.png"
    runs = [
        Run("eager", tmp_path, {"speedup": {0: 1.0}, "compiled": {0: 0.0}}),
        Run("dropped", tmp_path, {"speedup": {0: 2.0, 1: 1.0}, "compiled": {0: 1, 1: 0}, "plan_dropped": {1: 1}}),
    ]
    plot_runs(runs, png)
    assert _png_size(png)[0] > 0


def test_without_tensorboard_the_report_says_what_to_install(two_logdirs, monkeypatch, capsys) -> None:
    import importlib.util

    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing", None)  # tensorboard is broken ...
    assert main(["report", str(two_logdirs[0])]) == 2
    assert 'pip install "lightning-fuse[report]"' in capsys.readouterr().err
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)  # ... or not installed at all
    assert main(["report", str(two_logdirs[0])]) == 2
    assert 'needs tensorboard: pip install "lightning-fuse[report]"' in capsys.readouterr().err


def test_a_folder_without_event_files_says_to_log_to_tensorboard(tmp_path: Path, capsys) -> None:
    (tmp_path / "csv" / "version_0").mkdir(parents=True)
    (tmp_path / "csv" / "version_0" / "metrics.csv").write_text("epoch,fuse/speedup\n0,2.0\n")
    assert main(["report", str(tmp_path)]) == 1
    assert "no TensorBoard event files at all" in capsys.readouterr().err


def test_empty_folder_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_run(tmp_path / "plain", {"train_loss": [1.0]})  # event files, but no fuse/ scalars
    assert main(["report", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"no fuse/ scalars found under {tmp_path}" in captured.err
    assert "outputs/<date>/<time>" in captured.err


def test_missing_path_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert main(["report", str(missing)]) == 2
    assert f"{missing} does not exist" in capsys.readouterr().err


def test_unwritable_plot_exits_2(two_logdirs: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    assert main(["report", str(two_logdirs[0]), "--plot", str(tmp_path / "no" / "dir" / "x.png")]) == 2
    assert "cannot write the plot" in capsys.readouterr().err


def test_summarise_and_rerun_epoch(tmp_path: Path) -> None:
    _write_run(tmp_path, {"fuse/speedup": [1.0, 1.2], "fuse/compile_s": [10.0, 12.0]})
    _write_run(tmp_path, {"fuse/speedup": [1.0, 1.6]})  # a resumed run logs epoch 1 again: the later value wins
    (run,) = load_runs([tmp_path])
    summary = summarise(run)
    assert run.series("speedup")[1][1] == pytest.approx(1.6)
    assert summary["epochs"] == "2"
    assert summary["compile_s"] == 12.0
    assert summary["gpu_util"] is None and summary["mfu_pct"] is None


def test_load_runs_raises_for_empty_logdir(tmp_path: Path) -> None:
    with pytest.raises(NoRunsError, match="no fuse/ scalars found"):
        load_runs([tmp_path])


def test_format_table_rejects_unknown_format() -> None:
    with pytest.raises(ValueError, match="'text' or 'md'"):
        format_table([], fmt="html")

