export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
B="--steps=16 --marginal_steps=64 --repeats=5 --sections=ar,spec --batches=1 --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=1 --drafters=int8:v32768"
timeout 300 python3 experiments/bench_step.py $B --budgets=chain,16,128 > $R/5_bench_round_sweep.log 2>&1
grep -v "^I1\|^W1" $R/5_bench_round_sweep.log | tail -6
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 200 python3 experiments/bench_step.py $B --budgets=64 > $R/5_bench_round_nographs.log 2>&1
grep -v "^I1\|^W1" $R/5_bench_round_nographs.log | tail -5
