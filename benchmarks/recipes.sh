#!/usr/bin/env bash
# The GPT-8L recipe at small and large batch on one GPU, with FuseCallback (fuse=auto) and, separately, eager
# (fuse=measure_only), then `lightning-fuse report` over the runs and the logged-vs-separate speedup check.
# Runs come in pairs, auto-eager or eager-auto by the Thue-Morse sequence (AB BA BA AB BA AB AB BA ...: RUNS of
# each), so a machine that speeds up or slows down steadily over the minutes of the benchmark (CPU-bound steps on
# the lent VMs drift by 10-20%) biases neither side: with RUNS even, both sides' mean positions are equal.
# Usage: [REGIMES="small_batch large_batch"] [RUNS=2] bash benchmarks/recipes.sh OUT_DIR    (on a GPU machine)
set -euo pipefail
out=${1:?usage: bash benchmarks/recipes.sh OUT_DIR}
regimes=${REGIMES:-small_batch large_batch}
runs=${RUNS:-2}
mkdir -p "$out"
common=(model=gpt trainer=gpu trainer.max_epochs=4 trainer.limit_train_batches=120 trainer.limit_val_batches=5
        fuse.cache_dir="$out/cache")
train() {  # regime fuse index
  local name="${1}_${2}_${3}"
  python recipes/train.py "${common[@]}" experiment=$1 fuse=$2 hydra.run.dir="$out/runs/$name" \
    > "$out/$name.log" 2>&1 || { echo "run $name failed:"; tail -30 "$out/$name.log"; }
}
side() { ls -d "$out"/runs/${1}_${2}_*/tb | paste -sd, -; }  # regime fuse: its runs' TensorBoard folders
checks=()
for regime in $regimes; do
  for i in $(seq 1 "$runs"); do
    ones=$(python -c "print(bin($i - 1).count('1') % 2)")  # the Thue-Morse bit of pair i
    if (( ones == 0 )); then train $regime auto $i; train $regime measure_only $i
    else train $regime measure_only $i; train $regime auto $i; fi
  done
  checks+=("$regime=$(side $regime auto):$(side $regime measure_only)")
done
python -m lightning_fuse.report report "$out"/runs/*/tb --format md --plot "$out/recipes.png" | tee "$out/report.md"
python benchmarks/speedup_check.py "${checks[@]}" | tee "$out/speedup_check.md"
