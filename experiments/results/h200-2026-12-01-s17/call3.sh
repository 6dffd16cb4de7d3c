export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
B="--steps=16 --repeats=5 --sections=spec --batches=1 --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=1 --budgets=64 --drafters=int8:v32768"
for i in 1 2; do
  LOOP=while python3 loopsync.py $B > $R/3_loop_while$i.log 2>&1
  LOOP=fori python3 loopsync.py $B > $R/3_loop_fori$i.log 2>&1
done
