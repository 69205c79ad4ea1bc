"""Where flash-attn-4's host time per training step goes (0.47-0.79 ms with the replay on the H100, cuDNN's
0.24-0.55: it decides close calls between the two): cProfile over a steady loop of user steps (forward, then
backward into the leaves' .grad), beside cuDNN (torch) forced on the same call. The GPU is kept busy by a spin
kernel ahead of each block, so launches never wait on it and the profile is the host's alone. Prints each
column's top functions by own time; JSON under --out.

    python3 benchmarks/gpu/profile_fa4_host.py --out $OUT/fa4_host_profile.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch.benchmarking.cases import Case  # noqa: E402
from bench_user_step import SPIN_CYCLES_PER_MS, environment, make_tensors, module_for, step_fn  # noqa: E402

CALLS = [Case(b=2, s=512, h=16, d=128, mask="causal", name="small-causal"),
         Case(b=32, s=256, h=12, d=64, mask="no_mask", name="enc")]
PROVIDERS = ["flash_attn_4:cute", "cudnn_fused:torch"]


def profile_column(step, calls: int = 64, blocks: int = 8) -> tuple[float, str]:
    """(host ms per step, the top of cProfile's table by own time)."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    prof, host = cProfile.Profile(), 0.0
    for _ in range(blocks):
        torch.cuda._sleep(int(40.0 * SPIN_CYCLES_PER_MS))
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(calls):
            step()
        prof.disable()
        host += time.perf_counter() - t0
        torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
    return host * 1e3 / (calls * blocks), out.getvalue()


def plain_host(step, calls: int = 64, blocks: int = 8) -> float:
    best = []
    for _ in range(blocks):
        torch.cuda._sleep(int(40.0 * SPIN_CYCLES_PER_MS))
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        best.append((time.perf_counter() - t0) * 1e3 / calls)
        torch.cuda.synchronize()
    return sorted(best)[len(best) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    result = {"environment": environment(), "rows": []}
    for case in CALLS:
        q, k, v, dout, kwargs = make_tensors(case, device, 0)
        for provider in PROVIDERS:
            step = step_fn(module_for(case, provider, device), q, k, v, dout, kwargs, True)
            host = plain_host(step)
            profiled, table = profile_column(step)
            result["rows"].append({"label": case.label, "provider": provider, "host_ms": host,
                                   "profiled_host_ms": profiled, "table": table})
            print(f"== {case.label} {provider}: host {host:.3f} ms per step (under cProfile {profiled:.3f})")
            print("\n".join(table.splitlines()[:40]))
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
