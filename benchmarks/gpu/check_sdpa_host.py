"""Issue 12: where the module's torch-cuDNN step still costs more than F.scaled_dot_product_attention's on the same
kernel (host-bound calls: 1.05-1.14x, 2-7 us a forward, on every H100 lease of sessions 14-16), and whether the
measured policy's tuner step costs what the module's does on small calls (blind10-18: its tuner read cuDNN (torch)
1.2-1.5x above the module forced to it on d64-d96 encoder calls).

Per call (bf16, bshd, H100; stock torch is enough): host microseconds per call (perf_counter over a loop of calls
enqueued behind a spin kernel, least of several loops: the launch path alone) and the step time (block timer,
interleaved, as bench_user_step.py --timer block) of
- sdpa: F.scaled_dot_product_attention as a user writes it (permuted views in, permute + reshape out);
- op: torch._scaled_dot_product_cudnn_attention on the same views, called as the module's bound function calls it
  (the op returns nine values to Python, F.sdpa one tensor);
- public: the same views through F.scaled_dot_product_attention itself, positional arguments (what the module
  would call if SDPA's own choice for the signature is cuDNN);
- module: DotProductAttention forced to cudnn_fused:torch; tuner: the measured policy's engine_step for it on its
  synthetic inputs; tuner_same: engine_step on the very tensors the module is timed on;
- fa2 / fa2_tuner: the module forced to flash_attn_2:torch and its tuner step.

    python3 benchmarks/gpu/check_sdpa_host.py --out $OUT/sdpa_host.json
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch import DotProductAttention, backends  # noqa: E402
from attn_dispatch.backends import _torch_native  # noqa: E402
from attn_dispatch.params import AttentionParams  # noqa: E402
from attn_dispatch.policy.timing import SyntheticCall, TimerSettings, build_inputs, engine_step, time_interleaved  # noqa: E402,E501
from bench_user_step import environment  # noqa: E402
from check_host_overhead import tensors  # noqa: E402  (the same seeded q, k, v, dout as that check's)

CALLS = [  # (label, b, s, h, hkv, d, causal, train): blind10-18 rows where F.sdpa beat the module on cuDNN
    ("enc2 d64 s128 b64 h20 fwd", 64, 128, 20, 20, 64, False, False),
    ("enc2 d64 s128 b64 h20 fwd+bwd", 64, 128, 20, 20, 64, False, True),
    ("enc0 d96 s384 b10 h16 fwd", 10, 384, 16, 16, 96, False, False),
    ("enc3 d80 s1024 b4 h8 fwd", 4, 1024, 8, 8, 80, False, False),
    ("small2 d128 s256 b8 h32 causal fwd", 8, 256, 32, 32, 128, True, False),
    ("d256 s1024 b1 h32 causal fwd", 1, 1024, 32, 32, 256, True, False),
    ("enc1 d80 s197 b64 h12 fwd+bwd", 64, 197, 12, 12, 80, False, True),
    ("enc1 d64 s256 b64 h20 fwd+bwd", 64, 256, 20, 20, 64, False, True),
    ("llm d128 s1024 b2 h16/4 causal fwd", 2, 1024, 16, 4, 128, True, False),
]
SETTINGS = TimerSettings(warmup=2, reps=24, max_reps=200, target_ms=40.0, warm_ms=40.0, block_ms=3.0)
SCALE_SETTINGS = dataclasses.replace(SETTINGS, reps=48)  # --scale: 48 samples a column, two interleaved runs


def functions(b, s, h, hkv, d, causal, train):
    q, k, v, dout = tensors(b, s, h, hkv, d, "bshd", train)
    mask = "causal" if causal else "no_mask"
    modules = {name: DotProductAttention(h, d, num_gqa_groups=hkv, qkv_format="bshd", attn_mask_type=mask,
                                         backend=provider).cuda().train(train)
               for name, provider in (("module", "cudnn_fused:torch"), ("fa2", "flash_attn_2:torch"))}
    gqa = h != hkv
    perm = (0, 2, 1, 3)
    op = _torch_native._CUDNN
    sdpa_fn = F.scaled_dot_product_attention

    def sdpa(q, k, v):
        o = sdpa_fn(q.permute(*perm), k.permute(*perm), v.permute(*perm), is_causal=causal, enable_gqa=gqa)
        o = o.permute(*perm)
        return o.reshape(*o.shape[:2], -1)

    merged = (b, s, h * d)

    def op_call(q, k, v):
        lse = train and torch.is_grad_enabled()
        o = op(q.permute(*perm), k.permute(*perm), v.permute(*perm), None, lse, 0.0, causal, False, scale=None)[0]
        return o.permute(*perm).view(merged)

    def public(q, k, v):
        if gqa:  # scale and enable_gqa are keyword-only
            o = sdpa_fn(q.permute(*perm), k.permute(*perm), v.permute(*perm), None, 0.0, causal, enable_gqa=True)
        else:
            o = sdpa_fn(q.permute(*perm), k.permute(*perm), v.permute(*perm), None, 0.0, causal)
        return o.permute(*perm).view(merged)

    calls = {"sdpa": sdpa, "op": op_call, "public": public, **modules}
    mode = "fwd_bwd" if train else "fwd"
    modules["module"](q.detach(), k.detach(), v.detach())
    params = AttentionParams(**modules["module"].last_decision.params)
    engines = {"module": backends.get_engine("cudnn_fused:torch"), "fa2": backends.get_engine("flash_attn_2:torch")}
    synth = build_inputs(params, seed=1, with_dout=train)
    steps = {f"{name}_tuner": engine_step(engine, synth, mode) for name, engine in engines.items()}
    same = SyntheticCall(q.detach(), k.detach(), v.detach(), synth.aux, synth.cfg,
                         dout.view(b, s, h, d) if train else None)
    steps["module_tuner_same"] = engine_step(engines["module"], same, mode)

    def step_of(call):
        if train:
            def step():
                q.grad = k.grad = v.grad = None
                with torch.enable_grad():
                    call(q, k, v).backward(dout)
            return step
        return lambda: call(q, k, v)
    with torch.set_grad_enabled(train):
        choice = torch.nn.attention.SDPBackend(torch._fused_sdp_choice(
            q.permute(*perm), k.permute(*perm), v.permute(*perm), None, 0.0, causal, enable_gqa=gqa)).name
    return {**{name: step_of(c) for name, c in calls.items()}, **steps}, choice


SCALE_CALLS = [c for c in CALLS if c[0].startswith(("small2", "d256", "llm", "enc0"))]


def scale_variants(b, s, h, hkv, d, causal, train):
    """--scale: the module's bound cuDNN function called alone, the module around it, the op with scale=None and with
    the module's explicit 1/sqrt(d), and F.sdpa both ways (the first run read the module 1.07x SDPA on causal
    forwards: this tells the bound function from the module's path around it)."""
    q, k, v, _ = tensors(b, s, h, hkv, d, "bshd", False)
    mask = "causal" if causal else "no_mask"
    module = DotProductAttention(h, d, num_gqa_groups=hkv, qkv_format="bshd", attn_mask_type=mask,
                                 backend="cudnn_fused:torch").cuda().eval()
    module(q, k, v)
    hit = module._fast_last[2]
    bound = hit.call
    perm, op, scale, merged = (0, 2, 1, 3), _torch_native._CUDNN, d ** -0.5, (b, s, h * d)
    gqa = {"enable_gqa": True} if h != hkv else {}

    def op_with(sc):
        return lambda: op(q.permute(*perm), k.permute(*perm), v.permute(*perm), None, False, 0.0, causal, False,
                          scale=sc)[0].permute(*perm).view(merged)

    def sdpa_with(**kw):
        return lambda: F.scaled_dot_product_attention(q.permute(*perm), k.permute(*perm), v.permute(*perm),
                                                      is_causal=causal, **gqa, **kw).permute(*perm).reshape(merged)
    return {"sdpa": sdpa_with(), "sdpa_scale": sdpa_with(scale=scale), "op_none": op_with(None),
            "op_scale": op_with(scale), "bound": lambda: bound(q, k, v), "module": lambda: module(q, k, v)}


