#!/usr/bin/env bash
# One GPU-machine call, several stages: bash benchmarks/gpu/run_suite.sh STAGE [STAGE ...]
# Stages: tests-cudnn tests-flash tests-thd tests-unfused tests-kv bench-cudnn bench-flash bench-memory probe policy policy-grid hotpath kv-decode
# Source the wheel bundles first (../shared/device/README.md); logs and JSON go to $OUT.
# A failing stage does not stop the next; a short summary is printed last.
set -u
source "$(dirname "$0")/setup.sh"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
summary=()
stage() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-14s rc=%-4s %4ss' "$name" "$rc" $((SECONDS - start)))")
  grep -vE "leaked|nanobind|^ - |Target directory" "$OUT/$name.log" | tail -n "${TAIL:-25}"
}
for s in "$@"; do
  case $s in
    tests-cudnn) stage $s 300 python3 -m pytest -m gpu tests/gpu/test_cudnn_gpu.py -q -p no:cacheprovider -rf ;;
    tests-flash) stage $s 330 python3 -m pytest -m gpu tests/gpu/test_flash_gpu.py -q -p no:cacheprovider -rf ;;
    tests-thd) stage $s 420 python3 -m pytest -m gpu tests/gpu/test_thd_host_gpu.py -q -p no:cacheprovider -rf ;;
    tests-unfused) stage $s 200 python3 -m pytest -m gpu tests/test_unfused_engine.py tests/test_module.py -q -p no:cacheprovider -rf ;;
    bench-cudnn) stage $s 300 python3 benchmarks/bench_cudnn.py --out "$OUT/cudnn.json" ;;
    bench-flash) stage $s 300 python3 benchmarks/bench_flash.py --out "$OUT/flash.json" ;;
    bench-memory) stage $s 150 python3 benchmarks/bench_unfused_memory.py --device cuda --out "$OUT/unfused_memory_cuda.json" ;;
    probe) TAIL=40 stage $s 540 python3 -m attn_dispatch probe --json "$OUT/probe.json" ;;
    policy) TAIL=60 stage $s 540 python3 benchmarks/bench_policy.py --out "$OUT/policy.json" ;;
    policy-grid) TAIL=80 stage $s 570 python3 benchmarks/bench_policy.py --skip hotpath,graph,compile --out "$OUT/policy_grid.json" ;;
    hotpath) TAIL=20 stage $s 200 python3 benchmarks/bench_policy.py --skip grid --out "$OUT/hotpath.json" ;;
    tests-kv) stage $s 300 python3 -m pytest -m gpu tests/gpu/test_kv_cache_gpu.py -q -p no:cacheprovider -rf ;;
    kv-decode) TAIL=60 stage $s 480 python3 benchmarks/bench_kv_decode.py ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
printf '%s\n' "${summary[@]}"
