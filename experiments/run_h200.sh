#!/usr/bin/env bash
# The H200 measurements of WORKSPACE.md, grouped by machine so each needs one lease.
#
#   experiments/run_h200.sh single OUT   # 2 GPUs used as two single-GPU benches side by side:
#                                        #   GPU0 bench_step (AR / chain / DDTree, stages, host loop)
#                                        #   GPU1 bench_attention (the kernel grid, batch 1 and 8)
#   experiments/run_h200.sh tp OUT       # tp=1 vs tp=2 step times; bf16 divergences at tp=2
#   experiments/run_h200.sh matrix OUT   # bench_matrix: Qwen3-8B shape (GPU0: batch 1,4; GPU1: 16),
#                                        #   then the bundled pair, T=0 vs T=1
# Every part runs under `timeout` and writes its rows as it goes, so a cut run keeps what it had.
# NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the machine requires.
set -u
what=$1
out=${2:-out/h200}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$out/gpus.txt" 2>&1

case $what in
  single)
    CUDA_VISIBLE_DEVICES=0 timeout 560 $py experiments/bench_step.py \
      --sections=copy,ar,spec,host --batches=1,8 --prefixes=1024,8192 --attention=pallas,xla \
      --spec_prefixes=1024,8192 --budgets=chain,1,4,16,32,64,128,256 --alt_runs=chain,32 \
      --steps=16 --repeats=3 --json_out="$out/step.jsonl" >"$out/step.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 270 $py experiments/bench_attention.py --batches 1 >"$out/attention.log" 2>&1
     timeout 270 $py experiments/bench_attention.py --batches 8 >>"$out/attention.log" 2>&1) &
    wait
    ;;
  tp)
    for tp in 1 2; do
      timeout 200 $py experiments/bench_step.py --mesh_tp=$tp --sections=copy,ar,spec \
        --batches=1,8 --prefixes=1024 --attention=pallas,xla --spec_prefixes=1024 \
        --budgets=32 --alt_runs=32 --nostages --steps=16 --repeats=3 \
        --json_out="$out/tp.jsonl" >>"$out/tp.log" 2>&1
    done
    timeout 150 $py experiments/bench_matrix.py --config=configs/bench_matrix.py --mesh_tp=2 \
      --config.methods=ar,ddtree --config.budgets=32 --config.batches=8 \
      --config.max_new_tokens=64 --config.repeats=1 --config.profile= --config.progress=False \
      --config.out_dir="$out/tp2_divergence" >"$out/tp2_divergence.log" 2>&1
    tar -C "$out" -czf "$out/tp2_divergence.tgz" tp2_divergence && rm -r "$out/tp2_divergence"
    ;;
  matrix)
    common="--config.max_new_tokens=64 --config.repeats=2 --config.profile= --config.progress=False"
    CUDA_VISIBLE_DEVICES=0 timeout 400 $py experiments/bench_matrix.py \
      --config=configs/bench_matrix.py --config.batches=1,4 $common \
      --config.out_dir="$out/m8b_a" >"$out/m8b_a.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 400 $py experiments/bench_matrix.py \
      --config=configs/bench_matrix.py --config.batches=16 $common \
      --config.out_dir="$out/m8b_b" >"$out/m8b_b.log" 2>&1 &
    wait
    # the bundled pair in float32 at full matmul precision: any divergence from AR is a bug
    export JAX_DEFAULT_MATMUL_PRECISION=highest
    CUDA_VISIBLE_DEVICES=0 timeout 170 $py experiments/bench_matrix.py \
      --config=configs/bench_matrix.py:default --config.progress=False \
      --config.out_dir="$out/mdef" >"$out/mdef.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     for t in 0.0 1.0; do
       timeout 80 $py experiments/bench_matrix.py --config=configs/bench_matrix.py:default \
         --config.temperature=$t --config.budgets=32 --config.batches=4 --config.max_new_tokens=96 \
         --config.profile= --config.progress=False --config.out_dir="$out/temp_$t" \
         >>"$out/temperature.log" 2>&1
     done) &
    wait
    tar -C "$out" -czf "$out/matrix.tgz" m8b_a m8b_b mdef temp_0.0 temp_1.0 2>/dev/null
    rm -rf "$out"/m8b_a "$out"/m8b_b "$out"/mdef "$out"/temp_*
    ;;
  *) echo "usage: $0 single|tp|matrix OUT" >&2; exit 2 ;;
esac
ls -la "$out"
