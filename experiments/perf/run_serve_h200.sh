#!/usr/bin/env bash
# The serving measurements on one H200 (WORKSPACE.md, Serving), ~450 s. From the repository root:
#
#   bash experiments/perf/run_serve_h200.sh OUT
#
# (a) installs the serving wheels of .whl/ (fastapi, uvicorn, pydantic, openai, ml_collections,
#     ...; pip download, see WORKSPACE.md) into $SITE; (b) bench_slots (<= 240 s): the slot
#     engine's step vs the static decode loop's, Qwen3-8B shape, AR and DDTree B=16 / 64 at 1, 8,
#     16, 32 slots; (c) (~200 s) the bundled pair served by experiments/serve.py as AR, chain,
#     DDTree B=16 and B=64: the four servers start together (compiling at once), then are
#     measured one at a time by the HTTP harness at concurrency 1, 4, 16, 32 (TTFT p50 / p99,
#     TPOT, tokens/s, acceptance), then stopped; then in-process generate at concurrency 1 for
#     the same runs (the "HTTP within 5 % of in-process" check).
# OUT gets 6 files: slots.log, slots.jsonl (b); serve.log (pip and the servers), http.log,
# serve.jsonl (HTTP and in-process rows) (c); summary.txt (GPU, the two tables).
# Every step runs under `timeout`; a cut step leaves the rows it wrote.
# Env: PYTHON (python3), SITE (/tmp/site), SLOTS (32, server decode slots), SMALL=1: a CPU dry
# run (tiny bench_slots, AR and B=16 servers with 2 slots, short levels).
set -u
out=${1:?usage: bash experiments/perf/run_serve_h200.sh OUT}
mkdir -p "$out"
py=${PYTHON:-python3}
site=${SITE:-/tmp/site}
tmp=$(mktemp -d)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
t_start=$SECONDS

# (a) wheels
: >"$out/serve.log"
if ls .whl/*.whl >/dev/null 2>&1; then
  timeout 120 $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl >>"$out/serve.log" 2>&1 || echo "pip install failed" >&2
fi
export PYTHONPATH=$PWD:$site

if [ "${SMALL:-0}" = 1 ]; then
  slots_args="--small --runs=ar,16 --slots=1,2 --steps=4 --repeats=1 --compile_threads=2"
  runs="ar 16"; slots=2; levels=1,2; per_level=2; tokens=8; repeats=1
  t_ready=300; t_http=120; t_inproc=300; t_slots=300
else
  slots_args=""
  runs="ar chain 16 64"; slots=${SLOTS:-32}; levels=1,4,16,32; per_level=32; tokens=64; repeats=3
  t_ready=110; t_http=25; t_inproc=70; t_slots=${T_SLOTS:-240}
fi

# (b) slot engine vs static decode loop
timeout $t_slots $py -m experiments.perf.bench_slots $slots_args --json_out="$out/slots.jsonl" \
  >"$out/slots.log" 2>&1
echo "bench_slots: rc $?, $((SECONDS - t_start)) s" >>"$out/serve.log"

# (c) four servers of the bundled pair, started together, measured one at a time
server_args() {  # run -> serve config overrides
  case $1 in
    ar|chain) echo "--config.serve.method=$1" ;;
    *) echo "--config.serve.method=ddtree --config.serve.budget=$1" ;;
  esac
}
pids=()
port=8101
for r in $runs; do
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 timeout $((t_ready + 4 * t_http + 30)) \
    $py -m experiments.serve --config=configs/serve.py $(server_args "$r") \
    --config.serve.port=$port --config.serve.slots=$slots --config.serve.capacity=512 \
    --config.serve.model_name="bundled-$r" > >(sed -u "s/^/[$r] /" >>"$out/serve.log") 2>&1 &
  pids+=($!)
  port=$((port + 1))
done
deadline=$((SECONDS + t_ready))
i=0
for r in $runs; do
  until grep -q "^\[$r\] ready:" "$out/serve.log"; do
    if [ $SECONDS -ge $deadline ] || ! kill -0 "${pids[$i]}" 2>/dev/null; then
      echo "[$r] not ready ($((SECONDS - t_start)) s)" >>"$out/serve.log"; break
    fi
    sleep 1
  done
  i=$((i + 1))
done
echo "servers ready: $((SECONDS - t_start)) s" >>"$out/serve.log"
port=8101
for r in $runs; do
  if grep -q "^\[$r\] ready:" "$out/serve.log"; then
    timeout $t_http $py -m experiments.http_bench --config=configs/default.py \
      --config.endpoint=http://127.0.0.1:$port --config.concurrency=$levels \
      --config.requests_per_level=$per_level --config.max_new_tokens=$tokens \
      --config.out_dir="$tmp" --label="$r" --json_out="$out/serve.jsonl" >>"$out/http.log" 2>&1
    echo "http $r: rc $?, $((SECONDS - t_start)) s" >>"$out/serve.log"
  fi
  port=$((port + 1))
done
for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
wait "${pids[@]}" 2>/dev/null
timeout $t_inproc $py -m experiments.http_bench --config=configs/default.py \
  --in_process="${runs// /,}" --capacity=512 --config.max_new_tokens=$tokens \
  --config.repeats=$repeats --json_out="$out/serve.jsonl" >>"$out/http.log" 2>&1
echo "in-process: rc $?, $((SECONDS - t_start)) s" >>"$out/serve.log"

{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | head -3
  git log -1 --format='commit %h %cd' 2>/dev/null
  echo "total $((SECONDS - t_start)) s"
  sed -n '/^== slot engine step/,/^total/p' "$out/slots.log"
  $py - "$out/serve.jsonl" <<'EOF'
import json, sys
try:
  rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
except OSError:
  rows = []
inproc = {r["label"]: r for r in rows if r["mode"] == "in_process"}
fmt = lambda v, f: "-" if v is None else format(v, f)
print("\n== HTTP (bundled pair) vs in-process generate at concurrency 1")
print(f"{'run':<7}{'conc':>5}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT ms':>9}"
      f"{'accept':>8}{'in-proc tok/s':>15}{'http/in-proc':>14}")
for r in rows:
  if r["mode"] != "http":
    continue
  base = inproc.get(r["label"]) if r["concurrency"] == 1 else None
  ratio = r["tokens_per_second"] / base["tokens_per_second"] if base else None
  print(f"{r['label']:<7}{r['concurrency']:>5}{r['tokens_per_second']:>9.1f}"
        f"{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>10.1f}{fmt(r['tpot_ms'], '.2f'):>9}"
        f"{fmt(r['acceptance_length'], '.2f'):>8}"
        f"{fmt(base and base['tokens_per_second'], '.1f'):>15}{fmt(ratio, '.3f'):>14}")
EOF
} >"$out/summary.txt" 2>&1
rm -rf "$tmp"
cat "$out/summary.txt"
ls -la "$out"
