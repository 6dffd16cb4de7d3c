export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
B="--steps=16 --marginal_steps=64 --repeats=5 --sections=ar,spec --batches=1 --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=1 --budgets=32,64 --drafters=int8:v32768"
for i in 1 2; do
timeout 270 python3 experiments/bench_step.py $B > $R/4_bench_round_$i.log 2>&1
grep -v "^I1\|^W1" $R/4_bench_round_$i.log | tail -6
done
