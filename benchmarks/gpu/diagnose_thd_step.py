"""Where a packed (thd) call's module step differs from what the measured policy's tuner times (issue 12, session 16).

eval-blind16's packed0 forward (d64 s2048 b4 h12, padding_causal thd): the tuner recorded cuDNN (frontend) at
0.119 ms and flash-attn-4 at 0.135, while the same engines forced in a module ran 0.294 and 0.309 (FA2: 0.143 vs
0.131). For each provider and a few packed calls, interleaved on the block timer:
- module: DotProductAttention forced, called as bench_user_step.py calls it (its inputs: ragged lengths);
- tuner: timing.engine_step on the tuner's synthetic call (full-length sequences), as the measured policy times it;
- tuner ragged: engine_step on a synthetic call with ragged lengths.
Then each module's calls under torch.cuda.set_sync_debug_mode("warn") (how many synchronising operations a call
makes), and a cProfile of the slowest module's calls (where its host time goes). JSON to --out.

    python3 benchmarks/gpu/diagnose_thd_step.py --out /tmp/thd.json
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime
import io
import json
import pstats
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from attn_dispatch.backends import get_engine  # noqa: E402
from attn_dispatch.benchmarking.cases import Case  # noqa: E402
from attn_dispatch.policy.measured import TUNING_SETTINGS  # noqa: E402
from attn_dispatch.policy.timing import SyntheticCall, engine_step, time_interleaved  # noqa: E402
from attn_dispatch.synthetic import make_call  # noqa: E402
from bench_user_step import make_tensors, module_for, selection_params, step_fn  # noqa: E402

CASES = [
    Case(b=4, s=2048, h=12, d=64, mask="padding_causal", fmt="thd", train=False, name="blind16-packed0"),
    Case(b=4, s=2048, h=12, d=64, mask="padding_causal", fmt="thd", train=True, name="blind16-packed0"),
    Case(b=4, s=2048, h=32, hkv=8, d=128, mask="padding", fmt="thd", train=False, name="blind17-packed1"),
    Case(b=8, s=1024, h=32, hkv=8, d=128, mask="padding_causal", fmt="thd", train=False, name="blind16-packed2"),
]
PROVIDERS = ("cudnn_fused:frontend", "flash_attn_4:cute", "flash_attn_2:torch")


def synthetic(params, full: bool, train: bool) -> SyntheticCall:
    call = make_call(params, device="cuda", seed=0, requires_grad=False, full_lengths=full)
    dout = None
    if train:
        dout = torch.randn(*call.q.shape[:-1], params.head_dim_v, device="cuda").to(call.q.dtype)
    return SyntheticCall(call.q, call.k, call.v, call.aux, call.cfg, dout)


def syncs_per_call(fn, calls: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(calls):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return len(caught) / calls


def host_profile(fn, calls: int = 200) -> str:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    for case in CASES:
        q, k, v, dout, kwargs = make_tensors(case, device, seed=0)
        probe = module_for(case, None, device)
        with torch.no_grad():
            probe(q.detach(), k.detach(), v.detach(), **kwargs)
        params = selection_params(probe.last_decision)
        eligible = [vd.id for vd in probe.last_decision.verdicts if vd.eligible and vd.id in PROVIDERS]
        mode = "fwd_bwd" if case.train else "fwd"
        full, ragged = synthetic(params, True, case.train), synthetic(params, False, case.train)
        fns, modules = {}, {}
        for provider in eligible:
            modules[provider] = step_fn(module_for(case, provider, device), q, k, v, dout, kwargs, case.train)
            fns[f"module {provider}"] = modules[provider]
            fns[f"tuner {provider}"] = engine_step(get_engine(provider), full, mode)
            fns[f"tuner ragged {provider}"] = engine_step(get_engine(provider), ragged, mode)
        timings, errors = time_interleaved(fns, "cuda", TUNING_SETTINGS)
        row = {"case": case.label, "times_ms": {n: t.median_ms for n, t in timings.items()},
               "errors": {n: repr(e) for n, e in errors.items()},
               "syncs_per_call": {p: syncs_per_call(fn) for p, fn in modules.items()}}
        slow = max(modules, key=lambda p: row["times_ms"].get(f"module {p}", 0.0))
        row["profile_of"], row["profile"] = slow, host_profile(modules[slow])
        rows.append(row)
        print(f"{case.label}: " + "  ".join(f"{n} {t:.3f}" for n, t in sorted(row["times_ms"].items())))
        print(f"   syncs/call {row['syncs_per_call']}  errors {row['errors']}")
    Path(args.out).write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "settings": dataclasses.asdict(TUNING_SETTINGS), "rows": rows}, indent=1, default=str))
    for row in rows:
        print(f"--- {row['case']}: cProfile of the module forcing {row['profile_of']} (200 calls)")
        print("\n".join(row["profile"].splitlines()[:30]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
