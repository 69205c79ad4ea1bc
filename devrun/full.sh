source benchmarks/gpu/setup.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
grep -m1 "model name" /proc/cpuinfo; nproc
python3 benchmarks/bench_user_step.py --grid eval-blind-packed-19 --policies --max-seconds 500 --out $OUT/eval_blind_packed_19_h200_full.json 2>&1 | grep -v -E "exe_args|UserWarning|warnings.warn" | tail -45
