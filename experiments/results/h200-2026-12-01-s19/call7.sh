export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
timeout 200 python3 pc.py > $OUT/7_percall.log 2>&1
grep -v '^I1\|^W1' $OUT/7_percall.log | grep 'run\|Error' | cut -c1-220
