#!/usr/bin/env bash
# Issue 12 (session 10): each provider's step split into host and GPU time over the profile's source grids on the
# H200 (session 9 measured the H100), unfused:pytorch left out (it synchronises inside its call: no split).
#   bash benchmarks/gpu/run_profile_session10.sh split START SECS   # full stack (after .gpu-wheels/b)
#   bash benchmarks/gpu/run_profile_session10.sh repeat full|stock [START]  # eval-blind6 again, as session 9 ran it
#                                                   # (no split): is each row's ratio reproducible on another lease?
# JSON under $OUT; a run stopped by SECS prints where it stopped: the next call's START.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
tag=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100')")
SOURCES=fit,fit-drawn-a,fit-drawn-b,fit-drawn-c,fit-extra,fit-gqa,fit-thd,eval,eval-fresh  # the profile's grids
FUSED=cudnn_fused:frontend,cudnn_fused:torch,flash_attn_4:cute,flash_attn_2:torch
case ${1:-} in
  split)
    source "$(dirname "$0")/setup.sh" > /dev/null
    file="split_fit_${tag}_from$2.json"
    timeout $(($3 + 60)) python3 benchmarks/bench_user_step.py --grid "$SOURCES" --split-only --start "$2" \
      --providers "$FUSED" --max-seconds "$3" --out "$OUT/$file" 2>&1 | tail -n 4
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print('stopped_at', d.get('stopped_at'))" \
      "$OUT/$file"
    ;;
  repeat)
    start=${3:-0}
    if [ "${2:-}" = stock ]; then
      source "$(dirname "$0")/stock_env.sh"
      file="blind6_repeat_stock_${tag}_from${start}.json"; stack=(--tag stock)
    else
      source "$(dirname "$0")/setup.sh" > /dev/null
      file="blind6_repeat_${tag}_from${start}.json"; stack=()
    fi
    timeout 560 python3 benchmarks/bench_user_step.py --grid eval-blind6 --policies --measured --reps 16 \
      --start "$start" --max-seconds 480 "${stack[@]}" --out "$OUT/$file" 2>&1 | tail -n 3
    python3 benchmarks/evaluate_profile.py --timed "$OUT/$file" | tail -n 9
    ;;
  *) echo "usage: run_profile_session10.sh split START SECS | repeat full|stock [START]"; exit 2 ;;
esac
