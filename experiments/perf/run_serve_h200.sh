#!/usr/bin/env bash
# The serving measurements on one H200 (WORKSPACE.md, Serving), one run of <= ~8 min. From the
# repository root:
#
#   bash experiments/perf/run_serve_h200.sh OUT
#
# (a) installs the serving wheels of .whl/ (fastapi, uvicorn, pydantic, openai, ml_collections,
#     ...; see experiments/results/serving-2026-12-02/NOTES.md) into $SITE.
# (b) starts nine servers at once (experiments/serve.py; they compile together, then wait):
#     five of the Qwen3-8B shape (random bf16 weights, a random 5-layer int8 DFlash drafter over
#     ids 0..32767, as bench_slots; prompts encoded and ids decoded by the bundled target's
#     tokenizer): AR, DDTree B=16 and B=64 with 1 slot, AR and B=16 with 4 slots (capacity 512);
#     and four of the bundled pair (float32): AR, chain, B=16, B=64 with $SLOTS slots.
# (c) the 8B servers over HTTP (experiments/http_bench.py, 64 streaming tokens per request):
#     concurrency 1 (8 requests) on every one, 4 (8 requests) on the 4-slot ones; then stops
#     them and runs in-process `generate` (batch 1, the same prompt ids, capacity 512) for AR,
#     B=16, B=64: the "HTTP within 5 % of in-process at concurrency 1" check.
# (d) the bundled servers at concurrency 1, 4, 16, 32 (32 requests per level); then in-process
#     generate for AR, chain, B=16, B=64.
# After each server's HTTP run its /health counters (chunks, steps, host seconds dispatching,
# waiting and streaming) go to health.jsonl.
# OUT gets: run.log (each step's rc and the elapsed seconds), serve.log (pip and every server's
# log, lines prefixed [label]), http.log (the harness's output), serve.jsonl (HTTP and in-process
# rows), health.jsonl, summary.txt (GPU, commit, the tables of experiments/perf/serve_summary.py;
# also printed). Every step runs under `timeout`, cut to what is left of BUDGET_S (default 470
# s; a step with < 5 s left is skipped); rows are written as they come, so a cut run keeps them.
# Labels: HTTP "MODEL:RUN/SLOTS" (8b:16/1, pair:ar/32), in-process "MODEL:RUN".
# Env: PYTHON (python3), SITE (/tmp/site), SLOTS (32: the bundled servers' slots), BUDGET_S,
# BIG_RUNS (the 8B servers as RUN/SLOTS; "" runs none), PAIR_RUNS (the bundled servers: ar,
# chain, a budget or auto),
# BENCH_SLOTS=1 (first bench_slots: the slot step vs the static loop at 1-32 slots, up to T_SLOTS
# = 240 s more), SMALL=1 (a CPU dry run: a tiny random target for the 8B one, two bundled servers
# of 2 slots, short levels).
set -u
out=${1:?usage: bash experiments/perf/run_serve_h200.sh OUT}
mkdir -p "$out"
py=${PYTHON:-python3}
site=${SITE:-/tmp/site}
tmp=$(mktemp -d)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
t0=$SECONDS
: >"$out/run.log"
: >"$out/serve.log"
: >"$out/http.log"
: >"$out/health.jsonl"

note() { echo "[$((SECONDS - t0)) s] $*" | tee -a "$out/run.log"; }
left() { echo $((budget - (SECONDS - t0))); }
step() {  # step NAME SECONDS CMD...: CMD under timeout min(SECONDS, budget left); skipped < 5 s
  local name=$1 want=$2 t
  shift 2
  t=$(left)
  [ "$want" -lt "$t" ] && t=$want
  if [ "$t" -lt 5 ]; then note "$name: skipped (time budget spent)"; return 124; fi
  timeout "$t" "$@"
  local rc=$?
  note "$name: rc $rc"
  return $rc
}

