export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_tree.py > $R/2_gpu_test_tree.log 2>&1
S="--sections=ar,spec --batches=1,8 --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=8 --steps=16 --repeats=3 --drafters=int8:v32768"
python3 experiments/bench_step.py $S --budgets=chain,16,32,64,128,256 > $R/2_sweep_new.log 2>&1
(cd old && PYTHONPATH=.:experiments python3 experiments/bench_step.py $S --sections=spec --budgets=128,256) > $R/2_sweep_old_128_256.log 2>&1
tail -2 $R/2_gpu_test_tree.log
grep -h "step_ms" $R/2_sweep*.log | python3 -c "
import sys, json
for l in sys.stdin:
  d = json.loads(l[l.index('{'):])
  print(d['section'], d.get('method','ar'), d.get('budget',''), d['batch'], round(d['step_ms'],3))"
