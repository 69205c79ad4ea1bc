"""A context-parallel module in bshd runs forward and backward, then a new one in sbhd of the same shape, in the same
processes (NCCL, one GPU per rank, bf16, b2 s8192 h16/4 d128, causal, p2p): each rank's output and q/k/v
gradients against a single-GPU run of the whole sequence (float32, torch's memory-efficient SDPA kernel).

The failure this guards against: torch's cuDNN SDPA backward caches its graph on q, k, v alone and bakes in the
layout of O (and dO, the stats) it was built with; cudnn_fused:torch gives it bshd q, k, v in both formats while
the ring hands back its merged output in the call's format, so the sbhd module ran on the bshd module's graph
(rank 0's gradients off by 0.51 on 4 H200s). The single-GPU test below checks the engine alone on the real op.

    python -m pytest -q -s tests/gpu/test_cp_layout_gpu.py      # 4 ranks where 4 GPUs are, 2 where 2 are

Each rank's errors and the engine every ring block ran on are printed (-s) and, where $OUT is set, written to
$OUT/cp_layout_gpu.json.
"""
from __future__ import annotations

import datetime
import json
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attn_dispatch import DotProductAttention
from attn_dispatch import context_parallel as cp
from attn_dispatch.backends import AttnAux, AttnConfig, get_engine
from attn_dispatch.context_parallel.engines import SelectedPerBlock
from reference import reference_attention
from spawn_ranks import free_port, spawn_ranks, teardown, write_gathered

pytestmark = pytest.mark.gpu

SHAPE = dict(b=2, s=8192, h=16, hkv=4, d=128)  # the reproduction's
TOL = 2e-2  # bf16 against a float32 run; the stale graph gave 0.51
SPAWN_DEADLINE_S = 480


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _layout(fmt: str, b: int, s: int, heads: int, d: int) -> tuple:
    return (b, s, heads, d) if fmt == "bshd" else (s, b, heads, d)


def _bhsd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return x.permute(0, 2, 1, 3) if fmt == "bshd" else x.permute(1, 2, 0, 3)


def _whole_sequence(q, k, v, dout, fmt):
    """The whole sequence on this GPU in float32 (memory-efficient kernel, causal): out and q/k/v gradients."""
    leaves = [t.detach().to(torch.float32, copy=True).requires_grad_() for t in (q, k, v)]
    qf, kf, vf = (_bhsd(t, fmt) for t in leaves)
    group = qf.shape[1] // kf.shape[1]
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out4 = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=q.shape[-1] ** -0.5)
    out = out4.permute(0, 2, 1, 3) if fmt == "bshd" else out4.permute(2, 0, 1, 3)
    out.backward(dout.float())
    return out.detach(), [t.grad for t in leaves]


def _module_run(fmt: str, world: int, rank: int, seed: int) -> dict:
    b, s, h, hkv, d = (SHAPE[k] for k in ("b", "s", "h", "hkv", "d"))
    gen = torch.Generator().manual_seed(seed)  # on the host: the same values on every rank
    mk = lambda heads: torch.randn(_layout(fmt, b, s, heads, d), generator=gen).to("cuda", torch.bfloat16)  # noqa: E731
    q, k, v, dout = mk(h), mk(hkv), mk(hkv), mk(h)
    out_ref, grads_ref = _whole_sequence(q, k, v, dout, fmt)
    local = lambda x: cp.shard(x, fmt, world, rank)  # noqa: E731
    leaves = [local(t).detach().requires_grad_() for t in (q, k, v)]
    module = DotProductAttention(h, d, num_gqa_groups=hkv, qkv_format=fmt, attn_mask_type="causal",
                                 cp_group=dist.group.WORLD, cp_comm_type="p2p").cuda()
    out = module(*leaves)
    out.backward(local(dout).reshape(out.shape))
    torch.cuda.synchronize()
    errors = {"out": _rel(out.unflatten(-1, (h, d)), local(out_ref))}
    errors.update({n: _rel(t.grad, local(want)) for n, t, want in zip(("dq", "dk", "dv"), leaves, grads_ref)})
    return {"errors": errors, "chosen": module.last_decision.chosen if module.last_decision else None}


