#!/usr/bin/env bash
# auto_every = 1 / 4 / 8 on one H200, each against every fixed budget in the same process
# (the bundled pair, float32, highest precision), then the random drafter. From the repo root:
#   bash experiments/results/auto-budget-2026-12-04/every/h200_every.sh OUT [BATCHES] [PARTS]
# BATCHES: "1,8" (default) or "32"; PARTS: "pair random" (default); env KS: the K values
# ("1 4 8"). Later runs reuse the fixed budgets' programs through the persistent compilation
# cache. OUT gets one log and CSV a run.
set -u
out=${1:?usage: h200_every.sh OUT [BATCHES] [PARTS]}
batches=${2:-1,8}
parts=${3:-pair random}
export PYTHONUNBUFFERED=1 JAX_DEFAULT_MATMUL_PRECISION=highest
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
tag=b${batches//,/_}
for part in $parts; do
  for k in ${KS:-1 4 8}; do
    case $part in
      pair) args=(--config.budgets=8,16,32,64,auto) ;;
      random) args=(--config.drafter= --config.random_drafter=True --config.methods=ar,ddtree
                    --config.budgets=auto) ;;
    esac
    t0=$SECONDS
    timeout 280 $py -m experiments.bench_matrix --config=configs/bench_matrix.py:default \
      --config.batches="$batches" --config.profile= --config.auto_every=$k "${args[@]}" \
      --config.out_dir="/tmp/every_${part}_$k" >"$out/${part}_${tag}_k$k.log" 2>&1
    echo "$part k=$k batches=$batches: rc $? in $((SECONDS - t0)) s"
    cp "/tmp/every_${part}_$k/bench.csv" "$out/${part}_${tag}_k$k.csv" 2>/dev/null
    sed -n '/^batch run/,/^(tok/p' "$out/${part}_${tag}_k$k.log"
  done
done
