export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 200 python3 pc.py > $OUT/8_percall_nographs.log 2>&1
grep -v '^I1\|^W1' $OUT/8_percall_nographs.log | grep 'run\|Error' | cut -c1-220
