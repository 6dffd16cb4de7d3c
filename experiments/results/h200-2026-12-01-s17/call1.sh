export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $R/gpu.txt
B="--steps=16 --repeats=5 --sections=ar,spec --batches=1 --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=1 --budgets=64 --drafters=int8:v32768"
P="--runs=64 --batch=1 --attention=pallas --steps=16 --top=40 --drafter_int8 --draft_vocab_first=32768"
JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_w8a8.py -k "not lowers and not in_dense" > $R/1_gpu_test_w8a8.log 2>&1
tail -2 $R/1_gpu_test_w8a8.log
for i in 1 2 3; do
  python3 experiments/bench_step.py $B > $R/1_bench_new$i.log 2>&1
  (cd old && PYTHONPATH=.:experiments python3 experiments/bench_step.py $B) > $R/1_bench_old$i.log 2>&1
  grep -h '"spec"' $R/1_bench_new$i.log $R/1_bench_old$i.log | cut -c1-200
done
timeout 120 python3 experiments/profile_step.py $P > $R/1_profile_new.log 2>&1
grep -h "== ddtree\|^tree \|^draft \|^accept\|^verify " $R/1_profile_new.log
