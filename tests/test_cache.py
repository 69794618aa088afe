"""The persistent compile cache: keys, environment, artifacts, and a measurably warm second process."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from lightning_fuse import FuseCallback
from lightning_fuse import cache as cache_module
from lightning_fuse.cache import ARTIFACTS, CacheCounts, CompileCache, cache_counters, cache_key
from tests.toy import Block, Net, ToyTask, trainer

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


def test_graphs_the_autograd_cache_bypassed_are_counted_and_named_with_how_to_see_why(tmp_path, monkeypatch,
                                                                                     recwarn):  # fmt: skip
    counters = {"inductor": Counter(fxgraph_cache_hit=2), "aot_autograd": Counter(autograd_cache_bypass=3)}
    monkeypatch.setattr(cache_module, "dynamo_counters", lambda: counters)
    cache, start = CompileCache(tmp_path, ["k"]), cache_counters()
    assert start == CacheCounts(hits=2, misses=0, bypasses=3)
    counters["inductor"]["fxgraph_cache_hit"] += 1
    cache.warn_if_bypassed(since=start)  # a hit is no bypass
    assert not recwarn.list
    counters["aot_autograd"]["autograd_cache_bypass"] += 2
    assert cache_counters().since(start) == CacheCounts(hits=1, misses=0, bypasses=2)
    with pytest.warns(UserWarning, match=r"would not store 2 of this fit's compiled graph.*TORCH_LOGS=aot"):
        cache.warn_if_bypassed(since=start)


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _DoubledBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Doubled.apply(super().forward(x))


class _DoublingTask(ToyTask):
    def __init__(self) -> None:
        super().__init__()
        self.model = Net(block=_DoubledBlock)


@pytest.mark.inductor
def test_a_fit_whose_network_calls_an_autograd_function_warns_that_its_warm_start_compiles_again(tmp_path):
    fuse = FuseCallback(cache_dir=tmp_path, mode="default", eager_steps=0)
    with pytest.warns(UserWarning, match=r"AOTAutograd cache would not store \d+ of this fit's compiled graph"):
        trainer([fuse], max_epochs=1, num_sanity_val_steps=0, limit_val_batches=0).fit(_DoublingTask())
    assert fuse.history[-1]["fuse/cache_bypasses"] >= 1  # the blocks share their code: one graph on torch 2.14


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
    assert cold["cache_bypasses"] == warm["cache_bypasses"] == 0  # the toy calls no autograd.Function
    assert warm["compile_s"] < 0.7 * cold["compile_s"]
    assert len(list(tmp_path.glob(f"*/{ARTIFACTS}"))) == 1  # one key directory, one artifacts file
