"""FP8 on packed sequences (thd) and FP8 under context parallelism (a2a), on the GPU.

1. thd: benchmarks/gpu/probe_fp8.py's thd cases (attn-dispatch's FP8 engine with ragged offsets; forward accuracy
   per sequence against float32, and whether cuDNN builds the ragged FP8 backward graph).
2. FP8 a2a, one process per GPU (at most 2). With ONE GPU the a2a group has one rank: the all-to-all is the
   identity and no scale needs agreeing, but the FP8 a2a path still runs for real: q, k, v quantized before the
   exchange and sent as uint8 through NCCL, the cuDNN graphs planned from the FP8 tensors, O and dQ/dK/dV
   returned as FP8 and dequantized after, the amax reductions over NCCL, the state snapshot on the device. It
   must equal the plain single-GPU FP8 call bit for bit. What one GPU cannot show, the cross-rank reorder and
   the scale agreement, the CPU gloo tests check (tests/test_fp8_context_parallel.py); with 2 GPUs this script
   runs it too, and the module path (DotProductAttention(cp_group=..., cp_comm_type='a2a') in fp8_autocast).

Prints a table last; JSON with machine, versions and date to $OUT/check_fp8_cp_thd.json.
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

A2A_CASES = [  # (name, recipe, mask, heads, kv heads, seq)
    ("delayed causal", "delayed", "causal", 16, 16, 4096),
    ("delayed no_mask GQA 16/4", "delayed", "no_mask", 16, 4, 2048),
    ("current causal", "current", "causal", 16, 16, 4096),
]
STEPS = 3


def _recipe(name):
    from attn_dispatch.fp8 import DelayedScaling, Float8CurrentScaling

    return Float8CurrentScaling(fp8_dpa=True) if name == "current" else DelayedScaling(fp8_dpa=True,
                                                                                       amax_history_len=16)


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def _te_ok(a, b):
    a, b = a.detach().float(), b.detach().float()
    span = float(torch.maximum(a.max(), b.max()) - torch.minimum(a.min(), b.min()))
    return float((a - b).square().mean().sqrt()) <= 0.11 * span


def _a2a_case(name, recipe, mask, h, hkv, s, rank, size, group):
    from attn_dispatch import context_parallel as cp
    from attn_dispatch.backends.base import AttnAux, AttnConfig
    from attn_dispatch.backends.cudnn_fused_fp8 import CudnnFP8Engine, FP8Call
    from attn_dispatch.context_parallel import api
    from attn_dispatch.context_parallel._comm import GroupInfo
    from attn_dispatch.fp8 import FP8ScalingState

    dev = torch.device("cuda", torch.cuda.current_device())
    engine = CudnnFP8Engine()
    causal = mask == "causal"
    cfg = AttnConfig(qkv_format="bshd", attn_mask_type=mask, window_size=(-1, 0) if causal else (-1, -1),
                     softmax_scale=1.0 / math.sqrt(128))
    info = GroupInfo(group, size, rank, tuple(range(size)))
    single, split = FP8ScalingState(_recipe(recipe)), FP8ScalingState(_recipe(recipe))
    row = {"case": name, "ranks": size}
    for step in range(STEPS):
        g = torch.Generator(device=dev).manual_seed(100 + step)
        q, k, v = (torch.randn(2, s, n, 128, device=dev, generator=g).to(torch.bfloat16) for n in (h, hkv, hkv))
        dout = torch.randn(2, s, h, 128, device=dev, generator=g).to(torch.bfloat16)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        aux = AttnAux()
        aux.extra["fp8"] = FP8Call(single)
        out_w, _, _ = engine(*leaves, aux, cfg)
        out_w.backward(dout)
        local = [cp.shard(x, "bshd", size, rank).requires_grad_() for x in (q, k, v)]
        aux = AttnAux()
        aux.extra["fp8"] = FP8Call(split, group=group, exchange_group=group)
        impl = api._build(engine, local[0], local[1], aux, cfg, "a2a", [info], None, True)
        out = api._ContextParallel.apply(impl, "vanilla", h, *local, None)
        out.backward(cp.shard(dout, "bshd", size, rank))
    torch.cuda.synchronize()
    row["impl"] = type(impl).__name__
    row["out_equal_single"] = bool(torch.equal(out, cp.shard(out_w.detach(), "bshd", size, rank)))
    row["grads_equal_single"] = all(torch.equal(x.grad, cp.shard(w.grad, "bshd", size, rank))
                                    for x, w in zip(local, leaves))
    row["out_vs_single"] = _rel(out, cp.shard(out_w.detach(), "bshd", size, rank))
    # cuDNN's dQ may accumulate with atomics: equal up to summation order
    row["dq_vs_single"] = _rel(local[0].grad, cp.shard(leaves[0].grad, "bshd", size, rank))
    row["scales_equal_single"] = bool(torch.equal(split.scale, single.scale))
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        qr.transpose(1, 2), kr.transpose(1, 2).repeat_interleave(h // hkv, 1),
        vr.transpose(1, 2).repeat_interleave(h // hkv, 1), is_causal=causal).transpose(1, 2)
    ref.backward(dout.float())
    row["out_vs_f32"] = _rel(out, cp.shard(ref, "bshd", size, rank))
    row["te_criterion"] = _te_ok(out, cp.shard(ref, "bshd", size, rank)) and all(
        _te_ok(x.grad, cp.shard(r.grad, "bshd", size, rank)) for x, r in zip(local, (qr, kr, vr)))
    row["dq_vs_f32"] = _rel(local[0].grad, cp.shard(qr.grad, "bshd", size, rank))
    if size > 1:
        everyone = [torch.empty_like(split.scale) for _ in range(size)]
        dist.all_gather(everyone, split.scale, group=group)
        row["ranks_share_scales"] = all(torch.equal(everyone[0], x) for x in everyone)
    return row


def _module_case(rank, size, group):
    """DotProductAttention(cp_group, a2a) inside fp8_autocast: selection, the CP glue and the FP8 a2a together."""
    from attn_dispatch import DotProductAttention, context_parallel as cp, fp8_autocast
    from attn_dispatch.fp8 import DelayedScaling

    m = DotProductAttention(16, 128, qkv_format="bshd", attn_mask_type="causal", cp_group=group,
                            cp_comm_type="a2a")
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, 4096, 16, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    local = [cp.shard(x, "bshd", size, rank).requires_grad_() for x in (q, k, v)]
    for _ in range(2):
        with fp8_autocast(recipe=DelayedScaling(fp8_dpa=True)):
            out = m(*local)
        out.float().square().mean().backward()
    torch.cuda.synchronize()
    return {"case": "module a2a", "ranks": size, "chosen": m.last_decision.chosen,
            "finite": bool(torch.isfinite(out).all() and all(torch.isfinite(x.grad).all() for x in local)),
            "steps": m.fp8_state.steps}


def _worker(rank: int, size: int, port: int, path: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            device_id=torch.device("cuda", rank))
    rows = []
    try:
        group = dist.group.WORLD
        for case in A2A_CASES:
            try:
                rows.append(_a2a_case(*case, rank, size, group))
            except Exception:  # noqa: BLE001 - reported per case
                rows.append({"case": case[0], "ranks": size, "error": traceback.format_exc()[-1500:]})
        if size > 1:
            try:
                rows.append(_module_case(rank, size, group))
            except Exception:  # noqa: BLE001
                rows.append({"case": "module a2a", "ranks": size, "error": traceback.format_exc()[-1500:]})
        if rank == 0:
            with open(path, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def main() -> int:
    import cudnn

    import probe_fp8

    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    meta = {"machine": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "cudnn": cudnn.backend_version(), "cudnn_frontend": cudnn.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(meta, flush=True)
    thd = probe_fp8.thd_cases()
    size = min(2, torch.cuda.device_count())
    part = os.path.join(out_dir, "a2a_rows.json")
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_worker, args=(size, port, part), nprocs=size, join=True, start_method="spawn")
    with open(part) as f:
        a2a = json.load(f)
    with open(os.path.join(out_dir, "check_fp8_cp_thd.json"), "w") as f:
        json.dump({"meta": meta, "thd": thd, "a2a": a2a}, f, indent=1)
    probe_fp8.print_thd(thd)
    print(f"\n== FP8 a2a on {size} GPU(s) ({STEPS} training steps; rank 0's shard)")
    for r in a2a:
        if "error" in r:
            print(f"{r['case']:<26} ERROR {r['error'][-300:]}")
        elif r["case"] == "module a2a":
            print(f"{r['case']:<26} chosen {r['chosen']}, finite {r['finite']}, steps {r['steps']}")
        else:
            print(f"{r['case']:<26} equal to single-GPU: out {r['out_equal_single']} grads {r['grads_equal_single']} "
                  f"(dq rel {r['dq_vs_single']:.1e}) "
                  f"scales {r['scales_equal_single']}; vs f32 out {r['out_vs_f32']:.4f} dq {r['dq_vs_f32']:.4f}; "
                  f"TE criterion {r['te_criterion']}" + (f"; ranks share scales {r['ranks_share_scales']}"
                                                         if "ranks_share_scales" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
