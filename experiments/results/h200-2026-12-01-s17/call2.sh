# with rejected_w8a8_glue.patch applied and 2_kbench_w8a8.py copied to the repo root as kbench.py
export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1 XLA_FLAGS=--xla_gpu_enable_command_buffer=
timeout 400 python3 kbench.py
