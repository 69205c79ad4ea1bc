( source benchmarks/gpu/stock_env.sh
python3 benchmarks/bench_user_step.py --grid eval-blind-packed-19 --policies --tag stock --max-seconds ${STOCK_S:-240} --out $OUT/eval_blind_packed_19_stock_h200.json 2>&1 | grep -v -E "exe_args|UserWarning|warnings.warn" | tail -40 )
