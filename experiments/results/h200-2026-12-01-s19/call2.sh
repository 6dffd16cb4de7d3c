export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
RUNS=ar:0:1,ddtree:64:1 MERGES=xla,kernel_knew,kernel REPS=4 timeout 200 python3 mg.py > $R/2_mg.log 2>&1
grep -v "^I1\|^W1" $R/2_mg.log | grep "step_ms\|compiled\|Error" | cut -c1-150
