#!/usr/bin/env bash
# The GPT-8L recipe at small and large batch on one GPU, with FuseCallback (fuse=auto) and, separately, eager
# (fuse=measure_only), then `lightning-fuse report` over all four runs and the logged-vs-separate speedup check.
# Usage: bash benchmarks/recipes.sh OUT_DIR     (on a GPU machine; results land in OUT_DIR)
set -euo pipefail
out=${1:?usage: bash benchmarks/recipes.sh OUT_DIR}
common=(model=gpt trainer=gpu trainer.max_epochs=3 trainer.limit_train_batches=150 trainer.limit_val_batches=5
        fuse.cache_dir="$out/cache")
for regime in small_batch large_batch; do
  for fuse in auto measure_only; do
    python recipes/train.py "${common[@]}" experiment=$regime fuse=$fuse hydra.run.dir="$out/runs/${regime}_${fuse}" \
      > "$out/${regime}_${fuse}.log" 2>&1 || { echo "run $regime $fuse failed:"; tail -30 "$out/${regime}_${fuse}.log"; }
  done
done
python -m lightning_fuse.report report "$out"/runs/*/tb --format md --plot "$out/recipes.png" | tee "$out/report.md"
python benchmarks/speedup_check.py \
  small_batch="$out/runs/small_batch_auto/tb:$out/runs/small_batch_measure_only/tb" \
  large_batch="$out/runs/large_batch_auto/tb:$out/runs/large_batch_measure_only/tb" | tee "$out/speedup_check.md"
