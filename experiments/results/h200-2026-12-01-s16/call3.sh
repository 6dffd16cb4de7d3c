export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
B="--steps=16 --repeats=5 --sections=ar,spec --batches=1 --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=1 --budgets=32,64 --drafters=int8:v32768"
for i in 1 2 3; do python3 experiments/bench_step.py $B > $R/3_bench_new_$i.log 2>&1; done
JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_int8_drafter.py -k "not sharded" > $R/3_gpu_test_int8_drafter.log 2>&1
tail -2 $R/3_gpu_test_int8_drafter.log
grep -h "step_ms" $R/3_bench*.log | python3 -c "
import sys, json
for l in sys.stdin:
  d = json.loads(l[l.index('{'):])
  print(d['section'], d.get('budget',''), d['batch'], round(d['step_ms'],3), round(d.get('vs_ar_step', 0), 3))"
