"""Issue 12: where a host-bound step of the module costs more host time than F.scaled_dot_product_attention on the
same kernel (the blind grids' SDPA-parity misses: 3-8 us per forward, 13-27 us per training step on the H100's
host, more with sbhd; split_fit_*.json.gz).

For each call, the host time of enqueueing a step (bench_user_step.split_times: the GPU held busy by a spin kernel,
so no launch waits) for a ladder of callers of one torch op, from the bare op up to the module as a user calls it:
  op          the aten op on [b, h, s, d] views made once (no views per call)
  op+views    the op with the views SDPA's caller makes per call (permute q, k, v in, the output back, merged)
  op bshd     (FA2, bshd) aten::_flash_attention_forward, which takes [b, s, h, d] itself: no views but the merge
  sdpa        F.scaled_dot_product_attention with those views (what bench_user_step times as `sdpa`)
  bound       the module's bound call for these tensors (FastHit.call), called directly
  forced      DotProductAttention with the provider forced, called as a user calls it
  (host_overhead_h100_inline.json also has `forced_prev`: the route before __call__ ran the bound op inline, an
  A/B that needed a module state that no longer exists)
  default     DotProductAttention with nothing forced
Training steps are forward, then backward into the leaves' .grad. With --ops, torch.profiler's CPU view of a step
of `sdpa` and of `forced` (cuDNN): the ops whose call counts differ (what the module runs that SDPA does not).

    python3 benchmarks/gpu/check_host_overhead.py --out $OUT/host_overhead.json
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
from bench_user_step import environment, split_times, step_fn  # noqa: E402

CALLS = [  # (label, b, s, h, hkv, d, causal, fmt)
    ("enc0 d96 s256 b16 h20 no_mask", 16, 256, 20, 20, 96, False, "bshd"),
    ("small1 d128 s100 b4 h8 no_mask", 4, 100, 8, 8, 128, False, "bshd"),
    ("d64 s512 b2 h16 causal", 2, 512, 16, 16, 64, True, "bshd"),
    ("llm5 d128 s2048 b2 h16/8 causal sbhd", 2, 2048, 16, 8, 128, True, "sbhd"),
    ("d128 s1024 b2 h16 causal sbhd", 2, 1024, 16, 16, 128, True, "sbhd"),
]
OPS = {"cudnn_fused:torch": torch.ops.aten._scaled_dot_product_cudnn_attention,
       "flash_attn_2:torch": torch.ops.aten._scaled_dot_product_flash_attention}


def tensors(b, s, h, hkv, d, fmt, train, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (lambda heads: (b, s, heads, d)) if fmt == "bshd" else (lambda heads: (s, b, heads, d))
    q, k, v = (torch.randn(*shape(n), generator=gen, device="cuda").bfloat16().requires_grad_(train)
               for n in (h, hkv, hkv))
    dout = torch.randn(*shape(h)[:2], h * d, generator=gen, device="cuda").bfloat16()
    return q, k, v, dout


def callers(provider, b, s, h, hkv, d, causal, fmt, q, k, v, train):
    into, back = ((0, 2, 1, 3), (0, 2, 1, 3)) if fmt == "bshd" else ((1, 2, 0, 3), (2, 0, 1, 3))
    scale = d ** -0.5
    gqa = h != hkv

    def aten(qp, kp, vp):
        if provider == "cudnn_fused:torch":
            return torch._scaled_dot_product_cudnn_attention(qp, kp, vp, None, train, 0.0, causal, False,
                                                             scale=scale)[0]
        return torch._scaled_dot_product_flash_attention(qp, kp, vp, 0.0, causal, False, scale=scale)[0]

    views = [x.permute(*into) for x in (q, k, v)]
    fns = {}
    if not gqa or provider == "cudnn_fused:torch":
        def op():  # the output merged back as one view: what a training step's dout needs
            o = aten(*views).permute(*back)
            return o.reshape(*o.shape[:2], -1)
        fns["op"] = op

        def op_views():
            o = aten(q.permute(*into), k.permute(*into), v.permute(*into)).permute(*back)
            return o.reshape(*o.shape[:2], -1)
        fns["op+views"] = op_views

    if provider == "flash_attn_2:torch" and fmt == "bshd":
        fa2 = torch.ops.aten._flash_attention_forward.default

        def op_bshd():  # FA2's own op takes [b, s, h, d] as it is: no views in, one out (through torch.ops)
            return fa2(q, k, v, None, None, s, s, 0.0, causal, False, scale=scale)[0].flatten(-2)
        fns["op bshd"] = op_bshd

    def sdpa():
        o = F.scaled_dot_product_attention(q.permute(*into), k.permute(*into), v.permute(*into), is_causal=causal,
                                           enable_gqa=gqa).permute(*back)
        return o.reshape(*o.shape[:2], -1)
    fns["sdpa"] = sdpa
    forced = DotProductAttention(h, d, num_gqa_groups=hkv, qkv_format=fmt,
                                 attn_mask_type="causal" if causal else "no_mask", backend=provider).cuda().train(train)
    default = DotProductAttention(h, d, num_gqa_groups=hkv, qkv_format=fmt,
                                  attn_mask_type="causal" if causal else "no_mask").cuda().train(train)
    with torch.set_grad_enabled(train):
        for module in (forced, forced, default):
            module(q, k, v)
    hit = forced._fast_last[2]
    if hit is not None and hit.call is not None:
        fns["bound"] = lambda: hit.call(q, k, v)
    fns["forced"] = lambda: forced(q, k, v)
    fns["default"] = lambda: default(q, k, v)
    return fns, default.last_decision.chosen, (hit is not None and hit.call is not None)


def profile_ops(step, steps: int = 20) -> dict[str, int]:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return {e.key: e.count / steps for e in prof.key_averages()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--ops", action="store_true", help="also torch.profiler's op counts, module vs SDPA (cuDNN)")
    ap.add_argument("--only", default=None, help="comma list of call labels' first words (enc0,small1,...)")
    args = ap.parse_args()
    rows = []
    only = set(args.only.split(",")) if args.only else None
    for label, b, s, h, hkv, d, causal, fmt in CALLS:
        if only and label.split()[0] not in only:
            continue
        for train in (False, True):
            for provider in OPS:
                q, k, v, dout = tensors(b, s, h, hkv, d, fmt, train)
                try:
                    fns, default_pick, bound = callers(provider, b, s, h, hkv, d, causal, fmt, q, k, v, train)
                except Exception as exc:  # noqa: BLE001 - a provider that cannot run the call
                    print(f"{label} {provider}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                steps = {n: step_fn(lambda q, k, v, fn=fn: fn(), q, k, v, dout, {}, train) for n, fn in fns.items()}
                # several rounds, rotating who goes first: the host drifts
                host: dict[str, list[float]] = {n: [] for n in steps}
                gpu: dict[str, list[float]] = {n: [] for n in steps}
                names = list(steps)
                failed = {}
                for r in range(3):
                    for n in names[r % len(names):] + names[:r % len(names)]:
                        if n in failed:
                            continue
                        try:
                            t = split_times(steps[n], samples=max(3, args.samples // 3))
                        except Exception as exc:  # noqa: BLE001 - a caller this torch cannot run: recorded
                            failed[n] = f"{type(exc).__name__}: {str(exc)[:200]}"
                            continue
                        host[n].append(t["host_ms"] * 1e3)
                        gpu[n].append(t["gpu_ms"] * 1e3)
                host = {n: x for n, x in host.items() if x}
                gpu = {n: x for n, x in gpu.items() if x}
                row = {"label": label, "train": train, "provider": provider, "default_pick": default_pick,
                       "bound_call": bound,
                       "host_us": {n: statistics.median(x) for n, x in host.items()},
                       "gpu_us": {n: statistics.median(x) for n, x in gpu.items()}, "failed": failed}
                if args.ops and provider == "cudnn_fused:torch":
                    ops_sdpa = profile_ops(steps["sdpa"])
                    ops_mod = profile_ops(steps["forced"])
                    row["ops_differ"] = {key: [ops_sdpa.get(key, 0), ops_mod.get(key, 0)]
                                         for key in sorted(set(ops_sdpa) | set(ops_mod))
                                         if ops_sdpa.get(key, 0) != ops_mod.get(key, 0)}
                rows.append(row)
                hu = row["host_us"]
                print(f"{label:38s} {'train' if train else 'fwd  '} {provider:19s} " + " ".join(
                    f"{n}={hu[n]:.1f}" for n in hu) + f"  gpu sdpa={row['gpu_us']['sdpa']:.1f} forced="
                    f"{row['gpu_us']['forced']:.1f}", flush=True)
                if row.get("ops_differ"):
                    print("    ops (sdpa, module per step):", {k2: v2 for k2, v2 in row["ops_differ"].items()})
                if failed:
                    print("    failed:", failed)
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
