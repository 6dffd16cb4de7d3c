export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
B="--steps=16 --repeats=5 --sections=ar,spec --batches=1 --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=1 --budgets=64 --drafters=int8:v32768"
(cd old && PYTHONPATH=.:experiments python3 experiments/bench_step.py $B) > $R/6_bench_old.log 2>&1
python3 experiments/bench_step.py $B > $R/6_bench_new.log 2>&1
JAX_PLATFORMS=cuda timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_silu_quant.py -k "not lowers" > $R/6_gpu_test_silu_quant.log 2>&1
tail -2 $R/6_gpu_test_silu_quant.log
for f in $R/6_bench_*.log; do echo $f; grep -h "step_ms" $f | python3 -c "
import sys, json
for l in sys.stdin:
  d = json.loads(l[l.index('{'):])
  print(d['section'], d.get('budget',''), d['batch'], round(d['step_ms'],3), round(d.get('vs_ar_step', 0), 3))"; done