if [ "${SMALL:-0}" = 1 ]; then
  budget=${BUDGET_S:-1500}
  tiny=(--config.dtype=float32 --config.shape.vocab_size=4096 --config.shape.hidden_size=64
        --config.shape.intermediate_size=128 --config.shape.num_layers=2
        --config.shape.num_heads=2 --config.shape.num_kv_heads=1 --config.shape.head_dim=32
        --config.drafter_shape.num_layers=1)
  vocab=1024; big_runs=${BIG_RUNS-"ar/1 16/1 ar/2"}; big_levels=2; pair_runs=${PAIR_RUNS:-"ar 16"}
  slots=2
  pair_levels=1,2; per_level=2; tokens=8; repeats=1; t_ready=900; t_http=120; t_inproc=400
  slots_args="--small --runs=ar --slots=1 --steps=4 --repeats=1 --compile_threads=2"
  t_slots=300
else
  budget=${BUDGET_S:-470}
  tiny=(--config.dtype=bfloat16)
  vocab=32768; big_runs=${BIG_RUNS-"ar/1 16/1 64/1 ar/4 16/4"}; big_levels=4
  pair_runs=${PAIR_RUNS:-"ar chain 16 64"}
  slots=${SLOTS:-32}; pair_levels=1,4,16,32; per_level=32; tokens=64; repeats=3
  t_ready=240; t_http=40; t_inproc=150; slots_args=""; t_slots=${T_SLOTS:-240}
fi
[ "${BENCH_SLOTS:-0}" = 1 ] && budget=$((budget + t_slots))
tok_dir=ddtree_jax/default_model/target
big=(--config.random_target=True --config.random_drafter=True --config.drafter=
     --config.drafter_int8=True --config.draft_vocab="$tmp/vocab.npy" "${tiny[@]}")

# (a) wheels
if ls .whl/*.whl >/dev/null 2>&1; then
  step pip 120 $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site" .whl/*.whl >>"$out/serve.log" 2>&1
fi
export PYTHONPATH=$PWD:$site${PYTHONPATH:+:$PYTHONPATH}
$py -c "import numpy; numpy.save('$tmp/vocab.npy', numpy.arange($vocab))" || note "no numpy?"

if [ "${BENCH_SLOTS:-0}" = 1 ]; then
  step bench_slots "$t_slots" $py -m experiments.perf.bench_slots $slots_args \
    --json_out="$out/slots.jsonl" >"$out/slots.log" 2>&1
fi

# (b) every server at once; each under a timeout that ends it with the budget
run_args() {  # RUN -> serve config overrides (ar, chain or a DDTree budget)
  case $1 in
    ar|chain) echo "--config.serve.method=$1" ;;
    *) echo "--config.serve.method=ddtree --config.serve.budget=$1" ;;
  esac
}
declare -A pid port
start() {  # start LABEL PORT ENV... -- SERVE_ARGS...
  local label=$1 p=$2 envs=()
  shift 2
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  local t=$(left)
  [ "$t" -lt 1 ] && t=1  # (timeout 0 would mean none)
  env "${envs[@]}" timeout "$t" $py -m experiments.serve --config=configs/serve.py "$@" \
    --config.serve.port="$p" --config.serve.model_name="${label//[:\/]/-}" \
    > >(sed -u "s|^|[$label] |" >>"$out/serve.log") 2>&1 &
  pid[$label]=$!
  port[$label]=$p
}
n=8201
for r in $big_runs; do
  start "8b:$r" $n XLA_PYTHON_CLIENT_MEM_FRACTION=0.17 -- "${big[@]}" $(run_args "${r%/*}") \
    --config.serve.slots="${r#*/}" --config.serve.capacity=512 --config.serve.prompt_buckets=16 \
    --config.serve.tokenizer=$tok_dir
  n=$((n + 1))
done
n=8101
for r in $pair_runs; do
  start "pair:$r/$slots" $n XLA_PYTHON_CLIENT_PREALLOCATE=false -- $(run_args "$r") \
    --config.serve.slots="$slots" --config.serve.capacity=512
  n=$((n + 1))
done
ready() {  # ready LABEL SECONDS: waits for the server's "ready:" line
  local deadline=$((SECONDS + $2))
  until grep -q "^\[$1\] ready:" "$out/serve.log"; do
    if [ $SECONDS -ge $deadline ] || [ "$(left)" -lt 5 ] || ! kill -0 "${pid[$1]}" 2>/dev/null
    then
      note "[$1] not ready"
      return 1
    fi
    sleep 1
  done
  note "[$1] ready"
}
http() {  # http LABEL LEVELS REQUESTS_PER_LEVEL: the harness, then the server's /health
  step "http $1" "$t_http" $py -m experiments.http_bench --config=configs/default.py \
    --config.endpoint="http://127.0.0.1:${port[$1]}" --config.concurrency="$2" \
    --config.requests_per_level="$3" --config.max_new_tokens=$tokens --config.out_dir="$tmp" \
    --label="$1" --json_out="$out/serve.jsonl" >>"$out/http.log" 2>&1
  $py - "${port[$1]}" "$1" >>"$out/health.jsonl" 2>>"$out/run.log" <<'EOF'
import json, sys, urllib.request
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=10) as r:
  print(json.dumps(dict(json.load(r), label=sys.argv[2])))
