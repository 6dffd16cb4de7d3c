#!/usr/bin/env bash
# The H200 measurements of WORKSPACE.md, grouped by machine so each needs one lease.
#
#   experiments/run_h200.sh single OUT   # 2 GPUs used as two single-GPU benches side by side:
#       GPU0 bench_step (AR / chain / DDTree by budget, stages, host loop);
#       GPU1 bench_matrix: the bundled pair (float32), its T=0 vs T=1, Qwen3-8B shape batch 1, 4
#   experiments/run_h200.sh tp OUT       # tp=1 vs tp=2 step times; bf16 divergences at tp=2;
#       then the Qwen3-8B-shape matrix at batch 16 on one GPU
#   python experiments/bench_attention.py --batches 1   (then --batches 8): the kernel grid
# Every part runs under `timeout` and writes its rows as it goes, so a cut run keeps what it had.
# NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the machine requires.
set -u
what=$1
out=${2:-out/h200}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# cuBLAS for every GEMM: XLA's Triton GEMM autotuning compiles dozens of variants per new shape,
# and a budget sweep has many shapes (it made one sweep's compiles take minutes)
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false ${XLA_FLAGS:-}"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$out/gpus.txt" 2>&1

case $what in
  single)  # ~570 s
    CUDA_VISIBLE_DEVICES=0 timeout 565 $py experiments/bench_step.py \
      --sections=copy,ar,spec,host --batches=1,8 --prefixes=1024,8192 --attention=pallas,xla \
      --spec_prefixes=1024,8192 --budgets=chain,1,4,16,32,64,128,256 --alt_runs=chain,32 \
      --steps=16 --repeats=3 --json_out="$out/step.jsonl" >"$out/step.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     # the bundled pair in float32 at full matmul precision: any divergence from AR is a bug
     JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 $py experiments/bench_matrix.py \
       --config=configs/bench_matrix.py:default --config.profile= --config.progress=False \
       --config.out_dir="$out/mdef" >"$out/matrix.log" 2>&1
     for t in 0.0 1.0; do
       JAX_DEFAULT_MATMUL_PRECISION=highest timeout 40 $py experiments/bench_matrix.py \
         --config=configs/bench_matrix.py:default --config.temperature=$t --config.budgets=32 \
         --config.batches=4 --config.max_new_tokens=96 --config.profile= --config.progress=False \
         --config.out_dir="$out/temp_$t" >>"$out/matrix.log" 2>&1
     done
     timeout 320 $py experiments/bench_matrix.py --config=configs/bench_matrix.py \
       --config.batches=1,4 --config.max_new_tokens=64 --config.repeats=2 --config.profile= \
       --config.progress=False --config.out_dir="$out/m8b_a" >>"$out/matrix.log" 2>&1) &
    wait
    tar -C "$out" -czf "$out/matrix.tgz" mdef temp_0.0 temp_1.0 m8b_a 2>/dev/null
    rm -rf "$out"/mdef "$out"/temp_* "$out"/m8b_a
    ;;
  tp)  # ~400 s
    for tp in 1 2; do
      timeout 110 $py experiments/bench_step.py --mesh_tp=$tp --sections=copy,ar,spec \
        --batches=1,8 --prefixes=1024 --attention=pallas,xla --spec_prefixes=1024 \
        --budgets=32 --alt_runs=32 --nostages --steps=16 --repeats=3 \
        --json_out="$out/tp.jsonl" >>"$out/tp.log" 2>&1
    done
    timeout 80 $py experiments/bench_matrix.py --config=configs/bench_matrix.py --mesh_tp=2 \
      --config.methods=ar,ddtree --config.budgets=32 --config.batches=8 \
      --config.max_new_tokens=64 --config.repeats=1 --config.profile= --config.progress=False \
      --config.out_dir="$out/tp2_divergence" >"$out/matrix.log" 2>&1
    CUDA_VISIBLE_DEVICES=0 timeout 170 $py experiments/bench_matrix.py \
      --config=configs/bench_matrix.py --config.batches=16 --config.max_new_tokens=64 \
      --config.repeats=2 --config.profile= --config.progress=False \
      --config.out_dir="$out/m8b_b" >>"$out/matrix.log" 2>&1
    tar -C "$out" -czf "$out/matrix.tgz" tp2_divergence m8b_b 2>/dev/null
    rm -rf "$out"/tp2_divergence "$out"/m8b_b
    ;;
  *) echo "usage: $0 single|tp OUT" >&2; exit 2 ;;
esac
ls -la "$out"
