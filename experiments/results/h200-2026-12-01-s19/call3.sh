export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
RUNS=ar:0:1,ddtree:32:1,ddtree:64:1 STEPS=16,64 REPS=3 timeout 280 python3 st.py > $R/3_steps.log 2>&1
grep -v "^I1\|^W1" $R/3_steps.log | grep "rep\|Error" | cut -c1-160
