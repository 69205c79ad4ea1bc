# Two GPUs of one host: a blind grid's full-stack run on GPU 0 and its stock run on GPU 1 at once (their files and
# logs under $OUT), then both runs' offline summaries. After the wheel bundles are staged (shared/device/README.md).
#   bash benchmarks/gpu/run_blind_pair.sh blind16
set -u
here=$(dirname "$0")
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(CUDA_VISIBLE_DEVICES=0 bash "$here/run_profile_fa2_refresh.sh" "$1" full > "$OUT/$1_full.log" 2>&1) &
(CUDA_VISIBLE_DEVICES=1 bash "$here/run_profile_fa2_refresh.sh" "$1" stock > "$OUT/$1_stock.log" 2>&1) &
wait
for stack in full stock; do echo "== $1 $stack"; grep -v -e Warning -e exe_args "$OUT/$1_$stack.log" | tail -n 12; done