def _worker(rank: int, world: int, port: int, out_path: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    made: list[SelectedPerBlock] = []  # every per-block engine, for the blocks' choices
    init = SelectedPerBlock.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)
    SelectedPerBlock.__init__ = tracked
    try:
        results: dict = {}
        for seed, fmt in enumerate(("bshd", "sbhd")):  # in this order, in these processes: the reproduction
            try:
                results[fmt] = _module_run(fmt, world, rank, seed)
            except Exception:  # noqa: BLE001 - reported by the test
                results[fmt] = {"error": traceback.format_exc()[-3000:]}
            results[fmt]["blocks"] = {desc: choice for engine in made for desc, choice in engine.choices.items()}
            made.clear()
        write_gathered(results, world, rank, out_path)
    finally:
        SelectedPerBlock.__init__ = init
        teardown()


def _report(world: int, per_rank: list) -> None:
    for rank, results in enumerate(per_rank):
        for fmt, res in results.items():
            print(f"cp{world} rank {rank} {fmt}: {res.get('errors', res.get('error'))} chosen={res.get('chosen')}")
            for desc, choice in sorted(res.get("blocks", {}).items()):
                print(f"    block {desc}: {choice}")
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "cp_layout_gpu.json")
        previous = json.load(open(path)) if os.path.exists(path) else {}
        previous[f"cp{world}"] = {"shape": SHAPE, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                                  "device": torch.cuda.get_device_name(0), "ranks": per_rank}
        with open(path, "w") as f:
            json.dump(previous, f, indent=1)


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"cp{w}")
def test_bshd_then_a_new_sbhd_module_matches_one_gpu(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices; this machine has {torch.cuda.device_count()}")
    out_path = str(tmp_path / "results.json")
    per_rank = spawn_ranks(_worker, (world, free_port(), out_path), world, out_path, f"cp layout (world={world})",
                           SPAWN_DEADLINE_S)
    if isinstance(per_rank, str):
        pytest.fail(per_rank)
    _report(world, per_rank)
    failures = []
    for rank, results in enumerate(per_rank):
        for fmt in ("bshd", "sbhd"):
            res = results[fmt]
            if "error" in res:
                failures.append(f"rank {rank} {fmt}: {res['error']}")
            elif max(res["errors"].values()) >= TOL:
                failures.append(f"rank {rank} {fmt}: {res['errors']}")
    assert not failures, failures


@pytest.mark.parametrize("order", [("bshd", "sbhd"), ("sbhd", "bshd")], ids="_then_".join)
def test_torch_cudnn_backward_takes_any_layout_of_out(order):
    """cudnn_fused:torch alone on one GPU: forward, then backward given the output as context parallelism gives
    it (a fresh tensor in the call's format), bshd and sbhd of one shape in turn, against the float64 reference."""
    if not torch.backends.cudnn.is_available() or torch.backends.cudnn.version() < 90000:
        pytest.skip(f"torch's cuDNN SDPA needs cuDNN 9; this torch has {torch.backends.cudnn.version()}")
    engine = get_engine("cudnn_fused:torch")
    b, s, h, hkv, d = 2, 384, 8, 2, 64  # a shape no other test gives torch's graph cache
    gen = torch.Generator(device="cuda").manual_seed(len(order[0]))
    for fmt in order:
        mk = lambda heads: torch.randn(_layout(fmt, b, s, heads, d), generator=gen, device="cuda").to(  # noqa: E731
            torch.bfloat16)
        q, k, v, dout = mk(h), mk(hkv), mk(hkv), mk(h)
        cfg = AttnConfig(qkv_format=fmt, attn_mask_type="causal", softmax_scale=d ** -0.5)
        aux = AttnAux(max_seqlen_q=s, max_seqlen_kv=s)
        res = engine.forward(q, k, v, aux, cfg)
        grads = engine.backward(dout, q, k, v, res.out.contiguous(), res.lse, res.state, aux, cfg)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref, _ = reference_attention(*leaves, qkv_format=fmt, attn_mask_type="causal", softmax_scale=d ** -0.5)
        ref.backward(dout.double())
        errors = {"out": _rel(res.out, ref)}
        errors.update({n: _rel(g, t.grad) for n, g, t in zip(("dq", "dk", "dv"), grads[:3], leaves)})
        assert max(errors.values()) < TOL, f"{fmt} after {order[0]}: {errors}"
