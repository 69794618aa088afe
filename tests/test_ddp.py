"""FuseCallback under CPU DDP: two processes (gloo) train compiled, log once, share one compile cache, and keep or
drop their optimizer graphs together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_fuse.optimizer_trial import BLOCK_STEPS, TRIAL_BLOCKS
from tests.faults import artifacts_path, scalar_steps, valid_artifacts

ROOT = Path(__file__).resolve().parents[1]


def run_ranks(script: str, *args) -> list[dict]:
    """Run ``tests/<script>`` with 2 processes; what each rank wrote (a script in a subprocess: Lightning's DDP
    launcher starts rank 1 by running the same command line again)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / script), *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=180, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((Path(args[0]) / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_two_process_ddp_fit_runs_one_plan_on_both_ranks_logs_once_and_keeps_the_shared_cache(tmp_path):
    cache_root = tmp_path / "cache"
    artifacts = artifacts_path(cache_root)  # the key does not depend on the world size: DDP uses this directory
    artifacts.write_bytes(valid_artifacts())

    ranks = run_ranks("ddp_fit.py", tmp_path, cache_root)

    for rank in ranks:
        assert rank["world_size"] == 2 and rank["ddp"]  # DDP's wrapper seen: graph plans would compete on CUDA
        assert len(rank["losses"]) == 6  # 35 samples a rank: batches of 16, 16 and 3, for 2 epochs
        # the first 3 steps (epoch 0) run eagerly, the plan chosen at their end runs from epoch 1 on
        compiled = {"eager": [], "compile": ["model"]}[rank["plan"]]
        assert rank["compiled_per_step"] == [[]] * 3 + [compiled] * 3
        assert rank["compiles"] >= 1
        assert rank["history_epochs"] == [0.0, 1.0]
        assert rank["uncompiled_after"]
        assert rank["cache_loaded"] and not rank["cache_warnings"]  # both ranks read the shared artifacts
    verdicts = [[(name, outcome.split(":")[0]) for name, outcome in rank["trials"]] for rank in ranks]
    assert ranks[0]["plan"] == ranks[1]["plan"] and verdicts[0] == verdicts[1], ranks
    assert dict(ranks[0]["trials"])["regions"] == "failed: it failed on another rank"  # dropped on both ranks
    assert dict(ranks[1]["trials"])["regions"] == "failed: injected on rank 1"
    assert ranks[0]["losses"] != ranks[1]["losses"], "each rank trained on its own shard"
    assert abs(ranks[0]["param_sum"] - ranks[1]["param_sum"]) < 1e-6, "gradients were averaged across ranks"

    # rank zero alone logged: each fuse/* scalar once per epoch, in one event file
    assert scalar_steps(tmp_path / "tb", "fuse/step_ms") == [1]  # epoch 0: eager, the search, one partial batch
    assert scalar_steps(tmp_path / "tb", "fuse/compile_s") == [0, 1]
    assert len(list((tmp_path / "tb").rglob("events.out.tfevents.*"))) == 1

    # the shared cache directory is intact: one key directory, no half-written files, artifacts torch can read
    assert [p.name for p in cache_root.iterdir()] == [artifacts.parent.name]
    assert not [p.name for p in cache_root.rglob("*") if ".tmp" in p.name]
    assert torch.compiler.load_cache_artifacts(artifacts.read_bytes()) is not None


def test_rank_zeros_trial_decides_both_ranks_optimizer_graphs_which_train_as_eager_ddp(tmp_path):
    """Rank zero's trial measures 0.8x (keep), rank 1's 1.0x (alone, it would drop): both keep, on rank zero's word,
    update alike, and train as eager DDP (the capture faked on CPU)."""
    ranks = run_ranks("ddp_optimizer_fit.py", tmp_path)
    assert [rank["measured"] for rank in ranks] == [0.8, 1.0]
    for rank in ranks:
        assert rank["steps"] == 70  # rank zero's word is shared 48 steps (SETTLE_EVERY) after the plan's activation
        assert rank["decided"] and rank["keep"] and rank["ratio"] == 0.8, rank
        assert rank["replays"] > TRIAL_BLOCKS * BLOCK_STEPS + 10, rank  # the trial's replays, and every step after
        assert "kept at 0.80x" in rank["what_ran"]
    assert abs(ranks[0]["param_sum"] - ranks[1]["param_sum"]) < 1e-6, "both ranks updated alike"
    for rank in ranks:  # and as eager DDP does, each rank on its own shard
        assert rank["losses"] == pytest.approx(rank["eager_losses"], rel=1e-4)
        assert rank["max_diff_from_eager"] < 1e-5, rank
    assert ranks[0]["losses"] != ranks[1]["losses"], "each rank trained on its own shard"


def test_ddp_all_reduces_the_gradients_a_graph_replay_hands_autograd_as_it_does_eager_ones(tmp_path):
    """Under DDP a CUDA graph plan's capture is torch's ``make_graphed_callables`` (faked on CPU): its one autograd
    node hands back every gradient, and DDP's reducer averages them across ranks, so the fit trains as eager DDP."""
    ranks = run_ranks("ddp_graph_fit.py", tmp_path)
    for rank in ranks:
        assert rank["replays"] >= 4, rank  # 35 samples a rank: 2 full batches an epoch replay, the last runs eagerly
        assert rank["losses"] == pytest.approx(rank["eager_losses"], rel=1e-5)
        assert rank["max_diff_from_eager"] < 1e-6, rank
    assert ranks[0]["losses"] != ranks[1]["losses"], "each rank trained on its own shard"
    assert abs(ranks[0]["param_sum"] - ranks[1]["param_sum"]) < 1e-6, "the replays' gradients were averaged"
