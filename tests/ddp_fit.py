"""A 2-process CPU DDP fit (gloo) with FuseCallback; each rank writes what it saw to ``OUT/rank<N>.json``.

Run by tests/test_ddp.py as ``python tests/ddp_fit.py OUT CACHE_DIR``. On rank 1 only, the ``regions``
candidate of the plan search is made to fail, so the test can check that it is dropped on both ranks. Lightning's
DDP launcher starts rank 1 by running this same command again, so everything a rank needs comes from the command
line.
"""

import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from lightning_fuse import FuseCallback  # noqa: E402
from lightning_fuse.plan import Regions  # noqa: E402
from tests.faults import FuseProbe  # noqa: E402
from tests.toy import RecordingTask, end_ranks, param_sum, trainer  # noqa: E402

if __name__ == "__main__":
    out, cache_dir = Path(sys.argv[1]), Path(sys.argv[2])
    torch.manual_seed(0)
    if os.environ.get("LOCAL_RANK") == "1":
        Regions.failure = property(lambda plan: "injected on rank 1" if plan.name == "regions" else None)
    task = RecordingTask()
    fuse = FuseCallback(backend="aot_eager", cache_dir=cache_dir, eager_steps=0)
    probe = FuseProbe(fuse)
    logger = TensorBoardLogger(out, name="tb", version=0)
    t = trainer([fuse, probe], strategy="ddp", devices=2, max_epochs=2, logger=logger)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        t.fit(task)
    (out / f"rank{t.global_rank}.json").write_text(json.dumps({
        "world_size": t.world_size,
        "ddp": fuse.fit.setting.ddp,
        "losses": task.losses,
        "plan": fuse.plan.name,
        "trials": [(t.name, t.outcome) for t in fuse.decision.trials],
        "compiled_per_step": probe.compiled_per_step,
        "compiles": fuse.tracker.total_compiles,
        "history_epochs": [row["epoch"] for row in fuse.history],
        "cache_loaded": fuse.cache.loaded,
        "cache_warnings": [str(w.message) for w in record if "compile cache" in str(w.message)],
        "uncompiled_after": all(m._compiled_call_impl is None for m in task.modules()),
        "param_sum": param_sum(task),
    }))  # fmt: skip
    end_ranks()
