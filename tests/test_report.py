"""Tests for lightning_fuse.report: the ``lightning-fuse report`` command on synthetic TensorBoard runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from lightning_fuse.report import NoRunsError, Run, format_table, load_runs, main, plot_runs, summarise

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(directory: Path, scalars: dict[str, list[float]]) -> None:
    """Log ``scalars`` (tag -> one value per epoch) the way FuseCallback does: step = epoch."""
    writer = SummaryWriter(log_dir=str(directory))
    for tag, values in scalars.items():
        for epoch, value in enumerate(values):
            writer.add_scalar(tag, value, global_step=epoch)
    writer.close()


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


def _data_lines(output: str) -> dict[str, list[str]]:
    """Table rows of text output by run name (header and rule skipped)."""
    return {line.split()[0]: line.split() for line in output.splitlines()[2:]}


def test_report_table(two_logdirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    dir1, dir2 = two_logdirs
    assert main(["report", str(dir1), str(dir2)]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    for column in ("run", "epochs", "speedup", "step ms", "GPU util %", "MFU %", "compile s"):
        assert column in header
    rows = _data_lines(out)
    assert set(rows) == {"gpu_run", "cpu/version_0"}, "runs are named relative to their LOGDIR; non-fuse runs skipped"
    assert rows["gpu_run"] == ["gpu_run", "3", "1.30x", "11.00", "90", "40.0", "21.5"]
    assert rows["cpu/version_0"] == ["cpu/version_0", "3", "1.80x", "4.50", "-", "-", "3.0"]


def test_report_markdown(two_logdirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", *map(str, two_logdirs), "--format", "md"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| run ") and lines[0].endswith(" |")
    assert set(lines[1]) <= set("|-: ")
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert ["gpu_run", "3", "1.30x", "11.00", "90", "40.0", "21.5"] in cells
    assert len(cells) == 2


def test_report_plot(two_logdirs: tuple[Path, Path], tmp_path: Path) -> None:
    png = tmp_path / "fuse.png"
    assert main(["report", *map(str, two_logdirs), "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert png.stat().st_size > 10_000


def test_plot_without_gpu_metrics(tmp_path: Path) -> None:
    png = tmp_path / "cpu.png"
    plot_runs([Run("cpu", tmp_path, {"speedup": {0: 1.2, 1: 1.3}})], png)  # the GPU panel says it has no data
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_empty_folder_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_run(tmp_path / "plain", {"train_loss": [1.0]})  # event files, but no fuse/ scalars
    assert main(["report", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"no fuse/ scalars found under {tmp_path}" in captured.err
    assert "outputs/<date>/<time>/tb" in captured.err


def test_missing_path_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert main(["report", str(missing)]) == 2
    assert f"{missing} does not exist" in capsys.readouterr().err


def test_unwritable_plot_exits_2(two_logdirs: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    assert main(["report", str(two_logdirs[0]), "--plot", str(tmp_path / "no" / "dir" / "x.png")]) == 2
    assert "cannot write the plot" in capsys.readouterr().err


def test_same_names_fall_back_to_given_paths(tmp_path: Path) -> None:
    first, second = tmp_path / "a" / "tb", tmp_path / "b" / "tb"
    _write_run(first, {"fuse/speedup": [1.0]})
    _write_run(second, {"fuse/speedup": [2.0]})
    assert [run.name for run in load_runs([first, second])] == [str(first), str(second)]


def test_summarise_and_rerun_epoch(tmp_path: Path) -> None:
    _write_run(tmp_path, {"fuse/speedup": [1.0, 1.2], "fuse/compile_s": [10.0, 12.0]})
    _write_run(tmp_path, {"fuse/speedup": [1.0, 1.6]})  # a resumed run logs epoch 1 again: the later value wins
    (run,) = load_runs([tmp_path])
    summary = summarise(run)
    assert run.series("speedup")[1][1] == pytest.approx(1.6)
    assert summary["epochs"] == 2
    assert summary["compile_s"] == 12.0
    assert summary["gpu_util"] is None and summary["mfu_pct"] is None


def test_load_runs_raises_for_empty_logdir(tmp_path: Path) -> None:
    with pytest.raises(NoRunsError, match="no fuse/ scalars found"):
        load_runs([tmp_path])


def test_format_table_rejects_unknown_format() -> None:
    with pytest.raises(ValueError, match="'text' or 'md'"):
        format_table([], fmt="html")


def test_speedup_check_pools_runs_and_flags_a_gap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import speedup_check as check

    for name, step, eager in (("fuse_1", 5.0, 18.0), ("fuse_2", 5.0, 22.0)):  # two runs on a drifting machine
        epochs = {"step_ms": [step, step, 9.0], "eager_step_ms": [eager] * 3}  # a slow epoch: the median skips it
        epochs["speedup"] = [eager / ms for ms in epochs["step_ms"]]
        _write_run(tmp_path / name, {f"fuse/{tag}": values for tag, values in epochs.items()})
    _write_run(tmp_path / "eager_1", {"fuse/step_ms": [17.6] * 3})  # each near its fuse run's in-run eager steps
    _write_run(tmp_path / "eager_2", {"fuse/step_ms": [21.9] * 3})
    _write_run(tmp_path / "eager_slow", {"fuse/step_ms": [24.0] * 3})  # 20% off
    fuse = f"{tmp_path / 'fuse_1'},{tmp_path / 'fuse_2'}"
    assert check.main([f"ok={fuse}:{tmp_path / 'eager_1'},{tmp_path / 'eager_2'}"]) == 0
    out = capsys.readouterr().out
    assert "| ok | 2 + 2 | 5.00 | 19.90 | 19.63 | 3.98x | 3.93x | 1.4% | PASS |" in out
    assert "| ok | fuse | fuse_2 | 5.00 | 22.00 | 4.40 |" in out  # each run's own medians
    assert "| ok | eager-only | eager_1 | 17.60 | - | - |" in out
    assert check.main([f"off={fuse}:{tmp_path / 'eager_slow'}"]) == 1
    assert "FAIL" in capsys.readouterr().out
