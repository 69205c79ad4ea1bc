"""Issue 12 (helper measured12): the measured policy's misses on the fresh held-out grid, and the timer's own noise.

For each row (eval-fresh calls, the misses first), on one set of inputs (bench_user_step.make_tensors):
  - every eligible provider forced, one module each (the unfused engine left out: never near the fastest here);
  - `pick_twin`: the default's pick forced in a second module (the A/A control: same engine, same inputs);
  - `default`: the module with nothing forced (auto policy, an empty tuning cache);
  - `measured`: a module under ATTN_DISPATCH_POLICY=measured with a fresh tuning cache (tuned on its first call,
    with this branch's tuning: confirmed cuts, ~1 ms blocks); its pick, its first call's cost (tuning included),
    its tuning entry read back from the cache (times_ms, probe_ms: cut after confirmation, errors, skipped,
    tuning_s), and the provider its timed calls ran (a plan made again would differ: the session-4 harness bug);
  - `old tuning`: the session-4 tuning (one-call estimate cuts, per-call samples) on the same call, after the
    new one (so with warm JIT caches): its pick and entry (its time is its pick's forced column);
  - `step:<provider>`: what tuning times (timing.engine_step on synthetic inputs of the row's shape), so that the
    tuning's unit and the module's step are compared on the same clock;
all timed interleaved twice, per call (block_ms=0, the session-4 timer) and in blocks (block_ms=3: a sync, a
lead-in call, then n calls of one function; calls over 2 ms one at a time), on the same functions. flash-attn-4 JIT compiles during tuning
and timing are recorded (a compile after a function's first call would make its estimate slow).

JSON to $OUT/check_measured12.json (rewritten after every row); a short table last. One process, ~3-4 minutes on
an H100 with flash-attn-4; rows stop starting after --max-seconds. Works without cudnn-frontend or flash-attn-4
(their columns are then absent).

    source .gpu-wheels/a/env.sh && source .gpu-wheels/b/env.sh && source benchmarks/gpu/setup.sh >/dev/null
    python3 benchmarks/gpu/check_measured12.py
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch import Platform, selection  # noqa: E402
from attn_dispatch.benchmarking.cases import CASE_GRIDS, Case  # noqa: E402
from attn_dispatch.params import AttentionParams  # noqa: E402
from attn_dispatch.policy import MeasuredPolicy, TimerSettings  # noqa: E402
from attn_dispatch.policy.measured import TUNING_SETTINGS  # noqa: E402
from attn_dispatch.policy.timing import build_inputs, engine_step, mode_of, time_interleaved  # noqa: E402
from bench_user_step import environment, environment_set, make_tensors, module_for, step_fn  # noqa: E402

# The rows: the misses first (measured-policy misses, then the A/A rows), the costly long row last.
ROWS = [
    "local64 d64 s8192 b2 h16 no_mask w256,256 fwd",
    "llama70b-tp8 d128 s4096 b2 h8/1 causal fwd+bwd",
    "gemma2-local d256 s4096 b2 h8/4 causal w1024,0 fwd",
    "llama70b-tp8 d128 s4096 b2 h8/1 causal fwd",
    "sbhd-enc d64 s1024 b32 h16 no_mask sbhd fwd",
    "roberta d64 s384 b32 h12 no_mask fwd+bwd",
    "packed-enc64 d64 s2048 b8 h12 padding thd fwd+bwd",
    "local64 d64 s8192 b2 h16 no_mask w256,256 fwd+bwd",
    "tiny64 d64 s128 b32 h12 causal fwd",
    "gemma2-local d256 s4096 b2 h8/4 causal w1024,0 fwd+bwd",
    "long20k d128 s20000 b1 h32/8 causal fwd+bwd",
]
CALL_TIMER = TimerSettings(warmup=2, reps=12, max_reps=100, target_ms=30.0, warm_ms=40.0)
BLOCK_TIMER = dataclasses.replace(CALL_TIMER, block_ms=3.0)
OLD_TUNING = dataclasses.replace(TUNING_SETTINGS, confirm=0, block_ms=0.0)  # what the session-4 runs tuned with
USER = ("default", "measured", "pick_twin")


def fa4_events() -> list | None:
    """flash-attn-4's JIT compile log (the engine's jit_events), or None where it is not loaded."""
    from attn_dispatch import backends

    engine = backends._INSTANCES.get("flash_attn_4:cute")
    return None if engine is None else engine.jit_events


def events_since(mark: int) -> list:
    events = fa4_events()
    return [] if events is None else [dict(e, seconds=round(e["seconds"], 2)) for e in events[mark:]]


def n_events() -> int:
    events = fa4_events()
    return 0 if events is None else len(events)


def timed(fns: dict, settings: TimerSettings, never_cut: frozenset, device_type: str) -> dict:
    timings, errors = time_interleaved(fns, device_type, settings, cutoff_ratio=4.0, never_cut=never_cut)
    return {
        "times_ms": {n: t.median_ms for n, t in timings.items()},
        "min_ms": {n: t.min_ms for n, t in timings.items()},
        "reps": {n: t.reps for n, t in timings.items()},
        "calls_per_sample": {n: t.calls_per_sample for n, t in timings.items()},
        "samples_ms": {n: [round(x, 5) for x in t.samples_ms] for n, t in timings.items()},
        "cut_short": sorted(n for n, t in timings.items() if t.cut_short),
        "errors": {n: f"{type(e).__name__}: {e}"[:300] for n, e in errors.items()},
    }


def run_row(case, seed: int, device: torch.device) -> dict:
    q, k, v, dout, kwargs = make_tensors(case, device, seed)
    row: dict = {"label": case.label, "case": case.to_dict()}
    default = module_for(case, None, device)
    selection.clear_cache()
    with torch.no_grad():
        default(q.detach(), k.detach(), v.detach(), **kwargs)
    decision = default.last_decision
    params = AttentionParams(**decision.params)
    candidates = [vd.id for vd in decision.verdicts if vd.eligible]  # what a policy is handed
    providers = [p for p in candidates if device.type == "cpu" or not p.startswith("unfused")]
    pick = decision.chosen
    row.update(default_pick=pick, default_reason=decision.policy_reason, candidates=candidates)

    fns = {p: step_fn(module_for(case, p, device), q, k, v, dout, kwargs, case.train) for p in providers}
    fns["default"] = step_fn(default, q, k, v, dout, kwargs, case.train)
    if pick in fns:
        fns["pick_twin"] = step_fn(module_for(case, pick, device), q, k, v, dout, kwargs, case.train)

    # The measured policy, as a user gets it: a module deciding under ATTN_DISPATCH_POLICY=measured, fresh cache.
    # No selection.clear_cache() after it (that would make its plan stale: it would plan again under auto).
    measured_dir = tempfile.mkdtemp(prefix="m12-measured-")
    mark = n_events()
    with environment_set(ATTN_DISPATCH_POLICY="measured", ATTN_DISPATCH_CACHE_DIR=measured_dir):
        selection.clear_cache()
        policy = MeasuredPolicy()
        selection.set_policy("measured", policy)
        measured = module_for(case, None, device)
        fns["measured"] = step_fn(measured, q, k, v, dout, kwargs, case.train)
        t0 = time.perf_counter()
        fns["measured"]()
        if device.type == "cuda":
            torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t0) * 1e3
        entry = policy.lookup(params, Platform.detect())
    q.grad = k.grad = v.grad = None
    row["measured"] = {"pick": measured.last_decision.chosen, "first_call_ms": first_ms, "entry": entry,
                       "fa4_jit": events_since(mark), "settings": TUNING_SETTINGS.to_dict()}

    # The session-4 tuning on the same call (warm JIT caches now), for its pick and entry only.
    old_dir = tempfile.mkdtemp(prefix="m12-old-")
    mark = n_events()
    try:
        old = MeasuredPolicy(settings=OLD_TUNING, directory=old_dir).tune(params, Platform.detect(), candidates)
        row["old_tuning"] = {"pick": old.chosen, "entry": old.entry, "fa4_jit": events_since(mark),
                             "settings": OLD_TUNING.to_dict()}
    except Exception as exc:  # noqa: BLE001 - recorded; the row goes on
        row["old_tuning"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # What tuning times, on the same clock as the modules: engine_step on synthetic inputs of this shape.
    from attn_dispatch.backends import get_engine

    mode = mode_of(params)
    synthetic = build_inputs(params, seed=seed, with_dout=mode == "fwd_bwd")
    for p in providers:
        fns[f"step:{p}"] = engine_step(get_engine(p), synthetic, mode)

    never_cut = frozenset(USER + (pick, row["measured"]["pick"]))
    mark = n_events()
    row["timers"] = {name: timed(fns, settings, never_cut, device.type)
                     for name, settings in (("call", CALL_TIMER), ("block", BLOCK_TIMER))}
    row["timing_fa4_jit"] = events_since(mark)
    row["measured"]["ran"] = measured.last_decision.chosen  # what its timed calls ran
    row["summary"] = summarize(row)
    return row


def summarize(row: dict) -> dict:
    """Per timer: fastest forced, its margin over the runner-up, the columns over the fastest, the A/A spread."""
    pick, mpick = row["default_pick"], row["measured"]["pick"]
    opick = row.get("old_tuning", {}).get("pick")
    out = {}
    for name, t in row["timers"].items():
        times = t["times_ms"]
        forced = sorted((ms, p) for p, ms in times.items() if ":" in p and not p.startswith("step:"))
        steps = sorted((ms, p[5:]) for p, ms in times.items() if p.startswith("step:"))
        if not forced:
            continue
        best, fastest = forced[0]
        s = {"fastest": fastest, "fastest_ms": best,
             "runner_up_margin": forced[1][0] / best if len(forced) > 1 else None,
             "step_fastest": steps[0][1] if steps else None}
        for col, provider in (("default", pick), ("measured", mpick)):
            if col in times:
                s[f"{col}/fastest"] = times[col] / best
                if provider in times:
                    s[f"{col}/own_pick_forced"] = times[col] / times[provider]
        for label, provider in (("measured_pick", mpick), ("old_pick", opick), ("default_pick", pick)):
            if provider in times:
                s[f"{label}_forced/fastest"] = times[provider] / best
        if "pick_twin" in times and pick in times:
            s["aa"] = times["pick_twin"] / times[pick]
        out[name] = s
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", "/tmp")) / "check_measured12.json"))
    ap.add_argument("--max-seconds", type=float, default=170.0, help="stop starting new rows after this")
    ap.add_argument("--rows", default=None, help="comma list of row-label prefixes (default: all)")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny call on the CPU: checks the script, not speed")
    args = ap.parse_args()
    if args.cpu_smoke:
        import bench_user_step

        bench_user_step.DTYPE = torch.float32
        device = torch.device("cpu")
        smoke = [Case(b=2, s=64, h=4, hkv=2, d=16, name="smoke"), Case(b=2, s=64, h=4, hkv=2, d=16, train=False,
                                                                     name="smoke")]
        cases, labels = {c.label: c for c in smoke}, [c.label for c in smoke]
    else:
        if not torch.cuda.is_available():
            sys.exit("check_measured12 needs a CUDA GPU (--cpu-smoke checks the script on the CPU)")
        device = torch.device("cuda")
        cases = {c.label: c for c in CASE_GRIDS["eval-fresh"]()}
        labels = [lbl for lbl in ROWS if args.rows is None or any(lbl.startswith(p) for p in args.rows.split(","))]
    os.environ["ATTN_DISPATCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="m12-auto-")  # the default reads an empty cache
    os.environ.pop("ATTN_DISPATCH_POLICY", None)
    result = {"environment": environment(), "timers": {"call": CALL_TIMER.to_dict(), "block": BLOCK_TIMER.to_dict()},
              "rows": [], "failed": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for i, label in enumerate(labels):
        if time.perf_counter() - started > args.max_seconds:
            result["stopped_before"] = label
            break
        t0 = time.perf_counter()
        try:
            case = cases[label]
            # Above 8k tokens the unfused engine costs seconds a call (tuning times every eligible provider):
            # disabled there, as NVTE_UNFUSED_ATTN=0 would for a user (recorded in the row).
            long_call = case.s > 8192 or case.skv > 8192
            with environment_set(**({"NVTE_UNFUSED_ATTN": "0"} if long_call else {})):
                row = run_row(case, 1234 + i, device)
            row["unfused_disabled"] = long_call
            row["seconds"] = round(time.perf_counter() - t0, 1)
            result["rows"].append(row)
            print(f"{label}: {row['seconds']} s", flush=True)
        except Exception as exc:  # noqa: BLE001 - one row failing is recorded, the others go on
            result["failed"].append({"label": label, "error": traceback.format_exc()[-2000:]})
            print(f"{label}: FAILED {type(exc).__name__}: {exc}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out.write_text(json.dumps(result, indent=1, default=str))
    result["seconds"] = round(time.perf_counter() - started, 1)
    out.write_text(json.dumps(result, indent=1, default=str))
    print_table(result)
    print(f"-> {out}")
    return 0


def _f(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def print_table(result: dict) -> None:
    print("\nper row: picks (default / measured new / measured old), then per timer (call | block): fastest forced,"
          " its margin over the runner-up, measured module / fastest, measured pick forced / fastest, old pick"
          " forced / fastest, A/A = pick_twin / pick forced, default / own pick forced; tuning s; ran = measured pick")
    for row in result["rows"]:
        m, old = row["measured"], row.get("old_tuning", {})
        entry = m.get("entry") or {}
        print(f"{row['label']}")
        print(f"  picks: default {row['default_pick']}, measured {m['pick']} (ran {m['ran']}: "
              f"{'ok' if m['ran'] == m['pick'] else 'MISMATCH'}), old {old.get('pick', old.get('error'))}; tuning "
              f"{_f(entry.get('tuning_s'), '{:.2f}')} s, first call {m['first_call_ms']:.0f} ms; fa4 jit in tuning "
              f"{len(m['fa4_jit'])}, in timing {len(row['timing_fa4_jit'])}")
        for tag, e in (("new", entry), ("old", old.get("entry") or {})):
            times = {**{p: f"{v:.3f}" for p, v in e.get("times_ms", {}).items()},
                     **{p: f"{v:.3f}(cut)" for p, v in e.get("probe_ms", {}).items()}}
            print(f"    tuning {tag}: " + ", ".join(f"{p} {v}" for p, v in sorted(times.items()))
                  + (f"; errors {list(e['errors'])}" if e.get("errors") else ""))
        for name in ("call", "block"):
            s = row["summary"].get(name)
            if not s:
                continue
            print(f"  {name:5s}: fastest {s['fastest']} {s['fastest_ms']:.3f} ms (x{_f(s['runner_up_margin'])} to "
                  f"next), step-fastest {s['step_fastest']}; measured {_f(s.get('measured/fastest'))}, measured "
                  f"pick {_f(s.get('measured_pick_forced/fastest'))}, old pick {_f(s.get('old_pick_forced/fastest'))}"
                  f", A/A {_f(s.get('aa'))}, default/own {_f(s.get('default/own_pick_forced'))}")
    for failed in result["failed"]:
        print(f"FAILED {failed['label']}: {failed['error'].splitlines()[-1]}")
    if "stopped_before" in result:
        print(f"stopped before {result['stopped_before']} (--max-seconds)")


if __name__ == "__main__":
    sys.exit(main())
