"""Compare the host probe (benchmarks/host_probe.py) with the profile: on this lease, the probe's launch_us, and the
lease's host factor, F.scaled_dot_product_attention's measured step on small calls over the
shipped profile's prediction for cuDNN (torch) with no host scaling (the oracle factor of session 15's analysis,
benchmarks/results/profile/README.md). reference_launch_us = launch_us / factor is the probe value of a host that
runs steps as the profile predicts them: were the probe a measure of the host factor, it would agree across leases
(session 15: 8.66, 6.79 and 5.93 us on three leases, so the policy does not use the probe).

The calls: every small call (cuDNN (torch) predicted under 0.09 ms forward, 0.45 ms training) of eval-blind10-14
that SDPA expresses, timed as bench_user_step.py times a row (block timer, interleaved, F.sdpa beside cuDNN (torch)
forced). The probe runs before and after them.

    python3 benchmarks/gpu/calibrate_host_probe.py --out $OUT/host_probe_h100_<lease>.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch.benchmarking.cases import CASE_GRIDS  # noqa: E402
from attn_dispatch.params import AttentionParams  # noqa: E402
from attn_dispatch.policy.profile import PROFILE_DIR, Profile  # noqa: E402
from attn_dispatch.policy.timing import time_interleaved  # noqa: E402
from host_probe import launch_us  # noqa: E402
from bench_user_step import environment, make_tensors, module_for, sdpa_fn, settings_for, step_fn  # noqa: E402

GRIDS = ("eval-blind10", "eval-blind11", "eval-blind12", "eval-blind13", "eval-blind14")
SMALL_MS = {False: 0.09, True: 0.45}
PROVIDER = "cudnn_fused:torch"


def probe(samples: int = 7) -> list[float]:
    return [round(launch_us(), 3) for _ in range(samples)]


def probe_cost_ms(samples: int = 7) -> float:
    """What one probe costs the first decision (Platform.detect runs it once per process), median ms."""
    found = []
    for _ in range(samples):
        start = time.perf_counter()
        launch_us()
        found.append((time.perf_counter() - start) * 1e3)
    return statistics.median(found)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=16)
    args = ap.parse_args()
    device = torch.device("cuda")
    machine = torch.cuda.get_device_name()
    profile = Profile(json.loads((PROFILE_DIR / "sm90.json").read_text()))
    settings = dataclasses.replace(settings_for("block"), reps=args.reps)
    before = probe()
    rows, seen = [], set()
    for grid in GRIDS:
        for case in CASE_GRIDS[grid]():
            sdpa = sdpa_fn(case)
            if sdpa is None or case.label in seen:
                continue
            seen.add(case.label)
            q, k, v, dout, kwargs = make_tensors(case, device, 0)
            module = module_for(case, PROVIDER, device)
            with torch.no_grad():
                module(q.detach(), k.detach(), v.detach(), **kwargs)
            params = AttentionParams(**module.last_decision.params)
            predicted = profile.predict(params, machine=machine).times_ms.get(PROVIDER)
            if predicted is None or predicted >= SMALL_MS[case.train]:
                continue
            fns = {"sdpa": step_fn(sdpa, q, k, v, dout, {}, case.train),
                   PROVIDER: step_fn(module, q, k, v, dout, kwargs, case.train)}
            times, _ = time_interleaved(fns, "cuda", settings)
            rows.append({"grid": grid, "label": case.label, "predicted_ms": predicted,
                         "times_ms": {n: t.median_ms for n, t in times.items()}})
            print(f"{case.label:48s} predicted {predicted:.4f} sdpa {times['sdpa'].median_ms:.4f} "
                  f"{PROVIDER} {times[PROVIDER].median_ms:.4f}", flush=True)
    after = probe()
    factor = statistics.median(r["times_ms"]["sdpa"] / r["predicted_ms"] for r in rows)
    probe_us = statistics.median(before + after)
    result = {"environment": environment(), "probe_cost_ms": round(probe_cost_ms(), 4),
              "launch_us_before": before, "launch_us_after": after,
              "launch_us": probe_us, "lease_factor": round(factor, 4),
              "reference_launch_us": round(probe_us / factor, 3), "calls": len(rows), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"probe {probe_us:.2f} us per launch (before {before}, after {after}); lease factor {factor:.3f} over "
          f"{len(rows)} small calls; reference_launch_us {probe_us / factor:.2f}; one probe costs "
          f"{result['probe_cost_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
