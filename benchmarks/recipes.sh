#!/usr/bin/env bash
# The GPT-8L recipe at small and large batch on one GPU, with FuseCallback (fuse=auto) and, separately, eager
# (fuse=measure_only), then `lightning-fuse report` over the runs and the logged-vs-separate speedup check.
# Each pair runs twice in the order auto, eager, eager, auto, so a machine that speeds up or slows down over the
# minutes of the benchmark (CPU-bound steps on the lent VMs drift by 10% and more) biases neither side.
# Usage: bash benchmarks/recipes.sh OUT_DIR     (on a GPU machine; results land in OUT_DIR)
set -euo pipefail
out=${1:?usage: bash benchmarks/recipes.sh OUT_DIR}
mkdir -p "$out"
common=(model=gpt trainer=gpu trainer.max_epochs=4 trainer.limit_train_batches=120 trainer.limit_val_batches=5
        fuse.cache_dir="$out/cache")
for regime in small_batch large_batch; do
  for run in auto_1 measure_only_1 measure_only_2 auto_2; do
    name="${regime}_${run}"
    python recipes/train.py "${common[@]}" experiment=$regime fuse=${run%_*} hydra.run.dir="$out/runs/$name" \
      > "$out/$name.log" 2>&1 || { echo "run $name failed:"; tail -30 "$out/$name.log"; }
  done
done
python -m lightning_fuse.report report "$out"/runs/*/tb --format md --plot "$out/recipes.png" | tee "$out/report.md"
runs() { echo "$out/runs/${1}_1/tb,$out/runs/${1}_2/tb"; }
python benchmarks/speedup_check.py \
  small_batch="$(runs small_batch_auto):$(runs small_batch_measure_only)" \
  large_batch="$(runs large_batch_auto):$(runs large_batch_measure_only)" | tee "$out/speedup_check.md"
