"""Issue 12: what each check of the module's inline cached path costs on a GPU host, on CUDA and CPU tensors.

check_sdpa_host.py --path found the module's repeat call on CUDA tensors ~5 us over its bound cuDNN call (and no
call missing the inline path), where bench_hotpath_cpu.py's CPU stand-in on the same host reads ~2.7 us. This times
(timeit, least of several repeats) the pieces of DotProductAttention.__call__'s inline path on one module, planned,
and the tensor guard on CUDA tensors against CPU tensors of the same signature.

    python3 benchmarks/gpu/check_guard_cost.py --out $OUT/guard_cost.json
"""
from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch import DotProductAttention, inputs  # noqa: E402
from attn_dispatch import module as module_py  # noqa: E402
from bench_user_step import environment  # noqa: E402


def least_us(stmt: str, namespace: dict, number: int = 20000, repeat: int = 7) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=repeat, globals=namespace)) / number * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(10, 384, 16, 96, generator=gen, device="cuda").bfloat16() for _ in range(3))
    qc, kc, vc = (x.cpu() for x in (q, k, v))
    module = DotProductAttention(16, 96, qkv_format="bshd", attn_mask_type="no_mask",
                                 backend="cudnn_fused:torch").cuda().eval()
    module(q, k, v)
    guard, _, hit, _ = module._fast_last
    namespace = dict(vars(module_py), m=module, q=q, k=k, v=v, qc=qc, kc=kc, vc=vc, guard=guard, hit=hit,
                     cpu_guard=inputs.tensor_guard(qc, kc, vc), torch=torch)
    pieces = {
        "guard, CUDA tensors": "guard(q, k, v)",
        "guard, CPU tensors": "cpu_guard(qc, kc, vc)",
        "compile check": "_is_compiling()",
        "hook checks": "m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks "
                       "or _GLOBAL_FORWARD_PRE_HOOKS or _GLOBAL_FORWARD_HOOKS or _GLOBAL_BACKWARD_PRE_HOOKS "
                       "or _GLOBAL_BACKWARD_HOOKS or m._compiled_call_impl is not None "
                       "or torch._C._get_tracing_state()",
        "determinism flag": "_deterministic_now()",
        "plan state": "g, t, h, c = m._fast_last; h.call is not None and t is m.training and c is QKV_ONLY "
                      "and m.cp_group is None and not _FP8_REGIONS[0] and h.plan.generation == _GENERATION[0]",
        "module call, whole": "m(q, k, v)",
        "bound call": "hit.call(q, k, v)",
    }
    with torch.no_grad():
        found = {name: least_us(stmt, namespace, number=2000 if "call" in name else 20000)
                 for name, stmt in pieces.items()}
        torch.cuda.synchronize()
    for name, us in found.items():
        print(f"{name:24s} {us:8.2f} us")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"environment": environment(), "us": found}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
