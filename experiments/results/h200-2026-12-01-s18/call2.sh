export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
PF=32x8,64x8,128x8,256x8,128x4 VARIANTS=ddtree64:lhs,ddtree64:concurrent,ddtree64:concurrent+pf32x8,ddtree64:concurrent+pf64x8,ddtree64:concurrent+pf128x8,ddtree64:concurrent+pf256x8,ddtree64:concurrent+pf128x4 REPS=4 timeout 520 python3 cb.py > $R/2_cb.log 2>&1
grep -v "^I1\|^W1" $R/2_cb.log | tail -40
