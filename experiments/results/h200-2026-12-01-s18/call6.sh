export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
B="--steps=16 --repeats=5 --sections=ar,spec --batches=1 --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=1 --budgets=64 --drafters=int8:v32768"
for i in 1 2; do
  timeout 130 python3 experiments/bench_step.py $B > $R/6_bench$i.log 2>&1
  grep -h '"spec"\|"ar"' $R/6_bench$i.log | cut -c1-140
done
