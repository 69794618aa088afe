"""FuseCallback under CPU DDP: two processes (gloo) train compiled, log once, and share one compile cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.faults import artifacts_path, scalar_steps, valid_artifacts

ROOT = Path(__file__).resolve().parents[1]


def test_two_process_ddp_fit_runs_one_plan_on_both_ranks_logs_once_and_keeps_the_shared_cache(tmp_path):
    cache_root = tmp_path / "cache"
    artifacts = artifacts_path(cache_root)  # the key does not depend on the world size: DDP uses this directory
    artifacts.write_bytes(valid_artifacts())

    # a script in a subprocess: Lightning's DDP launcher starts rank 1 by running the same command line again
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "ddp_fit.py"), str(tmp_path), str(cache_root)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]

    for rank in ranks:
        assert rank["world_size"] == 2
        assert len(rank["losses"]) == 6  # 35 samples a rank: batches of 16, 16 and 3, for 2 epochs
        assert rank["compiled_second_step"] == {"eager": [], "compile": ["model"]}[rank["plan"]]
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
