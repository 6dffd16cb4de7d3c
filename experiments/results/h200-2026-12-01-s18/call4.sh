export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
RUNS=ddtree:64:1 MODES=LHS,CONCURRENT PF=32x8,64x8 REPS=8 timeout 240 python3 cb.py > $R/4_cb_pf.log 2>&1
grep -v "^I1\|^W1" $R/4_cb_pf.log | grep step_ms | cut -c1-160
B="--steps=16 --repeats=5 --sections=ar,spec --batches=1 --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=1 --budgets=32,64 --drafters=int8:v32768"
timeout 150 python3 experiments/bench_step.py $B > $R/4_bench.log 2>&1
grep -v "^I1\|^W1" $R/4_bench.log | tail -8
JAX_PLATFORMS=cuda timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_edges.py tests/test_decode.py -k "switching or topk1 or steps_per_check or canary or capacity or stop" > $R/4_gpu_tests.log 2>&1
tail -3 $R/4_gpu_tests.log
