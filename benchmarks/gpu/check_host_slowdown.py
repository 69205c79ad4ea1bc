"""Why host-bound calls cost up to 2x more in a process with flash-attn-4 loaded (session 5).

The H200 and H100 fit grids timed the same small calls in two processes: torch's own providers only ("stock") and
the full stack. On calls of <= 0.5 ms every column, torch SDPA included, ran 1.4-2.6x slower in the full-stack
process (fit_h200 d128 s256 b16 h32 causal fwd: cuDNN op 0.108 vs 0.041 ms). This measures host costs in one process
at each stage of what the full stack does, so the stage that slows the host is named:
  0 torch + attn_dispatch imported; 1 cudnn (cudnn-frontend) imported; 2 flash_attn.cute imported;
  3 a flash-attn-4 forward and backward compiled and run; 4 gc.collect() + gc.freeze(); 5 gc disabled.
At each stage: a pure-Python loop, 2000 tiny CUDA adds (host time), torch SDPA fwd and fwd+bwd on a host-bound
shape (per call, queue kept short by a sync per 20 calls), the module's same call; plus the live threads, the
tracked-object count, torch function/dispatch modes, sys.gettrace/getprofile.
JSON to $OUT/check_host_slowdown.json; a table last. ~1 minute.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from attn_dispatch import DotProductAttention  # noqa: E402


def py_loop_us() -> float:
    t = time.perf_counter()
    acc = 0
    for i in range(200_000):
        acc += i & 7
    return (time.perf_counter() - t) * 1e6 / 200_000 * 1000  # ns per iteration, x1000 -> us per 1000


def per_call_us(fn, n: int = 200, chunk: int = 20) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(n // chunk):
        t = time.perf_counter()
        for _ in range(chunk):
            fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t) * 1e6 / chunk)
    best.sort()
    return best[len(best) // 2]


def snapshot(stage: str, tensors) -> dict:
    q, k, v, qg, kg, vg, dout, mod = tensors
    x = torch.ones(1, device="cuda")

    def adds():
        for _ in range(100):
            x.add_(1)

    def sdpa_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def sdpa_bwd():
        qg.grad = kg.grad = vg.grad = None
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(dout)

    qm, km, vm = (t.transpose(1, 2) for t in (q, k, v))

    def module_fwd():
        with torch.no_grad():
            mod(qm, km, vm)

    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return {
        "stage": stage,
        "py_loop_us_per_1000": round(py_loop_us(), 2),
        "cuda_add_us": round(per_call_us(adds, 100, 10) / 100, 3),
        "sdpa_fwd_us": round(per_call_us(sdpa_fwd), 1),
        "sdpa_fwd_bwd_us": round(per_call_us(sdpa_bwd), 1),
        "module_fwd_us": round(per_call_us(module_fwd), 1),
        "threads": sorted(t.name for t in threading.enumerate()),
        "gc_objects": len(gc.get_objects()),
        "gc_counts": gc.get_count(), "gc_enabled": gc.isenabled(),
        "function_modes": [type(m).__name__ for m in _get_current_function_mode_stack()],
        "dispatch_modes": [type(m).__name__ for m in _get_current_dispatch_mode_stack()],
        "trace": repr(sys.gettrace()), "profile": repr(sys.getprofile()),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "TORCH", "PYTORCH", "CUTE", "OMP"))},
    }


def main() -> int:
    torch.manual_seed(0)
    b, h, s, d = 16, 32, 256, 128  # fit_h200 'd128 s256 b16 h32 causal': 0.041 ms stock, 0.108 full stack
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    mod = DotProductAttention(h, d, attn_mask_type="causal", backend="cudnn_fused:torch").cuda().eval()
    tensors = (q, k, v, qg, kg, vg, dout, mod)
    rows = [snapshot("0 torch + attn_dispatch", tensors)]
    try:
        import cudnn  # noqa: F401
        rows.append(snapshot("1 cudnn-frontend imported", tensors))
    except ImportError as exc:
        print("no cudnn-frontend:", exc)
    try:
        t = time.perf_counter()
        from flash_attn.cute import flash_attn_func
        rows.append(snapshot(f"2 flash_attn.cute imported ({time.perf_counter() - t:.1f} s)", tensors))
        qf, kf, vf = (t_.transpose(1, 2).contiguous().requires_grad_() for t_ in (q, k, v))
        out = flash_attn_func(qf, kf, vf, causal=True)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        rows.append(snapshot("3 flash-attn-4 fwd+bwd compiled and run", tensors))
    except ImportError as exc:
        print("no flash-attn-4:", exc)
    gc.collect()
    gc.freeze()
    rows.append(snapshot("4 gc.collect + gc.freeze", tensors))
    gc.disable()
    rows.append(snapshot("5 gc disabled", tensors))
    gc.enable()
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "check_host_slowdown.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"{'stage':48s} {'py/1k':>7s} {'add':>6s} {'sdpa f':>7s} {'sdpa fb':>8s} {'mod f':>7s} {'thr':>4s} "
          f"{'objects':>9s}")
    for r in rows:
        print(f"{r['stage'][:48]:48s} {r['py_loop_us_per_1000']:7.1f} {r['cuda_add_us']:6.2f} {r['sdpa_fwd_us']:7.1f} "
              f"{r['sdpa_fwd_bwd_us']:8.1f} {r['module_fwd_us']:7.1f} {len(r['threads']):4d} {r['gc_objects']:9d}")
    for r in rows:
        print(r["stage"], "threads:", r["threads"], "modes:", r["function_modes"], r["dispatch_modes"], r["trace"],
              r["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
