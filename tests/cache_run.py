"""One fit with the real inductor backend and a given cache_dir; prints what the compile cache did as JSON.

Run by tests/test_cache.py in fresh processes: ``python tests/cache_run.py CACHE_DIR``.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402

from lightning_fuse import FuseCallback  # noqa: E402
from tests.toy import ToyTask, trainer  # noqa: E402

if __name__ == "__main__":
    pl.seed_everything(0, verbose=False)
    fuse = FuseCallback(cache_dir=sys.argv[1], mode="default", eager_steps=0)
    trainer([fuse], max_epochs=1, num_sanity_val_steps=0, limit_val_batches=0).fit(ToyTask())
    last = fuse.history[-1]
    print(json.dumps({
        "compile_s": last["fuse/compile_s"],
        "cache_hits": last["fuse/cache_hits"],
        "cache_misses": last["fuse/cache_misses"],
        "cache_bypasses": last["fuse/cache_bypasses"],
        "loaded": fuse.cache.loaded,
        "artifacts": fuse.cache.artifacts_path.is_file(),
    }))
