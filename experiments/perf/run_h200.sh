#!/usr/bin/env bash
# The H200 measurements of WORKSPACE.md, one part per run (each fits in 10 minutes). Run from the
# repository root.
#
#   experiments/perf/run_h200.sh compile OUT  # serial compile seconds of every program (loop + stages)
#   experiments/perf/run_h200.sh step OUT     # batch 1: AR vs floor, chain / DDTree by budget, stages, host
#   experiments/perf/run_h200.sh step8 OUT    # the same at batch 8
#   experiments/perf/run_h200.sh spec OUT     # batch 1 and 8: AR + chain / DDTree 1..256 (+ B=32 stages)
#   experiments/perf/run_h200.sh profile OUT  # GPU kernels per step (profile_step.py); profile_tp: tp=2
#   experiments/perf/run_h200.sh kernel OUT   # the attention kernel grid (batch 1, then 8)
#   experiments/perf/run_h200.sh sweep OUT    # attention launch parameters vs the default rule
#   experiments/perf/run_h200.sh gemm OUT     # a layer's GEMMs vs rows M, as model.py writes them
#   experiments/perf/run_h200.sh quick OUT    # batch 1 and 8: AR, chain, DDTree 32/64/128 (~150 s)
#   experiments/perf/run_h200.sh goals OUT    # AR, DDTree B=32/64 step and round at batch 1 (~210 s)
#   experiments/perf/run_h200.sh results OUT  # README's table: AR, chain, B=16..128 rounds; the demo
#   experiments/perf/run_h200.sh int8 OUT     # bf16 vs int8 (W8A8) drafter, batch 1; GEMMs by format
#   experiments/perf/run_h200.sh tp OUT       # tp=1 vs tp=2 (needs 2 GPUs); bf16 divergences at tp=2
#   BATCHES=16 experiments/perf/run_h200.sh matrix OUT  # bench_matrix: bundled pair (float32)
#   experiments/perf/run_h200.sh temperature OUT        # bundled pair, T=0 vs T=1, DDTree B=32
#   experiments/perf/run_h200.sh m8b OUT      # bench_matrix: Qwen3-8B shape (~360 s)
#   experiments/perf/run_h200.sh moe OUT      # Qwen3-30B-A3B shape: the HF reference, then bench_moe
#   experiments/perf/run_h200.sh mla OUT      # Moonlight-16B-A3B (MLA) and the latent kernel
#   experiments/perf/run_h200.sh mla8k OUT    # Moonlight AR and B=16 at an 8K prefix
#   experiments/perf/run_h200.sh latent OUT   # Pallas latent launches vs XLA; Moonlight loop on each
#   experiments/perf/run_h200.sh moe_loop OUT # Qwen3-30B-A3B AR and B=16 loop steps
#   experiments/perf/run_h200.sh kimi OUT     # the Kimi-K2 slice's forwards at 4 and 2 layers
#   experiments/perf/run_h200.sh moe_pairs OUT  # MoE layers at decode rows: pair kernels vs sorted
#   experiments/perf/run_h200.sh moe_decode OUT # the MoE decode kernels vs the pair kernels
#   experiments/perf/run_h200.sh moe_fused OUT  # the MoE block in four launches vs OLD's tree
#   experiments/perf/run_h200.sh moe_rest OUT   # q30 profile, int4 experts, K2.6 share, Qwen3.6
#   experiments/perf/run_h200.sh target_sweep OUT # the bundled target's shape from short runs
#   experiments/perf/run_h200.sh pair_target OUT; ... pair_rest OUT  # the bundled pair, two calls
#   experiments/perf/run_h200.sh pair_drafter OUT  # a new drafter for the target in .pair/
#   experiments/perf/run_h200.sh hybrid OUT   # Qwen3.5-9B shape, the tree's recurrent part
#   experiments/perf/run_h200.sh hybrid_moe OUT  # Qwen3.6-35B-A3B shape
#   SHAPES=qwen3-30b-a3b experiments/perf/run_h200.sh auto_shapes OUT  # budget="auto" vs fixed
#                                             # budgets under the benchmark drafter (~450 s a shape)
#   SHAPE=qwen3-8b RUNS=ar,16,32,auto experiments/perf/run_h200.sh serve_auto OUT  # the server's
#                                             # auto at concurrency 1..32 (CONCURRENCY, LEVELS)
#
# bench_matrix compiles each batch's programs 8 at a time (configs/bench_matrix.py
# compile_threads); bench_step compiles serially. experiments/perf/compile_offline.py checks compile
# times without a GPU (see WORKSPACE.md for the DDTree compile trap it found).
# Every part runs under `timeout` and writes rows as it goes, so a cut run keeps what it had.
# NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the machine requires.
set -u
what=$1
out=${2:-out/h200}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$out/gpus.txt" 2>&1
step="$py -m experiments.perf.bench_step --steps=16 --repeats=3"

