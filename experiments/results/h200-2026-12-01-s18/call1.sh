export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $R/gpu.txt
PF_CHECK=1 timeout 520 python3 cb.py > $R/1_cb.log 2>&1
grep -v "^I1\|^W1" $R/1_cb.log | tail -40
