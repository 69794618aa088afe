"""The persistent compile cache: keys, environment, artifacts, and a measurably warm second process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_fuse.cache import ARTIFACTS, CompileCache, cache_key
from tests.toy import Block, Net

ROOT = Path(__file__).resolve().parents[1]


def test_key_changes_with_the_compiled_code_and_device():
    cpu = torch.device("cpu")
    assert cache_key([Block(4)], cpu) == cache_key([Block(8), Block(4)], cpu)  # same class, same code
    assert cache_key([Block(4)], cpu) != cache_key([Net()], cpu)
    assert cache_key([Block(4)], cpu) != cache_key([Block(4)], torch.device("meta"))
    assert cache_key([Block(4)], cpu, ["plan a"]) != cache_key([Block(4)], cpu, ["plan b"])


def test_activation_points_inductor_and_triton_into_the_directory_and_restores(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    cache = CompileCache(tmp_path, ["k"])
    with cache.activated():
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "k" / "inductor")
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "k" / "triton")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"
    assert "TRITON_CACHE_DIR" not in os.environ


def test_missing_or_corrupt_artifacts_mean_a_cold_start_not_a_crash(tmp_path):
    cache = CompileCache(tmp_path, ["k"])
    assert cache.load() is False
    cache.artifacts_path.parent.mkdir(parents=True)
    cache.artifacts_path.write_bytes(b"\x00not a cache")
    with pytest.warns(UserWarning, match="ignoring the compile cache artifacts"):
        assert cache.load() is False


def test_cache_dir_that_is_a_file_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="`cache_dir` must be a directory"):
        CompileCache(blocker, ["k"])


@pytest.mark.inductor
def test_second_process_with_the_same_cache_dir_starts_warm(tmp_path):
    def run() -> dict:
        env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        done = subprocess.run([sys.executable, str(ROOT / "tests" / "cache_run.py"), str(tmp_path)],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold = run()
    warm = run()
    print(f"cold: {cold}\nwarm: {warm}")
    assert cold["artifacts"] and not cold["loaded"] and cold["cache_misses"] > 0
    assert warm["loaded"] and warm["cache_hits"] > 0
    assert warm["compile_s"] < 0.7 * cold["compile_s"]
    assert len(list(tmp_path.glob(f"*/{ARTIFACTS}"))) == 1  # one key directory, one artifacts file