EOF
}
stop() {  # stop LABEL...
  for label in "$@"; do kill "${pid[$label]}" 2>/dev/null; done
  for label in "$@"; do wait "${pid[$label]}" 2>/dev/null; done
}

# (c) the 8B shape: HTTP at concurrency 1 (and 4 on 4 slots), then in-process
# Every server is ready (compiled) before any is measured: a server measured while others still
# compile shares the host with them (on 2026-12-02 the first-ready 8B server read 0.34x).
big_labels=()
for r in $big_runs; do big_labels+=("8b:$r"); done
pair_labels=()
for r in $pair_runs; do pair_labels+=("pair:$r/$slots"); done
ready_at=$((SECONDS + t_ready))
declare -A up
for label in "${big_labels[@]}" "${pair_labels[@]}"; do
  ready "$label" $((ready_at - SECONDS)) && up[$label]=1
done
for label in "${big_labels[@]}"; do
  if [ -n "${up[$label]:-}" ]; then
    levels=1
    [ "${label#*/}" != 1 ] && levels=1,$big_levels
    http "$label" $levels 8
  fi
done
stop "${big_labels[@]}"
inproc=$(for r in $big_runs; do echo "${r%/*}"; done | sort -u | paste -sd,)
[ -n "$inproc" ] && step "in-process 8b" "$t_inproc" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 $py \
  -m experiments.http_bench --config=configs/default.py "${big[@]}" --in_process="$inproc" \
  --tokenizer=$tok_dir \
  --label=8b --capacity=512 --config.max_new_tokens=$tokens --config.repeats=$repeats \
  --json_out="$out/serve.jsonl" >>"$out/http.log" 2>&1

# (d) the bundled pair
for label in "${pair_labels[@]}"; do
  [ -n "${up[$label]:-}" ] && http "$label" $pair_levels $per_level
done
stop "${pair_labels[@]}"
step "in-process pair" "$t_inproc" $py -m experiments.http_bench --config=configs/default.py \
  --in_process="${pair_runs// /,}" --label=pair --capacity=512 --config.max_new_tokens=$tokens \
  --config.repeats=$repeats --json_out="$out/serve.jsonl" >>"$out/http.log" 2>&1

{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | head -3
  git log -1 --format='commit %h %cd' 2>/dev/null
  git status --short -- ddtree_jax experiments configs 2>/dev/null | head -20
  echo "total $((SECONDS - t0)) s (budget $budget s); steps:"
  cat "$out/run.log"
  grep -h "\] ready:" "$out/serve.log" | sed 's/(compilation cache [^)]*), //'
  [ -s "$out/slots.log" ] && sed -n '/^== slot engine step/,/^total/p' "$out/slots.log"
  echo
  echo "8b: the Qwen3-8B shape, random bf16 weights, random 5-layer int8 DFlash drafter over ids"
  echo "    0..32767 (acceptance ~1: these rows time steps, not speculation); prompts encoded by"
  echo "    the bundled tokenizer; pair: the bundled pair, float32. Labels MODEL:RUN/SLOTS."
  echo "    $tokens tokens a request, streaming; in-proc: dj.generate at batch 1, tokens over the"
  echo "    call's wall time (prefill included), the same prompt ids, capacity 512."
  echo "    (8b servers compiled 5 at a time beside the pair's, in-process 3 at a time: concurrent"
  echo "    compiles move GEMM picks by up to ~3 %, docs/findings/compile-time.md.)"
  echo
  $py -m experiments.perf.serve_summary "$out/serve.jsonl" "$out/health.jsonl"
} >"$out/summary.txt" 2>&1
rm -rf "$tmp"
cat "$out/summary.txt"
ls -la "$out"
