"""CPU smoke test of ``benchmarks/peers.py``: every code path on tiny models, 2 steps, the ``aot_eager`` backend.

Only the CUDA-only measurements (CUDA events, NVML utilisation, peak memory, CUDA graphs) are absent on CPU: timing
falls back to ``time.perf_counter`` and those fields stay ``None``.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import peers

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--tiny", "--backend", "aot_eager"]


@pytest.fixture
def restore_torch_settings():
    """The measuring code sets process-wide torch settings; put them back for the other tests."""
    limit, precision = torch._dynamo.config.recompile_limit, torch.get_float32_matmul_precision()
    yield
    torch._dynamo.config.recompile_limit = limit
    torch.set_float32_matmul_precision(precision)


def _records(text: str) -> list[dict]:
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "record"]


def test_steps_and_setup_in_process(tmp_path: Path, restore_torch_settings) -> None:
    out = io.StringIO()
    argv = ["steps", "--model", "gpt", "--batch", "2", "--variants", "eager,fuse", "--cache", str(tmp_path),
            "--steps", "2", "--warmup", "1", *TINY]  # fmt: skip
    assert peers.main(argv, results=out) == 0
    records = {r["variant"]: r for r in _records(out.getvalue())}
    assert set(records) == {"eager", "fuse"}
    for rec in records.values():
        assert rec["error"] is None, rec["error"]
        assert rec["timing"] == "perf_counter" and rec["timed_steps"] == 2 and rec["step_ms"] > 0
        assert rec["iter_ms"] > 0 and rec["first_step_s"] > 0
        assert rec["gpu_util"] is None and "peak_mem_gb" not in rec  # CUDA-only
        for key in ("device", "torch", "lightning", "triton", "measure_command"):
            assert key in rec
    fuse = records["fuse"]["fuse"]
    assert fuse["compiled_regions"] == fuse["regions"] == 2 and not fuse["fallbacks"], fuse
    assert (tmp_path / "gpt-tiny-2" / "fuse" / "fuse").is_dir(), "fuse's cache_dir is the run's cache dir"

    out = io.StringIO()
    argv = ["setup", "--model", "resnet", "--batch", "2", "--variant", "eager", "--cache", str(tmp_path),
            "--steps", "2", *TINY]  # fmt: skip
    assert peers.main(argv, results=out) == 0
    (rec,) = _records(out.getvalue())
    assert rec["error"] is None, rec["error"]
    assert rec["model"] == "resnet" and 0 < rec["setup_s"] <= rec["ready_s"]

    import peers_measure
    from recipes.models import resnet18_cifar

    net = resnet18_cifar()
    blocks = peers_measure.regional_blocks(net, "resnet")
    assert len(blocks) == 8 and {type(b).__name__ for b in blocks} == {"BasicBlock"}, "layer1..layer4, 2 each"


def test_loss_check_in_process(tmp_path: Path, restore_torch_settings) -> None:
    out = io.StringIO()
    argv = ["loss", "--model", "gpt", "--batch", "2", "--steps", "6", "--cache", str(tmp_path), *TINY]
    assert peers.main(argv, results=out) == 0
    (rec,) = _records(out.getvalue())
    assert rec["error"] is None, rec["error"]
    assert rec["kind"] == "loss" and rec["variant"] == "loss_check"
    assert rec["eager_first_loss"] == pytest.approx(rec["fuse_first_loss"], rel=1e-3), "same seed, same data"
    assert rec["agree"] is True and rec["rel_diff"] < rec["tolerance"]


def test_run_end_to_end(tmp_path: Path) -> None:
    """The orchestration: cold + warm setup in fresh processes, a steps process, the JSON file and the table."""
    argv = [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "run", "--out", str(tmp_path), "--regimes",
            "gpt:2", "--variants", "eager,fuse", "--steps", "2", "--warmup", "1", "--setup-steps", "2", "--no-loss",
            "--budget-s", "150", "--cache", str(tmp_path / "cache"), *TINY]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fuse never slower than eager" in done.stdout, done.stdout
    (path,) = tmp_path.glob("*.json")
    records = {r["variant"]: r for r in json.loads(path.read_text())}
    assert set(records) == {"eager", "fuse"}
    for rec in records.values():
        assert rec["error"] is None, rec["error"]
        for key in ("model", "batch_size", "variant", "step_ms", "setup_s_cold", "setup_s_warm", "peak_mem_gb",
                    "gpu_util", "device", "torch", "lightning", "triton", "command"):  # fmt: skip
            assert key in rec
        assert rec["step_ms"] > 0 and rec["command"].startswith("python benchmarks/peers.py run")
    fuse = records["fuse"]
    assert fuse["setup_s_cold"] > 0 and fuse["setup_s_warm"] > 0 and fuse["setup_at_batch"] == 2
    assert fuse["cache_state"].startswith("warm")
    assert records["eager"]["setup_s_cold"] is None  # eager compiles nothing
    assert not list((tmp_path / "cache").iterdir()), "the run's caches are removed at the end"
    assert (tmp_path / "logs" / "cold-gpt-2-fuse.log").exists()


def _synthetic() -> list[dict]:
    """Two regimes of one model as a GPU run would write them, with known verdicts."""
    common = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "lightning": "2.6.6", "triton": "3.6.0",
              "cuda": "13.0", "python": "3.12", "command": "python benchmarks/peers.py run --out x", "kind": "step",
              "timing": "cuda_events", "warmup_steps": 15, "timed_steps": 100, "model": "gpt"}  # fmt: skip
    small = {"eager": 22.0, "compile": 14.0, "reduce_overhead": 5.0, "regional": 24.0, "fuse": 3.9,
             "eager_callback": 22.1, "fuse_full_autotune_graph": None}  # fmt: skip
    large = {"eager": 27.0, "compile": 16.0, "reduce_overhead": None, "regional": 26.0, "fuse": 15.0}
    setups = {"compile": (30.0, 3.0), "reduce_overhead": (21.0, 2.4), "regional": (5.0, 1.0), "fuse": (13.0, 2.0)}
    records = []
    for batch, table in ((8, small), (64, large)):
        for variant, ms in table.items():
            cold, warm = setups.get(variant, (None, None))
            records.append({**common, "batch_size": batch, "variant": variant, "step_ms": ms, "iter_ms": ms and ms + 1,
                            "setup_s_cold": cold, "setup_s_warm": warm, "setup_at_batch": 8 if cold else None,
                            "peak_mem_gb": 1.5, "gpu_util": 50.0,
                            "error": None if ms else "OutOfMemoryError: CUDA out of memory"})  # fmt: skip
    records.append({**common, "kind": "loss", "variant": "loss_check", "batch_size": 8, "steps": 200, "window": 20,
                    "eager_loss": 1.50, "fuse_loss": 1.51, "rel_diff": 0.0067, "agree": True, "tolerance": 0.02,
                    "eager_first_loss": 9.1, "fuse_first_loss": 9.1, "data": "text"})  # fmt: skip
    return records


def test_report_on_synthetic_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nvidia-h100-80gb-hbm3.json"
    path.write_text(json.dumps(_synthetic()))
    assert peers.main(["report", str(path)]) == 0
    text = capsys.readouterr().out
    assert "### GPT-8L, batch 8" in text and "### GPT-8L, batch 64" in text
    assert "| **fuse** | 3.90 | 4.90 | 5.64x | 0.78x | 13.0 | 2.0 |" in text, "vs eager 22/3.9, vs best (RO) 3.9/5"
    assert "OutOfMemoryError" in text, "a crashed variant shows its error"
    verdicts = [line for line in text.splitlines() if line.startswith(("- **PASS", "- **FAIL", "- **MISSING"))]
    assert verdicts[0].startswith("- **PASS** fuse step <= 0.80x best alternative (small batch)"), "3.9 <= 0.8 x 5.0"
    assert verdicts[1].startswith("- **PASS** fuse never slower than eager")
    assert verdicts[2].startswith("- **PASS** fuse cold setup"), "13.0 s <= 0.5 x 30.0 s"
    assert verdicts[3].startswith("- **PASS** fuse warm setup"), "2.0 s <= 0.25 x 13.0 s"
    assert verdicts[4].startswith("- **PASS** callback overhead"), "22.1 vs 22.0 ms is +0.45%"
    assert verdicts[5].startswith("- **FAIL** fuse step <= 0.87x best alternative (large batch)"), "15/16 = 0.94x"
    assert verdicts[6].startswith("- **PASS** fuse never slower than eager")
    assert "- setup targets: measured at bs 8, see there" in text
    assert "**PASS** learning check" in text
    assert text.splitlines()[2].startswith("Targets: 7 PASS, 1 FAIL")
    assert "python benchmarks/peers.py run --out x" in text, "the exact command is in the report"


def test_argument_validation() -> None:
    with pytest.raises(SystemExit):
        peers.main(["run", "--out", "x", "--variants", "eager,fast"])
    with pytest.raises(SystemExit):
        peers.main(["run", "--out", "x", "--regimes", "vit:8"])
    assert peers._variants("fuse,eager") == ["eager", "fuse"], "canonical order, eager first"
    assert peers._regimes("gpt:8, resnet:16") == [("gpt", 8), ("resnet", 16)]


def test_process_check_alternates_plain_and_fuse_fits(tmp_path: Path) -> None:
    """``process_check.py`` on CPU: a plain fit's steps are all labelled compiled, a fuse fit has its eager chunks."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "process_check.py"), "--out", str(tmp_path), "--tiny",
           "--backend", "aot_eager", "--batch", "4", "--steps", "60", "--order", "plain,fuse",
           "--cache", str(tmp_path / "cache")]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=600)
    (record,) = [json.loads(line) for line in (tmp_path / "process_check.jsonl").read_text().splitlines()]
    plain, fuse = record["fits"]
    assert plain["fit"] == "plain" and set(plain) == {"fit", "wall_s", "children_cpu_s", "compiled"}
    assert fuse["fit"] == "fuse" and fuse["eager"] > 0 and fuse["compiled"] > 0
    assert record["steps"] == 60 and "process_check.py" in record["command"]
