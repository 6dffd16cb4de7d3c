export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
XLA_FLAGS=--help python3 -c "import jax; jax.numpy.zeros(3)" > $R/4_xla_help.txt 2>&1
grep -i "command_buffer\|graph_min\|graph_level\|while_loop" $R/4_xla_help.txt | cut -c1-300
B="--steps=16 --repeats=5 --sections=ar,spec --batches=1 --prefixes=1024 --spec_prefixes=1024 --attention=pallas --nostages --compile_threads=1 --budgets=64 --drafters=int8:v32768"
python3 experiments/bench_step.py $B > $R/4_bench_base.log 2>&1
XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" python3 experiments/bench_step.py $B > $R/4_bench_while.log 2>&1
XLA_FLAGS="--xla_gpu_graph_min_graph_size=1" python3 experiments/bench_step.py $B > $R/4_bench_min1.log 2>&1
for f in $R/4_bench_*.log; do echo $f; grep -h "step_ms" $f | python3 -c "
import sys, json
for l in sys.stdin:
  d = json.loads(l[l.index('{'):])
  print(d['section'], d.get('budget',''), d['batch'], round(d['step_ms'],3), round(d.get('vs_ar_step', 0), 3))"; grep -h "Error\|error" $f | head -3; done
