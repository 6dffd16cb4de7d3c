export PYTHONPATH=.:experiments:/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/ml*.whl
R=$OUT; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $R/gpu.txt
B="--steps=16 --repeats=5 --sections=ar,spec --batches=1 --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=1 --budgets=32,64 --drafters=int8:v32768"
P="--runs=32,64 --batch=1 --attention=pallas --steps=16 --top=60 --drafter_int8 --draft_vocab_first=32768"
python3 experiments/profile_step.py $P > $R/1_profile_new.log 2>&1
(cd old && PYTHONPATH=.:experiments:/tmp/site python3 experiments/bench_step.py $B) > $R/1_bench_old.log 2>&1
python3 experiments/bench_step.py $B > $R/1_bench_new.log 2>&1
(cd old && PYTHONPATH=.:experiments:/tmp/site python3 experiments/bench_step.py $B) > $R/1_bench_old2.log 2>&1
python3 experiments/bench_step.py $B > $R/1_bench_new2.log 2>&1
grep -h "step_ms\|== ddtree\|^tree \|^draft \|^accept" $R/*.log | cut -c1-220
