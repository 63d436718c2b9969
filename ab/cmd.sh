export PYTHONPATH=$PWD:/tmp/site
pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 benchmarks/gdn_ab.py --variants gdn_base current gdn_reorder gdn_chan_reorder gdn_scaled --bs 64 128 --blocks 32 16 --rounds 1 > $OUT/ab.log 2>&1; echo "ab rc $?"
tail -3 $OUT/ab.log
timeout 230 python3 -m pytest -q -m gpu -n 4 --dist loadfile tests/ops/test_linear_ops.py tests/frontend/test_kimi_linear.py tests/test_gpu.py -p no:cacheprovider -x > $OUT/tests.log 2>&1; echo "tests rc $?"
tail -5 $OUT/tests.log
