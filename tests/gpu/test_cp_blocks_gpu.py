"""The per-block calls windowed context parallelism makes, on every eligible engine of this GPU: each band block
(trimmed, bottom-right aligned window) against the float64 reference, output, lse and gradients. The multi-GPU
runs themselves are benchmarks/bench_cp.py (NCCL); these check that the engines compute the blocks it relies on."""
from __future__ import annotations

import pytest
import torch

from attn_dispatch import AttentionParams, explain
from attn_dispatch.backends import AttnAux, AttnConfig, get_engine
from attn_dispatch.constraints.context_parallel import block_params
from reference import reference_attention

pytestmark = pytest.mark.gpu

CALLS = [AttentionParams(dtype="bf16", num_heads=4, head_dim_qk=64, max_seqlen_q=1024, attn_mask_type="causal",
                         cp_size=cp, cp_comm_type=comm, window_size=window)
         for cp in (2, 4) for comm in ("p2p", "all_gather") for window in ((100, 0), (300, 0))]
CALLS.append(AttentionParams(dtype="bf16", num_heads=4, head_dim_qk=64, max_seqlen_q=1024, attn_mask_type="no_mask",
                             cp_size=2, cp_comm_type="p2p", window_size=(128, 64)))


def _blocks():
    seen = {}
    for call in CALLS:
        for b in block_params(call):
            seen.setdefault((b.max_seqlen_q, b.max_seqlen_kv, b.attn_mask_type, b.window_size), b)
    return list(seen.values())


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("block", _blocks(), ids=lambda b: f"{b.max_seqlen_q}x{b.max_seqlen_kv}-{b.attn_mask_type}-"
                         f"{b.window_size[0]}_{b.window_size[1]}")
def test_band_blocks_on_every_eligible_engine(block):
    decision = explain(block)
    eligible = [v.id for v in decision.verdicts if v.eligible]
    assert decision.chosen in eligible
    g = torch.Generator(device="cuda").manual_seed(block.max_seqlen_q * 7 + block.max_seqlen_kv)
    mk = lambda s: torch.randn(2, s, 4, 64, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v, dout = mk(block.max_seqlen_q), mk(block.max_seqlen_kv), mk(block.max_seqlen_kv), mk(block.max_seqlen_q)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference_attention(*leaves, attn_mask_type=block.attn_mask_type, window_size=block.window_size,
                                       softmax_scale=0.125)
    ref.backward(dout.double())
    cfg = AttnConfig(attn_mask_type=block.attn_mask_type, window_size=block.window_size, softmax_scale=0.125)
    aux = AttnAux(max_seqlen_q=block.max_seqlen_q, max_seqlen_kv=block.max_seqlen_kv)
    failures = []
    for provider in eligible:
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse, _ = get_engine(provider)(qq, kk, vv, aux, cfg)
        out.backward(dout)
        seen = torch.isfinite(ref_lse)
        errs = {"out": _rel(out, ref), "dq": _rel(qq.grad, leaves[0].grad), "dk": _rel(kk.grad, leaves[1].grad),
                "dv": _rel(vv.grad, leaves[2].grad),
                "lse": float((lse.double() - ref_lse)[seen].abs().max())}
        if max(errs.values()) > 2e-2:
            failures.append(f"{provider}: {errs}")
    assert not failures, failures
