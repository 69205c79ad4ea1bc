"""Issue 12: what flash-attn-4's replay (backends/_fa4_replay.py) saves per step, forward and training.

For each call, the module forced to flash-attn-4 with the replay and without it (the same engine: the replay is
switched off for that column's calls), cuDNN (frontend) forced and F.scaled_dot_product_attention for scale; per
column the step split into host and GPU time (bench_user_step.split_times: the GPU held busy by a spin kernel while
the calls are enqueued), samples taken in rotating order. Forward under no_grad, and forward then backward into the
leaves' .grad. The outputs of the two flash-attn-4 columns are compared bit for bit first. JSON under --out; a
table last.

    python3 benchmarks/gpu/check_fa4_replay_host.py --out $OUT/fa4_replay_host.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch.backends import get_engine  # noqa: E402
from attn_dispatch.backends._fa4_replay import ENV_SWITCH  # noqa: E402
from attn_dispatch.benchmarking.cases import Case  # noqa: E402
from bench_user_step import environment, make_tensors, module_for, sdpa_fn, split_times, step_fn  # noqa: E402

CALLS = [  # blind8-9 shapes where flash-attn-4's host time decided (train set per row below)
    Case(b=2, s=4096, h=16, hkv=8, d=128, mask="causal", fmt="sbhd", name="llm2"),
    Case(b=2, s=4096, h=8, hkv=4, d=64, mask="no_mask", window=(2048, 2048), name="win1"),
    Case(b=4, s=1500, h=32, d=128, mask="causal", name="mla-like"),
    Case(b=64, s=256, h=8, d=64, mask="no_mask", name="enc0"),
    Case(b=4, s=128, h=16, d=128, mask="causal", name="small"),
]


def columns(case: Case, device: torch.device):
    """The step of each column (bench_user_step's tensors, modules and SDPA), and whether the replayed forward
    equals the interface's bit for bit."""
    q, k, v, dout, _ = make_tensors(case, device, seed=0)
    fa4, cudnn = (module_for(case, backend, device) for backend in ("flash_attn_4:cute", "cudnn_fused:frontend"))
    engine = get_engine("flash_attn_4:cute")
    engine.__dict__.pop("_replays_by_kind", None)  # made again: main() turned the switch on
    replays = [engine._replays(kind) for kind in ("fwd", "bwd")]

    def switched(on: bool):
        def call(q, k, v):
            for r in replays:
                r.enabled = on
            return fa4(q, k, v)
        return call

    calls = {"fa4 replay": switched(True), "fa4 interface": switched(False), "cudnn frontend": cudnn}
    if sdpa_fn(case) is not None:
        calls["sdpa"] = sdpa_fn(case)
    with torch.no_grad():
        same = torch.equal(switched(True)(q, k, v), switched(False)(q, k, v))
        for _ in range(2):
            switched(True)(q, k, v)  # recorded, checked: later forwards replay (backwards: in the first samples)
    return {name: step_fn(call, q, k, v, dout, {}, case.train) for name, call in calls.items()}, same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=15)
    args = ap.parse_args()
    os.environ[ENV_SWITCH] = "1"  # the default; the interface column switches it off per call
    result = {"environment": environment(), "rows": []}
    for shape in CALLS:
        for train in (False, True):
            case = dataclasses.replace(shape, train=train)
            fns, same = columns(case, torch.device("cuda"))
            found = {name: [] for name in fns}
            for r in range(args.samples):  # one sample per column per round, the order rotated
                names = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
                for name in names:
                    found[name].append(split_times(fns[name], samples=1))
            row = {"label": case.label, "bitwise_equal": same,
                   "columns": {name: {key: statistics.median(s[key] for s in samples)
                                      for key in ("step_ms", "gpu_ms", "host_ms")}
                               for name, samples in found.items()}}
            result["rows"].append(row)
            Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'call':46s} {'same':>5s} " + " ".join(f"{n:>22s}" for n in ("fa4 replay", "fa4 interface",
                                                                            "cudnn frontend", "sdpa")))
    print(f"{'':46s} {'':>5s} " + " ".join(f"{'host / step ms':>22s}" for _ in range(4)))
    for row in result["rows"]:
        cells = []
        for name in ("fa4 replay", "fa4 interface", "cudnn frontend", "sdpa"):
            c = row["columns"].get(name)
            cells.append(f"{c['host_ms']:.3f} / {c['step_ms']:.3f}" if c else "-")
        print(f"{row['label'][:46]:46s} {str(row['bitwise_equal']):>5s} " + " ".join(f"{x:>22s}" for x in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
