#!/usr/bin/env bash
# The H200 measurements of WORKSPACE.md, grouped by machine so each needs one lease.
#
#   experiments/run_h200.sh single OUT   # 2 GPUs used as two single-GPU benches side by side:
#       GPU0 bench_step (AR / chain / DDTree by budget, stages, host loop);
#       GPU1 bench_matrix: the bundled pair (float32), its T=0 vs T=1, Qwen3-8B shape batch 1, 4
#   experiments/run_h200.sh tp OUT       # tp=1 vs tp=2 step times; bf16 divergences at tp=2;
#       then the Qwen3-8B-shape matrix at batch 16 on one GPU
#   experiments/run_h200.sh xla OUT      # XLA attention: budget sweep (GPU0), 8K + host + T (GPU1),
#       then tp=2 (tp=1 rows: GPU0's)
#   python experiments/bench_attention.py --batches 1   (then --batches 8): the kernel grid
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
  xla)  # ~330 s: XLA attention in the engine (see WORKSPACE: Pallas compile time in the engine)
    CUDA_VISIBLE_DEVICES=0 timeout 230 $py experiments/bench_step.py --sections=copy,ar,spec \
      --attention=xla --batches=1,8 --prefixes=1024 --spec_prefixes=1024 \
      --budgets=chain,1,4,16,32,64,128,256 --stage_runs=chain,32,256 --steps=16 --repeats=3 \
      --json_out="$out/step.jsonl" >"$out/step.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 120 $py experiments/bench_step.py --sections=copy,ar,spec,host --attention=xla \
       --batches=1 --prefixes=8192 --spec_prefixes=8192 --budgets=chain,32 --stage_runs=chain \
       --steps=16 --repeats=3 --json_out="$out/step8k.jsonl" >"$out/step8k.log" 2>&1
     for t in 0.0 1.0; do
       timeout 50 $py experiments/bench_matrix.py --config=configs/bench_matrix.py:default \
         --config.attention=xla --config.temperature=$t --config.budgets=32 --config.batches=4 \
         --config.max_new_tokens=96 --config.profile= --config.progress=False \
         --config.out_dir="$out/temp_$t" >>"$out/matrix.log" 2>&1
     done) &
    wait
    timeout 100 $py experiments/bench_step.py --mesh_tp=2 --sections=copy,ar,spec \
      --attention=xla --batches=1,8 --prefixes=1024 --spec_prefixes=1024 --budgets=32 \
      --nostages --steps=16 --repeats=3 --json_out="$out/tp.jsonl" >"$out/tp.log" 2>&1
    tar -C "$out" -czf "$out/matrix.tgz" temp_0.0 temp_1.0 2>/dev/null
    rm -rf "$out"/temp_*
    ;;
  *) echo "usage: $0 xla|single|tp OUT" >&2; exit 2 ;;
esac
ls -la "$out"
