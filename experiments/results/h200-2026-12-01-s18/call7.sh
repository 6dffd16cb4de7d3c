export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
JAX_PLATFORMS=cuda timeout 190 python3 -m pytest -p no:cacheprovider -rA tests/test_decode.py -k "ddtree_is_lossless and (8-7 or 8-8 or 8-15 or 8-16 or 8-31 or 8-32 or 8-64 or 8-128 or 8-256)" > $R/7_gpu_lossless_b8.log 2>&1
grep -c "^PASSED" $R/7_gpu_lossless_b8.log; grep -c "^FAILED" $R/7_gpu_lossless_b8.log; tail -1 $R/7_gpu_lossless_b8.log
