export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_pallas_engine.py > $R/5_gpu_pallas_engine.log 2>&1
tail -2 $R/5_gpu_pallas_engine.log
JAX_PLATFORMS=cuda timeout 260 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py -v -k "ddtree_is_lossless" > $R/5_gpu_lossless.log 2>&1
tail -3 $R/5_gpu_lossless.log; grep -c "PASSED" $R/5_gpu_lossless.log
grep -c "FAILED" $R/5_gpu_lossless.log
