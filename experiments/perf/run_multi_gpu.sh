#!/usr/bin/env bash
# Tensor- and expert-parallel measurements on one host of 2, 4 or 8 H200s, one part per run (each
# fits in 10 minutes). Run from the repository root. TP, EP and LAYOUT pick the mesh
# (sharding.LAYOUTS: split, or replicated_attention: one all-reduce per layer); TP defaults to
# every GPU for dense and divergence, EP to every GPU for moe.
#
#   TP=2 experiments/perf/run_multi_gpu.sh dense OUT       # Qwen3-8B shape: AR, DDTree B=16/32/64
#                                                          # at batch 1 and 8 (8 programs)
#   TP=2 experiments/perf/run_multi_gpu.sh dense32 OUT     # Qwen3-32B shape, the same, one run
#                                                          # per batch
#   EP=8 experiments/perf/run_multi_gpu.sh moe OUT         # Qwen3-30B-A3B shape, experts over EP
#                                                          # GPUs: verify of 1/17/65 tokens, AR and
#                                                          # DDTree B=16 loops at batch 1
#   TP=2 experiments/perf/run_multi_gpu.sh divergence OUT  # bf16: chain / DDTree vs AR at tp=TP
#                                                          # (bench_matrix), then tp=TP vs one GPU
#   experiments/perf/run_multi_gpu.sh collectives OUT      # per-layer collectives, CPU only
#
# On N GPUs: dense and dense32 for each TP in 1 2 4 .. N (TP=1 is the one-GPU row of the same
# host), each also with LAYOUT=replicated_attention for TP > 1; moe for EP in 1 2 4 .. N; then
# divergence at TP=N. The collectives per layer and step that these runs pay are in
# experiments/perf/collectives.py's table (CPU). Every part runs under `timeout` and writes rows
# as it goes. NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the machines require.
set -u
what=$1
out=${2:-out/multi_gpu}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
py=${PYTHON:-python3}
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$out/gpus.txt" 2>&1
nvidia-smi topo -m >>"$out/gpus.txt" 2>&1
LAYOUT=${LAYOUT:-split}
layout=""  # (a script that does not take --mesh_layout runs the split layout only)
[ "$LAYOUT" != split ] && layout="--mesh_layout=$LAYOUT"
step="$py -m experiments.perf.bench_step --steps=16 --repeats=3 --sections=copy,ar,spec \
  --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --budgets=16,32,64 \
  --compile_threads=4 $layout"

case $what in
  dense)  # 2 AR + 6 DDTree programs
    TP=${TP:-$gpus}
    tag="dense_tp${TP}_$LAYOUT"
    timeout 560 $step --mesh_tp="$TP" --batches=1,8 --json_out="$out/$tag.jsonl" \
      >"$out/$tag.log" 2>&1
    ;;
  dense32)  # 64 layers: each batch its own run (65.5 GB of weights; compiles take ~2x 8B's)
    TP=${TP:-$gpus}
    for b in 1 8; do
      tag="dense32_tp${TP}_${LAYOUT}_b$b"
      timeout 280 $step --shape=qwen3-32b --mesh_tp="$TP" --batches=$b \
        --json_out="$out/$tag.jsonl" >"$out/$tag.log" 2>&1
    done
    ;;
  moe)  # the REF-free part of run_h200.sh moe on EP GPUs: verify forwards, then the decode loop
    TP=${TP:-1} EP=${EP:-$gpus}
    tag="moe_tp${TP}_ep${EP}_$LAYOUT"
    timeout 560 $py -m experiments.perf.bench_moe --mesh_tp="$TP" --mesh_ep="$EP" \
      $layout --sections=copy,verify,loop --verify_tokens=1,17,65 \
      --loop_runs="1:ar,16" --steps=8 --repeats=3 --json_out="$out/$tag.jsonl" \
      >"$out/$tag.log" 2>&1
    ;;
  divergence)  # random Qwen3-8B weights, batch 8, 64 tokens, 512-token prompts, bf16
    TP=${TP:-$gpus}
    timeout 250 $py -m experiments.bench_matrix --config=configs/bench_matrix.py --mesh_tp="$TP" \
      --config.methods=ar,chain,ddtree --config.budgets=32 --config.batches=8 \
      --config.max_new_tokens=64 --config.repeats=1 --config.profile= --config.progress=False \
      --config.out_dir="$out/div_tp$TP" >"$out/div_tp$TP.log" 2>&1
    tar -C "$out" -czf "$out/div_tp$TP.tgz" "div_tp$TP" 2>/dev/null && rm -r "$out/div_tp$TP"
    # the same prompts on one GPU and on tp=TP: which sequences leave one GPU's AR, and the
    # target's top-1 minus top-2 logit gap where they do (bench_matrix.divergences)
    timeout 300 $py - "$TP" >"$out/div_vs_one_gpu_tp$TP.jsonl" \
      2>"$out/div_vs_one_gpu_tp$TP.log" <<'EOF'
import json, sys
import ddtree_jax as dj
from ddtree_jax import sharding
from experiments import bench_matrix, workflow
tp = int(sys.argv[1])
cfg = workflow.load_config("configs/bench_matrix.py", {"max_new_tokens": 64})
one, one_drafter = workflow.load_models(cfg)
many, many_drafter = workflow.load_models(cfg, sharding.make_mesh({"dp": 1, "tp": tp}))
prompts = workflow.make_prompts(cfg, one, 8)
ar = dj.generate(one, prompts, **workflow.generate_kwargs(cfg, "ar", None, None)).tokens
for name, target, drafter in (("one_gpu", one, one_drafter), (f"tp{tp}", many, many_drafter)):
  for method, budget in (("ar", None), ("chain", None), ("ddtree", 32))[name == "one_gpu":]:
    res = dj.generate(target, prompts, **workflow.generate_kwargs(cfg, method, budget, drafter))
    row = bench_matrix.divergences(one, prompts, ar, res.tokens, cfg.near_tie_eps)
    print(json.dumps({"run": name, "method": method, "budget": budget,
                      "vs": "one-GPU AR", **row}), flush=True)
EOF
    ;;
  collectives)  # no GPU needed: 8 forced CPU devices
    c="$py -m experiments.perf.collectives --list"
    JAX_PLATFORMS=cpu timeout 560 $c --json_out="$out/collectives.jsonl" \
      >"$out/collectives.log" 2>&1
    ;;
  *) echo "usage: [TP=n] [EP=n] [LAYOUT=split|replicated_attention] $0" \
       "dense|dense32|moe|divergence|collectives OUT" >&2
     exit 2 ;;
esac
ls -la "$out"
