export PYTHONPATH=.:experiments PYTHONUNBUFFERED=1
R=$OUT
timeout 330 python3 spc.py > $R/5_steps_per_check.log 2>&1
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py -k steps_per_check > $R/5_gpu_test_steps_per_check.log 2>&1
