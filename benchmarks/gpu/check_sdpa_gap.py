"""Issue 12: where the module's torch-cuDNN step differs from F.scaled_dot_product_attention on the same op.

For a few calls (the bert-like training row the held-out grid found 1.12x slower than SDPA, and host-bound
inference calls): per step, the GPU kernels each runs (torch.profiler: names, count, device time) and the step
time two ways: one call between CUDA events interleaved call by call (what bench_user_step.py does), and 20 calls
back to back between two events (steady state, host overlapped). `sdpa_twin` is SDPA again: the A/A control of the
interleaved timer. JSON under $OUT; a table last.

    python3 benchmarks/gpu/check_sdpa_gap.py --out $OUT/sdpa_gap.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch import DotProductAttention  # noqa: E402
from bench_user_step import environment  # noqa: E402

CALLS = [  # (label, b, s, h, d, causal, train)
    ("bert d64 s512 b32 h16 no_mask fwd+bwd", 32, 512, 16, 64, False, True),
    ("gpt2 d64 s1536 b16 h12 causal fwd+bwd", 16, 1536, 12, 64, True, True),
    ("small d128 s256 b8 h16 causal fwd", 8, 256, 16, 128, True, False),
    ("tiny d128 s128 b4 h32 causal fwd", 4, 128, 32, 128, True, False),
    ("long d128 s16384 b1 h16 no_mask fwd+bwd", 1, 16384, 16, 128, False, True),  # the fit grid's 1.07-1.12 rows
]


def steps(b, s, h, d, causal, train):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=gen, device="cuda").bfloat16().requires_grad_(train)
               for _ in range(3))
    dout = torch.randn(b, s, h * d, generator=gen, device="cuda").bfloat16()
    module = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal" if causal else "no_mask",
                                 backend="cudnn_fused:torch").cuda().train(train)

    def sdpa(q, k, v):
        o = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3),
                                           is_causal=causal).permute(0, 2, 1, 3)
        return o.reshape(*o.shape[:2], -1)

    def step(call):
        if not train:
            def infer():
                with torch.no_grad():
                    call(q, k, v)
            return infer

        def fwd_bwd():
            q.grad = k.grad = v.grad = None
            call(q, k, v).backward(dout)
        return fwd_bwd
    return {"module": step(module), "sdpa": step(sdpa), "sdpa_twin": step(sdpa)}


def kernels(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        device_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if device_us and e.device_type.name == "CUDA":
            out[e.key[:90]] = {"count": e.count // 5, "device_us": device_us / 5}
    return out


def interleaved(fns, rounds=60):
    times = {n: [] for n in fns}
    names = list(fns)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fns[n]()
            b.record()
            times[n].append((a, b))
    torch.cuda.synchronize()
    return {n: statistics.median(a.elapsed_time(b) for a, b in pairs) for n, pairs in times.items()}


def batched(fns, rounds=10, calls=20):
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(calls):
                fn()
            b.record()
            times[n].append((a, b))
    torch.cuda.synchronize()
    return {n: statistics.median(a.elapsed_time(b) / calls for a, b in pairs) for n, pairs in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = {"environment": environment(), "rows": []}
    for label, *shape in CALLS:
        fns = steps(*shape)
        for fn in fns.values():
            fn()
        row = {"label": label, "interleaved_ms": interleaved(fns), "batched_ms": batched(fns),
               "kernels": {n: kernels(fns[n]) for n in ("module", "sdpa")}}
        result["rows"].append(row)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'call':42s} {'interleaved: module/sdpa twin/sdpa':>36s} {'batched: module/sdpa':>22s} "
          f"{'kernel us module/sdpa':>24s}")
    for row in result["rows"]:
        i, b, k = row["interleaved_ms"], row["batched_ms"], row["kernels"]
        ku = {n: sum(x["device_us"] for x in k[n].values()) for n in k}
        print(f"{row['label']:42s} {i['module'] / i['sdpa']:17.3f} {i['sdpa_twin'] / i['sdpa']:18.3f} "
              f"{b['module'] / b['sdpa']:22.3f} {ku['module']:11.1f}/{ku['sdpa']:.1f}")
        for n in ("module", "sdpa"):
            print(f"    {n}: " + "; ".join(f"{name} x{v['count']} {v['device_us']:.0f}us"
                                          for name, v in sorted(k[n].items(), key=lambda x: -x[1]["device_us"])[:6]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
