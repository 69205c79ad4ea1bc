source benchmarks/gpu/setup.sh
python3 benchmarks/bench_user_step.py --grid fit-unmasked --policies --max-seconds ${FIT_S:-220} --out $OUT/fit_unmasked_h200.json 2>&1 | grep -v -E "exe_args|UserWarning|warnings.warn" | tail -16
