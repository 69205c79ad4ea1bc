"""The torch providers' native-op path (backends/_torch_native.flash_call) on the CPU: its layout handling (bshd and
sbhd in as [b, h, s, d] views, the output back, heads merged or not) around torch's CPU flash kernel, which takes
and returns what aten::_scaled_dot_product_flash_attention does. Against the float64 reference, gradients too;
the GPU test (tests/gpu/test_torch_native_gpu.py) runs the real op."""
from __future__ import annotations

import zlib

import pytest
import torch

from attn_dispatch.backends import _torch_native
from attn_dispatch.backends.base import AttnAux, AttnConfig
from reference import reference_attention


def _cpu_flash(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
    assert not return_debug_mask
    return torch._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)


@pytest.mark.parametrize("flatten_heads", [True, False])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_flash_call_layouts_match_the_reference(monkeypatch, fmt, mask, flatten_heads):
    monkeypatch.setattr(_torch_native, "_FLASH", _cpu_flash)
    b, s, h, d = 2, 7, 3, 8
    g = torch.Generator().manual_seed(zlib.crc32(f"{fmt}{mask}{flatten_heads}".encode()))
    shape = (b, s, h, d) if fmt == "bshd" else (s, b, h, d)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    cfg = AttnConfig(qkv_format=fmt, attn_mask_type=mask, softmax_scale=d ** -0.5)
    out, lse, max_logit = _torch_native.flash_call(q, k, v, AttnAux(max_seqlen_q=s, max_seqlen_kv=s), cfg,
                                                   flatten_heads)
    ref, ref_lse = reference_attention(q, k, v, qkv_format=fmt, attn_mask_type=mask)
    if flatten_heads:
        ref = ref.flatten(-2)
    assert out.shape == ref.shape and max_logit is None
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    assert "Engine" not in type(out.grad_fn).__name__  # torch's own autograd, no Python Function
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = torch.autograd.grad(ref, (q, k, v), dout)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)
