export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
B="--steps=16 --repeats=5 --sections=spec --batches=1 --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=1 --budgets=64 --drafters=int8:v32768"
LOOP=chunk2 python3 loopsync.py $B > $R/4_loop_chunk2.log 2>&1
LOOP=while python3 loopsync.py $B > $R/4_loop_while.log 2>&1
LOOP=chunk4 python3 loopsync.py $B > $R/4_loop_chunk4.log 2>&1
LOOP=fori python3 loopsync.py $B > $R/4_loop_fori.log 2>&1
XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL LOOP=foricond timeout 150 python3 loopsync.py $B > $R/4_loop_foricond.log 2>&1
