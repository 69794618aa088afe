#!/usr/bin/env bash
# Why the in-run eager reference can read slow: the GPT-8L recipe at one batch size, each run with a fresh compile
# cache unless named warm, set beside fuse=measure_only runs (eager reference and eager steps in one run, so
# their own speedup should be 1.00x). A diagnostic, not a comparison; prints one table row per run.
# Usage: bash benchmarks/reference_check.sh OUT_DIR [large_batch|small_batch]     (on a GPU machine)
set -uo pipefail
out=${1:?usage: bash benchmarks/reference_check.sh OUT_DIR [experiment]}
experiment=${2:-large_batch}
mkdir -p "$out"
caches=$(mktemp -d)  # fresh compile caches, kept out of OUT_DIR
common=(model=gpt trainer=gpu trainer.max_epochs=2 trainer.limit_train_batches=80 trainer.limit_val_batches=5
        experiment=$experiment)
run() {  # NAME CACHE [ENV=VALUE ...] -- [HYDRA OVERRIDES ...]
  local name=$1 cache=$2; shift 2
  local envs=(); while [[ $# -gt 0 && $1 != -- ]]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" python recipes/train.py "${common[@]}" fuse.cache_dir="$caches/$cache" "$@" \
    hydra.run.dir="$out/runs/$name" > "$out/$name.log" 2>&1 || { echo "run $name failed:"; tail -20 "$out/$name.log"; }
}
run measure_only_1 m1 -- fuse=measure_only
run auto_cold a1 -- fuse=auto
run auto_warm a1 -- fuse=auto
run auto_cold_no_warm_pool a2 TORCH_WARM_POOL=0 -- fuse=auto
run auto_cold_no_sanity a3 -- fuse=auto +trainer.num_sanity_val_steps=0
run auto_cold_24_eager a4 -- fuse=auto fuse.eager_steps=24
run measure_only_2 m2 -- fuse=measure_only
python - "$out" <<'EOF'
import statistics, sys
from pathlib import Path
from lightning_fuse.report import load_runs
print("| run | in-run eager ms | step ms | logged speedup |")
print("|---|---|---|---|")
for run in load_runs([Path(sys.argv[1]) / "runs"]):
    med = lambda m: statistics.median(v for _, v in run.series(m)) if run.series(m) else float("nan")
    print(f"| {run.name} | {med('eager_step_ms'):.2f} | {med('step_ms'):.2f} | {med('speedup'):.2f}x |")
EOF
