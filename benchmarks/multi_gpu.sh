#!/usr/bin/env bash
# The GPT-8L recipe with FuseCallback on 2 GPUs: DDP, then FSDP (one FSDP unit per block); one shared compile cache.
# Usage: [STRATEGIES="ddp fsdp"] bash benchmarks/multi_gpu.sh OUT_DIR [hydra overrides...]    (on a machine with
# 2 GPUs; results land in OUT_DIR, with each rank's GPU utilisation per epoch in per_rank.md)
set -uo pipefail
out=${1:?usage: bash benchmarks/multi_gpu.sh OUT_DIR [hydra overrides...]}
shift
mkdir -p "$out"
cache=$(mktemp -d)  # the shared compile cache, kept out of OUT_DIR
common=(model=gpt experiment=small_batch trainer.max_epochs=2 trainer.limit_train_batches=100 trainer.limit_val_batches=5
        fuse.cache_dir="$cache" "$@")
for strategy in ${STRATEGIES:-ddp fsdp}; do
  python recipes/train.py "${common[@]}" trainer=$strategy hydra.run.dir="$out/runs/$strategy" > "$out/$strategy.log" 2>&1
  echo "$strategy exit code: $?"
  grep -E "FuseCallback plan|region\(s\)|^\| [0-9]|Error|error:" "$out/$strategy.log" | head -20
done
python -m lightning_fuse.report report "$out"/runs/*/tb --format md | tee "$out/report.md"
python - "$out"/runs/*/tb <<'EOF' | tee "$out/per_rank.md"
import sys
from lightning_fuse.report import load_runs
print("| run | metric | per epoch |")
print("|---|---|---|")
for run in load_runs(sys.argv[1:]):
    for metric in sorted(m for m in run.scalars if m.startswith("gpu_util")):
        print(f"| {run.name} | fuse/{metric} | {', '.join(f'{v:.1f}' for _, v in run.series(metric))} |")
EOF
