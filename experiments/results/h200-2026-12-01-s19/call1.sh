export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $R/gpu.txt
JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_pallas_attention.py > $R/1_gpu_test_attention.log 2>&1
tail -3 $R/1_gpu_test_attention.log
timeout 100 python3 stress.py 500 > $R/1_stress.log 2>&1
grep -v "^I1\|^W1" $R/1_stress.log | tail -6
RUNS=ar:0:1,ddtree:32:1,ddtree:64:1 REPS=4 timeout 220 python3 mg.py > $R/1_mg.log 2>&1
grep -v "^I1\|^W1" $R/1_mg.log | grep "step_ms\|compiled\|Error" | cut -c1-150
B="--steps=16 --repeats=5 --sections=ar,spec --batches=1 --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=1 --budgets=32,64 --drafters=int8:v32768"
timeout 140 python3 experiments/bench_step.py $B > $R/1_bench.log 2>&1
grep -v "^I1\|^W1" $R/1_bench.log | tail -8