def path_check() -> list[dict]:
    """--path: host microseconds per call (behind a spin) of the module forced to cuDNN (torch) and of its bound
    function alone, for a module planned with grad enabled or under no_grad and then called either way, and how
    many of those calls missed the inline cached path (counted by wrapping _fast_forward, which only a miss calls)."""
    from attn_dispatch import module as module_py

    b, s, h, d = 10, 384, 16, 96
    q, k, v, _ = tensors(b, s, h, h, d, "bshd", False)
    misses = [0]
    original = module_py.DotProductAttention._fast_forward

    def counted(self, *args, **kwargs):
        misses[0] += 1
        return original(self, *args, **kwargs)
    module_py.DotProductAttention._fast_forward = counted
    rows = []
    try:
        for planned_with_grad in (True, False):
            module = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="no_mask",
                                         backend="cudnn_fused:torch").cuda().eval()
            with torch.set_grad_enabled(planned_with_grad):
                module(q, k, v)
            bound = module._fast_last[2].call
            for called_with_grad in (True, False):
                with torch.set_grad_enabled(called_with_grad):
                    misses[0] = 0
                    module_us = host_us(lambda: module(q, k, v))
                    calls_missed = misses[0]
                    bound_us = host_us(lambda: bound(q, k, v))
                rows.append({"planned_with_grad": planned_with_grad, "called_with_grad": called_with_grad,
                             "module_us": module_us, "bound_us": bound_us, "missed": calls_missed})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        module_py.DotProductAttention._fast_forward = original
    return rows


