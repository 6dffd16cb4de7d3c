export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_pallas_engine.py > $R/5_gpu_test_pallas_engine.log 2>&1
tail -2 $R/5_gpu_test_pallas_engine.log
JAX_PLATFORMS=cuda timeout 230 python3 -m pytest -q -p no:cacheprovider -x tests/test_decode.py -k "ddtree_is_lossless or switching or topk1" > $R/5_gpu_test_decode.log 2>&1
tail -2 $R/5_gpu_test_decode.log
