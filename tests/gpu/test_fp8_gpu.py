"""FP8 attention on the GPU through DotProductAttention (cudnn_fused:fp8): against float32 attention on the same
bf16 inputs with Transformer Engine's FP8 criterion (RMSE <= 0.11 x range, test_dpa_fp8_vs_f16), the scaling state
through a checkpoint, FP8 outputs, and refusals that say why. benchmarks/bench_fp8.py has the full accuracy grid."""
from __future__ import annotations

import math

import pytest
import torch

from attn_dispatch import DotProductAttention, NoBackendAvailableError, fp8_autocast
from attn_dispatch.fp8 import DelayedScaling, Float8CurrentScaling, Float8Output

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("FP8 attention needs a Hopper or newer GPU", allow_module_level=True)
pytest.importorskip("cudnn")


def _ref(q, k, v, causal):
    h, hkv = q.shape[2], k.shape[2]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    kf, vf = kf.repeat_interleave(h // hkv, 1), vf.repeat_interleave(h // hkv, 1)
    return torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal).transpose(1, 2)


def _te_close(got, want):
    got, want = got.detach().float(), want.detach().float()
    rmse = (got - want).square().mean().sqrt()
    span = torch.maximum(got.max(), want.max()) - torch.minimum(got.min(), want.min())
    assert rmse <= 0.11 * span, f"RMSE {float(rmse):.4f} > 0.11 x range {float(span):.3f}"
    return float((got - want).norm() / want.norm())


def _qkv(b=2, s=512, h=8, hkv=8, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, s, n, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
                 for n in (h, hkv, hkv))


@pytest.mark.parametrize("recipe", [DelayedScaling(fp8_dpa=True), Float8CurrentScaling(fp8_dpa=True)],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("mask, hkv", [("causal", 8), ("no_mask", 8), ("causal", 2)])
def test_fp8_module_forward_backward(recipe, mask, hkv):
    m = DotProductAttention(8, 128, num_gqa_groups=hkv, qkv_format="bshd", attn_mask_type=mask)
    for step in range(3):  # delayed scales settle after the first step
        q, k, v = _qkv(hkv=hkv, seed=step)
        with fp8_autocast(recipe=recipe):
            out = m(q, k, v)
        dout = torch.randn_like(out)
        out.backward(dout)
    assert m.last_decision.chosen == "cudnn_fused:fp8"
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = _ref(qr, kr, vr, mask == "causal")
    ref.backward(dout.float().view_as(ref))
    assert _te_close(out.view_as(ref), ref) < 0.08
    for got, want in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        assert _te_close(got, want) < 0.2
    assert m.fp8_state.steps == 3 and bool((m.fp8_state.scale != 1).all())  # every slot's scale was set


def test_fp8_state_checkpoints_with_the_module():
    m = DotProductAttention(8, 128, qkv_format="bshd", attn_mask_type="causal")
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=8)
    q, k, v = _qkv()
    with fp8_autocast(recipe=recipe):
        m(q, k, v).sum().backward()
    saved = m.state_dict()
    fresh = DotProductAttention(8, 128, qkv_format="bshd", attn_mask_type="causal")
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.fp8_state.scale.cpu(), m.fp8_state.scale.cpu())
    q2, k2, v2 = _qkv(seed=5)
    with torch.no_grad(), fp8_autocast(recipe=recipe):
        a, b = m(q2, k2, v2), fresh(q2, k2, v2)
    assert torch.equal(a, b)  # same scales, same kernel: the same bits


def test_fp8_output_for_inference_and_refusals_with_reasons():
    m = DotProductAttention(8, 128, qkv_format="bshd", attn_mask_type="causal").eval()
    q, k, v = (x.detach() for x in _qkv())
    recipe = DelayedScaling(fp8_dpa=True, fp8_mha=True)
    with torch.no_grad(), fp8_autocast(recipe=recipe):
        m(q, k, v)
        out = m(q, k, v)
    assert isinstance(out, Float8Output) and out.data.dtype == torch.float8_e4m3fn
    _te_close(out.dequantize(torch.float32).view(2, 512, 8, 128), _ref(q, k, v, True))
    thd = DotProductAttention(8, 128, qkv_format="thd", attn_mask_type="padding_causal")
    cu = torch.tensor([0, 300, 512], dtype=torch.int32, device="cuda")
    with fp8_autocast(recipe=DelayedScaling(fp8_dpa=True)), pytest.raises(NoBackendAvailableError,
                                                                        match="THD is not supported on Hopper"):
        thd(q[0].requires_grad_(), k[0], v[0], cu_seqlens_q=cu, cu_seqlens_kv=cu)  # training: no ragged backward
    d64 = DotProductAttention(8, 64, qkv_format="bshd", attn_mask_type="causal")
    q64 = torch.randn(2, 256, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with fp8_autocast(recipe=DelayedScaling(fp8_dpa=True)), pytest.raises(NoBackendAvailableError,
                                                                        match="head dim 128 only"):
        d64(q64, q64, q64)
    assert math.isfinite(float(out.scale_inv))


@pytest.mark.parametrize("mask, hkv, gaps", [("padding_causal", 8, False), ("padding", 2, False),
                                             ("padding_causal", 8, True)])
def test_fp8_thd_inference_through_ragged_offsets(mask, hkv, gaps):
    """Packed sequences in FP8 (inference): cudnn-frontend 1.32 lets the FP8 forward take ragged offsets; this is
    where cuDNN 9.19 says whether it runs them. Each sequence against float32 attention on its own bf16 tokens."""
    lens = [700, 129, 1024, 64]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n + (37 if gaps else 0))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_pad = torch.tensor(starts, dtype=torch.int32, device="cuda")
    t = starts[-1]
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(t, n, 128, device="cuda", generator=g).to(torch.bfloat16) for n in (8, hkv, hkv))
    m = DotProductAttention(8, 128, num_gqa_groups=hkv, qkv_format="thd", attn_mask_type=mask).eval()
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad)
    with torch.no_grad(), fp8_autocast(recipe=Float8CurrentScaling(fp8_dpa=True)):
        m(q, k, v, **kw)  # the second call's O scale comes from this one's amax
        out = m(q, k, v, **kw).view(t, 8, 128)
    assert m.last_decision.chosen == "cudnn_fused:fp8"
    for a, n in zip(starts[:-1], lens):
        seq = slice(a, a + n)
        ref = _ref(q[None, seq], k[None, seq], v[None, seq], mask == "padding_causal")[0]
        assert _te_close(out[seq], ref) < 0.08, (a, n)
    if gaps:
        hole = torch.ones(t, dtype=torch.bool, device="cuda")
        for a, n in zip(starts[:-1], lens):
            hole[a:a + n] = False
        assert float(out[hole].float().abs().max()) == 0.0
