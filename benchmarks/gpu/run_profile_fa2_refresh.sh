#!/usr/bin/env bash
# Issue 12, after session 11's change to torch FA2's bound call (bshd through aten::_flash_attention_forward: 3-12 us
# less host time per forward, 40-175 us per training step on the H100): the profile's FA2 host times predate it.
#   bash benchmarks/gpu/run_profile_fa2_refresh.sh refresh START SECS   # FA2's split over the profile's source
#        grids, stock torch (FA2 is torch's own: no wheel bundles needed); a stopped run prints its next START
#   bash benchmarks/gpu/run_profile_fa2_refresh.sh blind7|blind8|blind9 full|stock [START]   # eval-blind7 (committed
#        unmeasured in session 11, measured in session 12 but for the H200 full stack) or eval-blind8 (committed
#        unmeasured in session 12), as blind6 was run: --policies --measured, block timer, --reps 16 (blind8:
#        --reps 48, fixed in session 12 before it was measured: the A/A control's 90th-percentile spread on calls
#        under 1 ms was 4-6% with 16 samples a column, which alone puts rows over the issue's 1.05; the measured
#        policy no longer probes the unfused engine on a GPU, which was ~80% of a blind run's time); eval-blind9
#        (committed unmeasured in session 13 with the host_scale chosen on blind5-7), as blind8; eval-blind10
#        (committed unmeasured in session 14 after flash-attn-4's split refresh with its replay on), as blind8;
#        eval-blind11 (committed unmeasured in session 14 after the cost model's unwindowed cuDNN backward), as blind8;
#        eval-blind12 (committed unmeasured at the end of session 14, after the last profile rebuild), as blind8
#   bash benchmarks/gpu/run_profile_fa2_refresh.sh replay-check   # (full stack) flash-attn-4's GPU tests with the
#        forward replay, the step-variance check and the replay's host time (session 13 wrote all three unrun)
#   bash benchmarks/gpu/run_profile_fa2_refresh.sh replay-host   # (full stack) the replay's GPU tests and host time
#   bash benchmarks/gpu/run_profile_fa2_refresh.sh refresh-fa4 START SECS   # flash-attn-4's split refreshed with
#        the replay on, as FA2's was (full stack; rebuild the profile from it as session 12 did for FA2)
#   bash benchmarks/gpu/run_profile_fa2_refresh.sh refresh-cudnn START SECS   # (full stack) both cuDNN providers'
#        split refreshed: theirs dates from session 10, before session 11's cached-call host path, which every
#        provider runs (FA2's and flash-attn-4's splits were refreshed after it); eval-blind13 and eval-blind14
#        (session 15), as blind8
#   bash benchmarks/gpu/run_profile_fa2_refresh.sh host-probe NAME   # (stock) calibrate the host probe on this lease
#   bash benchmarks/gpu/run_profile_fa2_refresh.sh dense START SECS   # (full stack, session 18) the fit-dense grid;
#        eval-blind20 (session 18, after the local rate fit) and eval-blind21 (after it left windows out), as blind8
#   bash benchmarks/gpu/run_profile_fa2_refresh.sh sustained   # (full stack, session 19) split GPU time against
#        sustained and interleaved timing, with nvidia-smi's clocks; eval-blind22 (session 19, the shipped profile);
#        eval-blind23 and eval-blind24 (session 19), as blind8 with the checked policy's column (--checked);
#        eval-blind25 (session 21), the same
#   eval-blind15 (session 15), eval-blind16 and eval-blind17 (session 16, after the first-call correction) and
#        eval-blind18 (session 16, with the profile that ships) and eval-blind19 (session 17, the same), as blind8
# Then, here: add the refresh files to benchmarks/results/profile/ as split_refresh_fa2_<machine>_from<N>.json.gz,
# `python3 benchmarks/build_profile.py --shipped`, and decide on shipping before blind7 is run with the new
# profile (the criterion written down first, as in session 10).
set -u
source "$(dirname "$0")/runner_common.sh"
case ${1:-} in
  refresh)
    source "$(dirname "$0")/stock_env.sh"
    file="split_refresh_fa2_${tag}_from$2.json"
    timeout $(($3 + 60)) python3 benchmarks/bench_user_step.py --grid "$SOURCES" --split-only --start "$2" \
      --providers flash_attn_2:torch --refreshes flash_attn_2:torch --tag stock --max-seconds "$3" \
      --out "$OUT/$file" 2>&1 | tail -n 4
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print('stopped_at', d.get('stopped_at'))" \
      "$OUT/$file"
    ;;
  replay-check)  # session 13's flash-attn-4 forward replay, first on a GPU: its tests, then its host time
    source "$(dirname "$0")/setup.sh" > /dev/null
    python3 -m pytest -q -m gpu tests/gpu/test_flash_gpu.py -k "flash_attn_4 or replay" 2>&1 | tail -n 5
    python3 benchmarks/gpu/check_step_variance.py --out "$OUT/step_variance_${tag}.json" 2>&1 | tail -n 40
    timeout 300 python3 benchmarks/gpu/check_fa4_replay_host.py --out "$OUT/fa4_replay_host_${tag}.json" 2>&1 \
      | tail -n 14
    ;;
  replay-host)  # (full stack) session 14: the replay's GPU tests and host/GPU time after the poisoned check
    source "$(dirname "$0")/setup.sh" > /dev/null
    python3 -m pytest -q -m gpu tests/gpu/test_flash_gpu.py -k replay 2>&1 | tail -n 3
    timeout 300 python3 benchmarks/gpu/check_fa4_replay_host.py --out "$OUT/fa4_replay_host_${tag}.json" 2>&1 \
      | tail -n 12
    ;;
  refresh-fa4)  # flash-attn-4's split over the profile's source grids after the replay (full stack)
    source "$(dirname "$0")/setup.sh" > /dev/null
    file="split_refresh_fa4_${tag}_from$2.json"
    ATTN_DISPATCH_FA4_REPLAY=1 timeout $(($3 + 60)) python3 benchmarks/bench_user_step.py --grid "$SOURCES" \
      --split-only --start "$2" --providers flash_attn_4:cute --refreshes flash_attn_4:cute --max-seconds "$3" \
      --out "$OUT/$file" 2>&1 | tail -n 4
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print('stopped_at', d.get('stopped_at'))" \
      "$OUT/$file"
    ;;
  refresh-cudnn)  # both cuDNN providers' split over the profile's source grids (full stack), on today's host path
    source "$(dirname "$0")/setup.sh" > /dev/null
    file="split_refresh_cudnn_${tag}_from$2.json"
    timeout $(($3 + 60)) python3 benchmarks/bench_user_step.py --grid "$SOURCES" --split-only --start "$2" \
      --providers cudnn_fused:frontend,cudnn_fused:torch --refreshes cudnn_fused:frontend,cudnn_fused:torch \
      --max-seconds "$3" --out "$OUT/$file" 2>&1 | tail -n 4
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print('stopped_at', d.get('stopped_at'))" \
      "$OUT/$file"
    ;;
  dense)  # session 18 (full stack): the fit-dense grid, timed and split, with fit-gqa as the lease's host reference
    # (--refreshes: its host times are scaled by F.sdpa's on fit-gqa against the split fit's, as a refresh's are)
    source "$(dirname "$0")/setup.sh" > /dev/null
    file="split_dense_${tag}_from$2.json"
    providers=cudnn_fused:frontend,cudnn_fused:torch,flash_attn_2:torch,flash_attn_4:cute
    timeout $(($3 + 60)) python3 benchmarks/bench_user_step.py --grid fit-dense,fit-gqa --split --start "$2" \
      --providers "$providers" --refreshes "$providers" --max-seconds "$3" --out "$OUT/$file" 2>&1 | tail -n 4
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print('stopped_at', d.get('stopped_at'))" \
      "$OUT/$file"
    ;;
  blind7) blind_run eval-blind7 blind7 "${2:-}" "${3:-0}" ;;
  blind8|blind9|blind1[0-9]|blind2[0-2]) REPS=48 blind_run "eval-$1" "$1" "${2:-}" "${3:-0}" ;;  # as blind8 (session 12)
  blind2[345]) REPS=48 EXTRA=--checked blind_run "eval-$1" "$1" "${2:-}" "${3:-0}" ;;  # and the checked policy's column
  sustained)  # (full stack) session 19: is the split's GPU time optimistic under sustained load, per engine?
    source "$(dirname "$0")/setup.sh" > /dev/null
    timeout 420 python3 benchmarks/gpu/check_sustained_gpu.py --out "$OUT/sustained_${tag}.json" 2>&1 | tail -n 40
    ;;
  host-probe)  # (stock torch) the host probe's calibration on this lease: $OUT/host_probe_<tag>_<2nd arg>.json
    source "$(dirname "$0")/stock_env.sh"
    timeout 300 python3 benchmarks/gpu/calibrate_host_probe.py --out "$OUT/host_probe_${tag}_${2:-a}.json" 2>&1 \
      | tail -n 6
    ;;
  first-call)  # (full stack) session 21: each policy's first calls in a fresh process, compiles included
    source "$(dirname "$0")/setup.sh" > /dev/null
    timeout 560 python3 benchmarks/gpu/check_first_call_cost.py --out "$OUT/check_first_call_cost_${tag}.json" 2>&1 \
      | tail -n 60
    ;;
  fa4-host)  # (full stack) where flash-attn-4's training host time goes: cProfile beside cuDNN (torch)
    source "$(dirname "$0")/setup.sh" > /dev/null
    timeout 240 python3 benchmarks/gpu/profile_fa4_host.py --out "$OUT/fa4_host_profile_${tag}.json" 2>&1 | tail -n 200
    ;;
  *) echo "usage: run_profile_fa2_refresh.sh refresh|refresh-fa4 START SECS | replay-check | replay-host |"\
          "blind7|...|blind19 full|stock [START] | refresh-cudnn START SECS"; exit 2 ;;
esac