def host_us(step, calls: int = 24, loops: int = 7) -> float:
    """Least mean host microseconds per step over `loops` loops of `calls` steps enqueued behind a spin kernel (the
    GPU busy: no launch waits on it), after a synchronize."""
    best = float("inf")
    for _ in range(loops):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2.0e6 * (2.0 + 0.3 * calls)))  # ~2 ms + 0.3 ms a step of spin (cycles ~2 GHz)
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, (time.perf_counter() - t0) * 1e6 / calls)
    torch.cuda.synchronize()
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scale", action="store_true", help="the scale variants of causal forwards (see scale_variants)")
    ap.add_argument("--path", action="store_true", help="the module's cached path against its bound call (path_check)")
    args = ap.parse_args()
    if args.path:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"environment": environment(), "rows": path_check()}, indent=1))
        return 0
    rows = []
    for label, *shape in (SCALE_CALLS if args.scale else CALLS):
        if args.scale:
            fns = scale_variants(*shape)
            with torch.no_grad():
                timings = [time_interleaved(fns, "cuda", SCALE_SETTINGS)[0] for _ in range(2)]
            row = {"label": label, "step_ms": {n: [t[n].median_ms for t in timings] for n in fns}}
            rows.append(row)
            base = statistics.mean(row["step_ms"]["sdpa"])
            print(f"{label:36s} " + " ".join(f"{n} {statistics.mean(v) / base:.3f}" for n, v in row["step_ms"].items()),
                  flush=True)
            continue
        fns, choice = functions(*shape)
        with torch.no_grad():
            for fn in fns.values():
                fn()
                fn()
        order = list(fns)
        host = {name: [] for name in order}
        for r in range(3):  # interleaved rounds, rotated
            for name in order[r % len(order):] + order[:r % len(order)]:
                with torch.no_grad():
                    host[name].append(host_us(fns[name]))
        timings, errors = time_interleaved(fns, "cuda", SETTINGS)
        row = {"label": label, "sdpa_choice": choice, "host_us": {n: min(v) for n, v in host.items()},
               "step_ms": {n: t.median_ms for n, t in timings.items()},
               "errors": {n: repr(e) for n, e in errors.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    settings = SCALE_SETTINGS if args.scale else SETTINGS
    Path(args.out).write_text(json.dumps({"environment": environment(), "settings": settings.to_dict(),
                                          "rows": rows}, indent=1))
    if args.scale:
        return 0
    names = list(rows[0]["host_us"])
    print("\nhost us per call (least over loops), then step ms (block timer); ratio to sdpa")
    print(f"{'call':36s} " + " ".join(f"{n[:12]:>12s}" for n in names))
    for row in rows:
        print(f"{row['label'][:36]:36s} " + " ".join(f"{row['host_us'][n]:12.1f}" for n in names))
        s = row["step_ms"]
        print(f"{'   step ms / sdpa':36s} " + " ".join(
            f"{s[n] / s['sdpa']:12.3f}" if n in s and "sdpa" in s else f"{'-':>12s}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