wheels() {  # the wheels in .whl/ (what the machine lacks, e.g. ml_collections) into $1, on the path
  if ls .whl/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$1" .whl/*.whl >"$out/pip.log" 2>&1
    export PYTHONPATH=$PYTHONPATH:$1
  fi
}

case $what in
  moe)  # the REF in its own process first (the GPU holds one 61 GB model at a time), ~400 s
    timeout 100 python3 -m experiments.perf.ref_hf_moe --json_out="$out/ref_moe.jsonl" \
      >"$out/ref_moe.log" 2>&1
    timeout 420 $py -m experiments.perf.bench_moe --json_out="$out/moe.jsonl" >"$out/moe.log" 2>&1
    ;;
  moe_pairs)  # ~150 s: the 48 MoE layers of the Qwen3-30B-A3B shape at decode rows (1, 2, 8
              # tokens), the sorted pairs vs pair by pair (one tile each) at several tiles
    timeout 330 $py -m experiments.perf.bench_moe --sections=experts --tokens=1,2,8 --repeats=5 \
      --impls=pallas,pairs:16x64x128,pairs:16x32x128,pairs:16x128x64,pairs:16x64x256,pairs:16x32x256 \
      --json_out="$out/moe_pairs.jsonl" >"$out/moe_pairs.log" 2>&1
    ;;
  moe_decode)  # ~450 s: the MoE decode kernels (the top-k inside the gate/up kernel)
               # against the pair kernels: Qwen3-30B-A3B's 48 MoE layers at 1 / 2 / 8 tokens
               # per launch, then the AR and B=16 loops of Qwen3-30B-A3B and Moonlight, each
               # with and without them
    timeout 200 $py -m experiments.perf.bench_moe --sections=experts --tokens=1,2,8 --repeats=5 \
      --impls=pairs,decode,decode:32x256x4,decode:64x128x4,decode:128x256x4 \
      --json_out="$out/moe_decode_experts.jsonl" >"$out/moe_decode_experts.log" 2>&1
    for shape in qwen3-30b-a3b moonlight-16b-a3b; do
      timeout 190 $py -m experiments.perf.bench_moe --shape=$shape --compile_threads=8 \
        --sections=loop --loop_runs="1:ar,16" --moe_decode=default,off --steps=8 --repeats=3 \
        --json_out="$out/moe_decode_loop.jsonl" >>"$out/moe_decode_loop.log" 2>&1
    done
    ;;
  moe_fused)  # ~530 s: the MoE decode block in four launches against OLD's tree (a git archive of
              # the commit before it, default .ab/old): Qwen3-30B-A3B's AR and B=16 loops (the
              # new tree at its defaults, without the SM fill, with XLA's router), then
              # Moonlight's AR and B=16 on each tree
    old=$(realpath "${OLD:-.ab/old}") o=$(realpath "$out")
    loop=(--sections=loop --loop_runs=1:ar,16 --steps=8 --repeats=3 --compile_threads=8)
    timeout 230 $py -m experiments.perf.bench_moe "${loop[@]}" \
      --moe_decode=default,fill=0+down_fill=0,router=0x0x0x0 --json_out="$o/q30_new.jsonl" \
      >"$o/q30_new.log" 2>&1
    (cd "$old" && PYTHONPATH=. timeout 100 $py -m experiments.perf.bench_moe "${loop[@]}" \
      --json_out="$o/q30_old.jsonl" >"$o/q30_old.log" 2>&1)
    timeout 100 $py -m experiments.perf.bench_moe --shape=moonlight-16b-a3b "${loop[@]}" \
      --json_out="$o/moon_new.jsonl" >"$o/moon_new.log" 2>&1
    (cd "$old" && PYTHONPATH=. timeout 100 $py -m experiments.perf.bench_moe \
      --shape=moonlight-16b-a3b "${loop[@]}" --json_out="$o/moon_old.jsonl" >"$o/moon_old.log" 2>&1)
    ;;
  moe_rest)  # ~500 s: kernels per Qwen3-30B-A3B AR step, the int4 experts at Kimi K2.6's shape
             # (1 and 9 tokens), the K2.6 one-GPU share at batch 1 (AR, B=8/16/32), Qwen3.6-35B-A3B's
             # AR and B=16 loop, Qwen3.5-9B's AR step against its floor (batch 1 and 8)
    o=$(realpath "$out")
    prof=(--shape=qwen3-30b-a3b --runs=ar --attention=pallas --steps=16 --top=30)
    timeout 100 $py -m experiments.perf.profile_step "${prof[@]}" >"$o/profile_q30.log" 2>&1
    timeout 90 $py -m experiments.perf.bench_quant_experts --formats=int4 --tokens=1,9 \
      --paths=decode --json_out="$o/quant_int4.jsonl" >"$o/quant_int4.log" 2>&1
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 200 $py -m experiments.perf.bench_kimi_share \
      --runs=ar,8,16,32 --batches=1 --json_out="$o/kimi_share.jsonl" >"$o/kimi_share.log" 2>&1
    timeout 130 $py -m experiments.perf.bench_moe --shape=qwen3.6-35b-a3b --sections=loop \
      --loop_runs=1:ar,16 --steps=8 --repeats=3 --compile_threads=8 \
      --json_out="$o/q36.jsonl" >"$o/q36.log" 2>&1
    timeout 100 $step --shape=qwen3.5-9b --sections=ar --batches=1,8 --prefixes=1024 \
      --attention=pallas --json_out="$o/hybrid_9b_ar.jsonl" >"$o/hybrid_9b_ar.log" 2>&1
    ;;
  target_sweep)  # the bundled target's depth at ~15.5M parameters from short runs on one corpus
                 # (configs/train_target.py's: the stdlib + every installed package's sources,
                 # tokenized once under CORPUS), each point TIME s of training (calibrated step
                 # count, full schedule); POINTS: HIDDENxLAYERSxINTERMEDIATE (heads of 64, 2 kv
                 # heads). Needs the ml_collections wheel in .whl/.
    w=${WORKDIR:-out/target_sweep} t=${TIME:-40} corpus=${CORPUS:-${WORKDIR:-out/target_sweep}/corpus}
    wheels /tmp/site_sweep
    common=(--config=configs/train_target.py --config.train.progress_bar=False)
    timeout 500 $py -m experiments.train_tokenizer "${common[@]}" --config.workdir=$corpus \
      >"$out/sweep_corpus.log" 2>&1
    for point in ${POINTS:-384x6x1408 384x8x1024 384x10x768}; do
      IFS=x read -r h l i <<<"$point"
      d=$w/sweep/$point
      mkdir -p "$d"
      ln -sfn "$(realpath "$corpus")/tokenizer.json" "$d/tokenizer.json"
      ln -sfn "$(realpath "$corpus")/data" "$d/data"
      timeout $((t + 240)) $py -m experiments.train_target "${common[@]}" --config.workdir="$d" \
        --config.model.hidden_size=$h --config.model.num_layers=$l \
        --config.model.intermediate_size=$i --config.model.num_heads=$((h / 64)) \
        --config.model.num_kv_heads=2 --config.model.head_dim=64 \
        --config.train.time_budget_s=$t --config.train.save_every=100000 \
        >"$out/sweep_$point.log" 2>&1
      echo "{\"point\": \"$point\", \"result\": $(tail -n 1 "$out/sweep_$point.log" | grep '^{' || echo null)}" \
        >>"$out/sweep.jsonl"
    done
    ;;
  pair_target|pair_rest)  # the bundled pair in two calls on one warm machine (a call is at most
                 # 10 minutes; the target trains for longer). pair_target (~540 s): the corpus,
                 # then the target's fixed schedule (configs/train_target.py) up to step STOP (a
                 # multiple of its save_every), checkpointed under WORKDIR. pair_rest (~530 s),
                 # at once after it: the target
                 # resumed to its last step (bitwise), exported; regenerated data, the drafter,
                 # installed into WORKDIR/default_model and packed into OUT (15 MB parts). A fresh
                 # machine has no checkpoint: pair_rest then stops at once. PRESET=:smoke
                 # (with STOP=15) runs both on a CPU in a few minutes. TARGET_ARGS (both calls,
                 # e.g. a shorter schedule) and DRAFTER_ARGS: more config overrides.
    w=${WORKDIR:-out/pair}
    wheels /tmp/site_pair
    if [ "$what" = pair_target ]; then
      common=(--config=configs/train_target.py${PRESET:-} --config.workdir=$w
              --config.train.progress_bar=False)
      timeout 120 $py -m experiments.train_tokenizer "${common[@]}" >"$out/pair_corpus.log" 2>&1
      timeout 500 $py -m experiments.train_target "${common[@]}" \
        --config.train.stop_at_step=${STOP:-3500} ${TARGET_ARGS:-} >"$out/pair_target.log" 2>&1
      tail -n 3 "$out/pair_target.log"
    else
      if ! ls -d $w/target/checkpoints/* >/dev/null 2>&1; then
        echo "no checkpoint under $w: a fresh machine (run pair_target first)"; exit 1
      fi
      PRESET=${PRESET:-} TARGET_ARGS="--config.train.progress_bar=False ${TARGET_ARGS:-}" \
        DRAFTER_ARGS="--config.train.progress_bar=False ${DRAFTER_ARGS:-}" WORKDIR=$w \
        INSTALL=$w/default_model \
        PY=$py timeout 560 bash experiments/train_default.sh >"$out/pair_rest.log" 2>&1
      tail -n 4 "$out/pair_rest.log"
      tar czf "$out/pair_logs.tgz" -C $w target/metrics.json target/loss.png drafter/metrics.json \
        drafter/loss.png data/corpus.json 2>/dev/null
      tar cf - -C $w default_model | split -b 15000000 - "$out/pair.tar."
    fi
    ;;
  pair_drafter)  # ~560 s: a new drafter for a target trained earlier, in one call: PAIR (default
                 # .pair, carried) holds its tokenizer.json and target/ (the HF export and
                 # metrics.json); the corpus is encoded with that tokenizer, then more regenerated
                 # data than pair_rest's (float32 at default precision, REGEN s) and a longer
                 # training (TRAIN s, batch 64); installed and packed into OUT as pair_rest does.
                 # DRAFTER_ARGS: more overrides (a CPU check: a few small batches and steps)
    w=${WORKDIR:-out/pair_drafter} src=${PAIR:-.pair}
    wheels /tmp/site_pair
    mkdir -p $w/target/hf
    cp "$src/tokenizer.json" $w/ && cp "$src"/target/hf/* $w/target/hf/ \
      && cp "$src/target/metrics.json" $w/target/ || exit 1
    common=(--config.workdir=$w --config.train.progress_bar=False)
    timeout 120 $py -m experiments.train_tokenizer --config=configs/train_target.py "${common[@]}" \
      >"$out/pair_corpus.log" 2>&1
    d=(--config=configs/train_drafter.py "${common[@]}" --config.regen.matmul_precision=default
       --config.regen.num_sequences=65536 --config.regen.time_budget_s=${REGEN:-180}
       --config.train.batch_size=64 --config.train.time_budget_s=${TRAIN:-280} ${DRAFTER_ARGS:-})
    timeout 260 $py -m experiments.train_drafter "${d[@]}" --config.stage=regenerate \
      >"$out/pair_drafter.log" 2>&1
    timeout 360 $py -m experiments.train_drafter "${d[@]}" --config.stage=train \
      >>"$out/pair_drafter.log" 2>&1
    $py -m experiments.install_default --workdir=$w --out=$w/default_model >>"$out/pair_drafter.log" 2>&1
    tail -n 4 "$out/pair_drafter.log"
    tar czf "$out/pair_logs.tgz" -C $w drafter/metrics.json drafter/loss.png 2>/dev/null
    tar cf - -C $w default_model | split -b 15000000 - "$out/pair.tar."
    ;;
  hybrid)  # ~500 s: Qwen3.5-9B at its model card's shape (random bf16): the AR step against its
           # floor (weights, KV rows, states in and out) and the chain / DDTree steps at batch 1
           # and 8 with their stages, compiled 8 at a time (serially they outlast the call); the
           # tree's recurrent part per budget (one Gated DeltaNet layer in a program, bench_gdn)
    timeout 400 $step --shape=qwen3.5-9b --sections=ar,spec --batches=1,8 --prefixes=1024 \
      --spec_prefixes=1024 --budgets=chain,16,32,64,128 --alt_runs= --attention=pallas \
      --compile_threads=8 --json_out="$out/hybrid_9b.jsonl" >"$out/hybrid_9b.log" 2>&1
    timeout 150 $py -m experiments.perf.bench_gdn --shape=qwen3.5-9b --budgets=0,16,32,64,128 \
      --batches=1,8 --json_out="$out/hybrid_gdn.jsonl" >"$out/hybrid_gdn.log" 2>&1
    ;;
  hybrid_moe)  # ~450 s: Qwen3.6-35B-A3B's AR and DDTree loop steps (bench_moe), batch 1 and 8
    timeout 540 $py -m experiments.perf.bench_moe --shape=qwen3.6-35b-a3b --compile_threads=8 \
      --sections=loop --loop_runs="1:ar,16,32,64,128;8:ar,32" --steps=8 --repeats=3 \
      --json_out="$out/hybrid_35b.jsonl" >"$out/hybrid_35b.log" 2>&1
    ;;
  mla)  # DeepSeek-V3 architecture, ~420 s: the Moonlight-16B-A3B shape (latent attention by
        # KernelTuning's rule; on 2026-12-02 at f558278 XLA's form, then the only default):
        # forwards and the decode loop (batch 1 and 8), its AR and B=16 kernels, then the latent
        # kernel vs XLA's form at 4K-32K prefixes and 16 / 64 / 128 heads
    timeout 250 $py -m experiments.perf.bench_moe --shape=moonlight-16b-a3b --compile_threads=8 \
      --sections=verify,loop --verify_tokens=1,17 --loop_runs="1:ar,8,16,32,64;8:ar,16" \
      --steps=8 --repeats=3 --json_out="$out/mla.jsonl" >"$out/mla.log" 2>&1
    timeout 80 $py -m experiments.perf.profile_step --shape=moonlight-16b-a3b --runs=ar,16 \
      --attention=pallas --steps=16 --top=45 >"$out/mla_profile.log" 2>&1
    timeout 80 $py -m experiments.perf.bench_latent --heads=16,64,128 --prefixes=4096,32768 \
      --tokens=1,17 --json_out="$out/latent.jsonl" >"$out/latent.log" 2>&1
    ;;
  latent)  # ~500 s: the Pallas latent kernel at several launches (LAUNCHES, harness.latent_tuning)
           # vs XLA's form at 16 and 128 heads, 1K-32K prefixes; then the Moonlight AR and B=16
           # loop on XLA's form and on the launch fastest at 16 heads and 1K + 8K prefixes
    launches=${LAUNCHES:-512x16:64x64x4x2,128x64:64x64x4x2,64x128:64x64x4x2,128x64:16x64x4x2,128x64:64x32x8x2,256x32:32x64x4x3}
    timeout 230 $py -m experiments.perf.bench_latent --heads=16,128 --prefixes=1024,8192,32768 \
      --tokens=1,17 --rounds=3 --pallas="$launches" --json_out="$out/latent_sweep.jsonl" \
      >"$out/latent_sweep.log" 2>&1
    best=$($py - "$out/latent_sweep.jsonl" <<'EOF'
import collections, json, sys
total = collections.Counter()
for row in map(json.loads, open(sys.argv[1])):
  if row["heads"] == 16 and row["prefix"] <= 8192:
    for k, v in row.items():
      if k.startswith("pallas:") and k.endswith("_us"):
        total[k[len("pallas:"):-3]] += v
print(min(total, key=total.get) if total else "default")
EOF
)
    echo "fastest launch at 16 heads: $best" >>"$out/latent_sweep.log"
    for latent in xla "$best"; do
      timeout 150 $py -m experiments.perf.bench_moe --shape=moonlight-16b-a3b --compile_threads=8 \
        --sections=loop --loop_runs="1:ar,16" --steps=8 --repeats=3 --latent="$latent" \
        --json_out="$out/mla_loop.jsonl" >>"$out/mla_loop.log" 2>&1
    done
    ;;
  mla8k)  # ~120 s: the Moonlight shape's AR and B=16 loop at an 8K prefix
    timeout 160 $py -m experiments.perf.bench_moe --shape=moonlight-16b-a3b --compile_threads=8 \
      --sections=loop --prefix=8192 --loop_runs="1:ar,16" --steps=8 --repeats=3 \
      --json_out="$out/mla_8k.jsonl" >"$out/mla_8k.log" 2>&1
    ;;
  moe_loop)  # ~120 s: the Qwen3-30B-A3B shape's AR and B=16 loop (batch 1, prefix 1K)
    timeout 160 $py -m experiments.perf.bench_moe --compile_threads=8 --sections=loop \
      --loop_runs="1:ar,16" --steps=8 --repeats=3 --json_out="$out/moe_loop.jsonl" \
      >"$out/moe_loop.log" 2>&1
    ;;
  kimi)  # ~250 s: the Kimi-K2 slice (its first 4 layers, 108 GB, so JAX may take 95 % of the
         # GPU) cut to 4 and 2 layers: forwards of T tokens, the per-layer cost by difference
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 280 $py -m experiments.perf.bench_moe \
      --shape=kimi-k2-slice --sections=verify --verify_layers=4,2 --verify_tokens=1,9,17,33,65 \
      --repeats=3 --json_out="$out/kimi.jsonl" >"$out/kimi.log" 2>&1
    ;;
  compile)
    timeout 560 $step --sections=compile --attention=pallas --batches=1 --spec_prefixes=1024 \
      --budgets=chain,4,32,256 --json_out="$out/compile.jsonl" >"$out/compile.log" 2>&1
    ;;
  step)   # batch 1: 4 AR + 12 spec loops + 12 stage programs, ~330 s with serial compile
    timeout 560 $step --sections=copy,ar,spec,host --batches=1 --prefixes=1024,8192 \
      --attention=pallas,xla --spec_prefixes=1024,8192 --budgets=chain,1,4,16,32,64,128,256 \
      --alt_runs=chain,32 --stage_runs=chain,32,256 --json_out="$out/step_b1.jsonl" \
      >"$out/step_b1.log" 2>&1
    ;;
  step8)  # batch 8: ~300 s
    timeout 560 $step --sections=copy,ar,spec --batches=8 --prefixes=1024,8192 \
      --attention=pallas,xla --spec_prefixes=1024 --budgets=chain,1,4,16,32,64,128,256 \
      --alt_runs=chain,32 --stage_runs=chain,32,256 --json_out="$out/step_b8.jsonl" \
      >"$out/step_b8.log" 2>&1
    ;;
  spec)  # ~330 s: compiled 4 at a time (the step timings are unaffected)
    timeout 400 $step --sections=copy,ar,spec --batches=1,8 --prefixes=1024 --spec_prefixes=1024 \
      --attention=pallas --budgets=chain,1,4,16,32,64,128,256 --stage_runs=32 --compile_threads=8 \
      --json_out="$out/step.jsonl" >"$out/step.log" 2>&1
    ;;
  profile)  # kernels per step (CUDA graphs off so that every kernel is traced): ~150 s
    timeout 200 $py -m experiments.perf.profile_step --runs=ar,chain,32,64 --batch=1 \
      --attention=pallas --steps=16 --top=40 >"$out/profile.log" 2>&1
    timeout 120 $py -m experiments.perf.profile_step --runs=32 --batch=8 --attention=pallas \
      --steps=16 --top=40 >>"$out/profile.log" 2>&1
    ;;
  profile_tp)  # needs 2 GPUs: the same at tp=2 (the batch-1 AR step is slower than at tp=1)
    timeout 400 $py -m experiments.perf.profile_step --runs=ar,32 --batch=1 --mesh_tp=2 \
      --attention=pallas --steps=16 >"$out/profile_tp.log" 2>&1
    ;;
  sweep)  # ~110 s for the trees, then the decode / drafter-block cells (T = 1, 16)
    timeout 300 $py -m experiments.perf.sweep_attention --json_out="$out/sweep.jsonl" \
      >"$out/sweep.log" 2>&1
    timeout 200 $py -m experiments.perf.sweep_attention --tokens=1,16 --block_rows=16,64 \
      --splits=1,2,4,8,16,32,64 --json_out="$out/sweep.jsonl" >>"$out/sweep.log" 2>&1
    ;;
  gemm)  # ~60 s: model.py's einsums vs bare 2-D matmuls vs the old stacked-first layout
    timeout 150 $py -m experiments.perf.bench_gemm --rows=1,17,33,65,129 --json_out="$out/gemm.jsonl" \
      >"$out/gemm.log" 2>&1
    ;;
  goals)  # ~210 s: batch 1, int8 drafter over 32768 ids; rounds from 16 vs 64 steps
    timeout 400 $step --repeats=5 --marginal_steps=64 --sections=ar,spec --batches=1 \
      --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=1 \
      --budgets=32,64 --drafters=int8:v32768 --json_out="$out/goals.jsonl" >"$out/goals.log" 2>&1
    ;;
  results)  # ~450 s: README's Results: goals' settings over chain and B=16..128, then `make demo`
    timeout 470 $step --repeats=5 --marginal_steps=64 --sections=copy,ar,spec --batches=1 \
      --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=4 \
      --budgets=chain,16,32,64,128 --drafters=int8:v32768 --json_out="$out/results.jsonl" \
      >"$out/results.log" 2>&1
    timeout 110 $py -m experiments.generate --config=configs/default.py >"$out/demo.log" 2>&1
    ;;
  int8)  # ~200 s: both drafters compiled and timed in one run, then XLA's GEMM per weight format
    timeout 280 $step --repeats=5 --sections=ar,spec --batches=1 --prefixes=1024 \
      --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=8 \
      --budgets=chain,32,64 --drafters=bf16,int8 --json_out="$out/int8_step.jsonl" \
      >"$out/int8_step.log" 2>&1
    timeout 200 $py -m experiments.perf.bench_gemm --formats=bf16,w8,w8a8,w8a8t,fp8 --rows=16,33 \
      --vocab=151936 >"$out/gemm_formats.log" 2>&1
    ;;
  quick)
    timeout 250 $step --repeats=5 --sections=ar,spec --batches=1,8 --prefixes=1024 \
      --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=8 \
      --budgets=chain,32,64,128 --json_out="$out/step.jsonl" >"$out/step.log" 2>&1
    ;;
  kernel)
    timeout 280 $py -m experiments.perf.bench_attention --batches=1 >"$out/attention.log" 2>&1
    timeout 280 $py -m experiments.perf.bench_attention --batches=8 >>"$out/attention.log" 2>&1
    ;;
  tp)
    for tp in 1 2; do
      timeout 230 $step --mesh_tp=$tp --sections=copy,ar,spec --batches=1,8 --prefixes=1024 \
        --attention=pallas --spec_prefixes=1024 --budgets=32 --nostages \
        --json_out="$out/tp.jsonl" >>"$out/tp.log" 2>&1
    done
    timeout 150 $py -m experiments.bench_matrix --config=configs/bench_matrix.py --mesh_tp=2 \
      --config.methods=ar,ddtree --config.budgets=32 --config.batches=8 \
      --config.max_new_tokens=64 --config.repeats=1 --config.profile= --config.progress=False \
      --config.out_dir="$out/tp2_divergence" >"$out/matrix.log" 2>&1
    tar -C "$out" -czf "$out/matrix.tgz" tp2_divergence 2>/dev/null && rm -r "$out/tp2_divergence"
    ;;
  matrix)
    # the bundled pair in float32 at full matmul precision: any divergence from AR is a bug.
    # Compile-bound: ~200 s per batch (25-73 s per program, 8 threads) on the H200 host
    JAX_DEFAULT_MATMUL_PRECISION=highest timeout 560 $py -m experiments.bench_matrix \
      --config=configs/bench_matrix.py:default --config.batches="${BATCHES:-1,4,16}" \
      --config.profile= --config.progress=False --config.out_dir="$out/mdef" >"$out/matrix.log" 2>&1
    tar -C "$out" -czf "$out/matrix.tgz" mdef 2>/dev/null && rm -r "$out/mdef"
    ;;
  temperature)  # ~150 s
    for t in 0.0 1.0; do
      JAX_DEFAULT_MATMUL_PRECISION=highest timeout 100 $py -m experiments.bench_matrix \
        --config=configs/bench_matrix.py:default --config.temperature=$t --config.budgets=32 \
        --config.batches=4 --config.max_new_tokens=96 --config.profile= --config.progress=False \
        --config.out_dir="$out/temp_$t" >>"$out/temperature.log" 2>&1
    done
    tar -C "$out" -czf "$out/temperature.tgz" temp_0.0 temp_1.0 2>/dev/null
    rm -rf "$out"/temp_*
    ;;
  m8b)
    # Qwen3-8B shape (random weights: step times, tau ~1); rows.jsonl keeps the cells of a cut run
    timeout 560 $py -m experiments.bench_matrix --config=configs/bench_matrix.py \
      --config.max_new_tokens=48 --config.repeats=2 --config.profile= --config.progress=False \
      --config.out_dir="$out/m8b" >"$out/m8b.log" 2>&1
    tar -C "$out" -czf "$out/m8b.tgz" m8b 2>/dev/null && rm -r "$out/m8b"
    ;;
  auto_shapes)  # bench_auto at batch 1 and 8 for each of SHAPES (default the Qwen3-8B shape),
                # after the floors' bandwidth probe (its rows in floors.log)
    timeout 60 $py -c "from experiments.perf import floors; print(floors.measure())" \
      >"$out/floors.log" 2>&1
    for s in ${SHAPES:-qwen3-8b}; do
      timeout "${AUTO_S:-540}" $py -m experiments.perf.bench_auto --shapes="$s" \
        --batches="${BATCHES:-1,8}" --json_out="$out/auto_$s.jsonl" >"$out/auto_$s.log" 2>&1
    done ;;
  serve_auto)  # bench_serve_auto: the slot server's budget="auto" vs its fixed budgets at
                # concurrency 1..32 on SHAPE (default the Qwen3-8B shape) under the benchmark drafter
    timeout "${AUTO_S:-540}" $py -m experiments.perf.bench_serve_auto --shape="${SHAPE:-qwen3-8b}" \
      --runs="${RUNS:-ar,8,16,32,64,auto}" --concurrency="${CONCURRENCY:-1,4,16,32}" \
      --levels="${LEVELS:-none:0:0.5,low:0.6,paper:0.9,high:0.95}" \
      --auto_costs="${AUTO_COSTS:-measure}" --json_out="$out/serve_auto.jsonl" \
      >"$out/serve_auto.log" 2>&1 ;;
  drafter_training)  # bench_drafter_training: feature capture and the training step (offline,
                     # online) at SHAPE (default the Qwen3-8B shape), random weights
    timeout "${TRAIN_S:-540}" $py -m experiments.perf.bench_drafter_training \
      --shape="${SHAPE:-qwen3-8b}" --json_out="$out/drafter_training.jsonl" \
      >"$out/drafter_training.log" 2>&1 ;;
  *) echo "usage: $0 compile|step|step8|spec|quick|goals|results|int8|profile|profile_tp|kernel|sweep|gemm|tp|matrix|temperature|m8b|moe|moe_pairs|moe_decode|moe_fused|moe_loop|target_sweep|pair_target|pair_rest|pair_drafter|hybrid|hybrid_moe|auto_shapes|serve_auto|drafter_training|mla|mla8k|latent|kimi OUT" >&2
     exit 2 ;;
esac
ls -la "$out"
