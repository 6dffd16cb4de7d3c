export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
RUNS=ar:0:1,chain:0:1,ddtree:16:1,ddtree:32:1,ddtree:128:1,ddtree:64:8,ddtree:256:8 REPS=3 timeout 560 python3 cb.py > $R/3_cb_sweep.log 2>&1
grep -v "^I1\|^W1" $R/3_cb_sweep.log | tail -70
