"""The torch providers' native-autograd path (backends/_torch_native.py): the module, forced to each torch
provider, against a float32 reference on fresh random inputs, forward and q/k/v gradients; and proof that the
path was taken (no attn_dispatch autograd node in the graph)."""
from __future__ import annotations

import pytest
import torch

from attn_dispatch import DotProductAttention

from gpu_common import rel_err

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CASES = [  # provider, fmt, mask, b, s, skv, h, hkv, d
    ("flash_attn_2:torch", "bshd", "causal", 2, 256, 256, 8, 8, 64),
    ("flash_attn_2:torch", "sbhd", "causal", 2, 256, 256, 8, 2, 128),
    ("flash_attn_2:torch", "bshd", "no_mask", 3, 200, 333, 4, 4, 128),
    ("flash_attn_2:torch", "bshd", "causal_bottom_right", 2, 100, 300, 8, 4, 64),
    ("flash_attn_2:torch", "bshd", "causal_bottom_right", 2, 300, 100, 8, 4, 64),  # empty rows: general path
    ("cudnn_fused:torch", "bshd", "causal", 2, 256, 256, 8, 8, 128),
    ("cudnn_fused:torch", "sbhd", "no_mask", 2, 192, 192, 4, 4, 64),
    ("cudnn_fused:torch", "sbhd", "causal", 2, 256, 256, 8, 2, 128),
    ("cudnn_fused:torch", "bshd", "causal", 2, 256, 256, 16, 1, 64),
]


def reference(q, k, v, mask, fmt):
    """float32 attention on [b, h, s, d] views; causal top-left, causal_bottom_right bottom-right."""
    perm = (0, 2, 1, 3) if fmt == "bshd" else (1, 2, 0, 3)
    q4, k4, v4 = (x.float().permute(*perm) for x in (q, k, v))
    rep = q4.shape[1] // k4.shape[1]
    k4, v4 = k4.repeat_interleave(rep, 1), v4.repeat_interleave(rep, 1)
    s = q4 @ k4.transpose(-1, -2) / q4.shape[-1] ** 0.5
    sq, skv = s.shape[-2:]
    if mask != "no_mask":
        shift = skv - sq if mask == "causal_bottom_right" else 0
        keep = torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril(shift)
        s = s.masked_fill(~keep, float("-inf"))
    o4 = s.softmax(-1).nan_to_num(0.0) @ v4  # a row that sees no key outputs 0
    o = o4.permute(0, 2, 1, 3) if fmt == "bshd" else o4.permute(2, 0, 1, 3)
    return o.reshape(*o.shape[:2], -1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_native_path_matches_reference(case):
    provider, fmt, mask, b, s, skv, h, hkv, d = case
    gen = torch.Generator(device="cuda").manual_seed(hash(case) % 2**31)
    shape = (lambda n, heads: (b, n, heads, d)) if fmt == "bshd" else (lambda n, heads: (n, b, heads, d))
    q, k, v = (torch.randn(*shape(n, heads), generator=gen, device="cuda").bfloat16().requires_grad_()
               for n, heads in ((s, h), (skv, hkv), (skv, hkv)))
    m = DotProductAttention(h, d, num_gqa_groups=hkv, qkv_format=fmt, attn_mask_type=mask, backend=provider).cuda()
    out = m(q, k, v)
    names, fn = set(), out.grad_fn
    while fn is not None and len(names) < 20:
        names.add(type(fn).__name__)
        fn = fn.next_functions[0][0] if fn.next_functions else None
    native = not (mask == "causal_bottom_right" and s > skv)
    assert native == (not any("Engine" in n for n in names)), names
    dout = torch.randn_like(out)
    out.backward(dout)
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = reference(qr, kr, vr, mask, fmt)
    ref.backward(dout.float())
    assert rel_err(out, ref) < 2e-2
    for got, want in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        assert rel_err(got, want) < 3e-2


@pytest.mark.parametrize("provider", ["flash_attn_2:torch", "cudnn_fused:torch"])
def test_repeat_calls_with_keyword_settings_run_the_bound_op_and_match_reference(provider):
    """Megatron-style calls (attn_mask_type and qkv_format passed every call) and q, k, v-only calls alternate on
    one module: after their first calls every call takes the inline bound path (the module's general path is never
    entered), and each gives its own mask's result and gradients on fresh inputs."""
    b, s, h, hkv, d = 2, 256, 8, 2, 128
    m = DotProductAttention(h, d, num_gqa_groups=hkv, qkv_format="sbhd", attn_mask_type="no_mask",
                            backend=provider).cuda()
    entered = []
    general = DotProductAttention._forward_args
    DotProductAttention._forward_args = lambda self, *a: (entered.append(1), general(self, *a))[1]
    try:
        for step in range(4):
            gen = torch.Generator(device="cuda").manual_seed(100 + step)
            q, k, v = (torch.randn(s, b, n, d, generator=gen, device="cuda").bfloat16().requires_grad_()
                       for n in (h, hkv, hkv))
            for mask, kwargs in (("causal", {"attn_mask_type": "causal", "qkv_format": "sbhd"}), ("no_mask", {})):
                out = m(q, k, v, **kwargs)
                dout = torch.randn_like(out)
                grads = torch.autograd.grad(out, (q, k, v), dout)
                qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
                ref = reference(qr, kr, vr, mask, "sbhd")
                ref_grads = torch.autograd.grad(ref, (qr, kr, vr), dout.float())
                assert rel_err(out, ref) < 2e-2, (mask, step)
                for got, want in zip(grads, ref_grads):
                    assert rel_err(got, want) < 3e-2, (mask, step)
    finally:
        DotProductAttention._forward_args = general
    assert len(entered) == 2  # one plan per setting; every later call ran the bound op inline


@pytest.mark.parametrize("disable", ["NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN"])
@pytest.mark.parametrize("is_causal,h,hkv,d", [(True, 8, 2, 128), (False, 4, 4, 64)])
def test_sdpa_function_repeats_take_the_bhsd_path_and_match_reference(monkeypatch, disable, is_causal, h, hkv, d):
    """The SDPA-signature function called as a transformers model calls it (a new [b, h, s, d] tensor each step):
    from a signature's third call a torch provider's op runs on the [b, h, s, d] tensors themselves. Every call,
    grad mode flips and other strides included, against float32, forward and q/k/v gradients."""
    import attn_dispatch
    from attn_dispatch import explain_sdpa, sdpa

    monkeypatch.setenv(disable, "0")  # one family off: the other's engine runs (the torch one on stock torch)
    attn_dispatch.clear_cache()
    monkeypatch.setattr(sdpa, "_MODULES", {})
    unmerged = []
    through = DotProductAttention._attend_unmerged
    monkeypatch.setattr(DotProductAttention, "_attend_unmerged",
                        lambda self, *a, **kw: (unmerged.append(1), through(self, *a, **kw))[1])
    b, s = 2, 333

    def fresh(step, bshd_memory=False):
        gen = torch.Generator(device="cuda").manual_seed(7 * step + d)
        shape = (lambda n: (b, s, n, d)) if bshd_memory else (lambda n: (b, n, s, d))
        made = [torch.randn(*shape(n), generator=gen, device="cuda").bfloat16() for n in (h, hkv, hkv)]
        return [(x.transpose(1, 2) if bshd_memory else x).requires_grad_() for x in made]

    provider = explain_sdpa(*fresh(0), is_causal=is_causal, enable_gqa=h != hkv).chosen
    steps = [(True, False)] * 5 + [(False, False), (True, False), (True, True), (True, False)]
    for step, (grad, bshd_memory) in enumerate(steps):
        q, k, v = fresh(step + 1, bshd_memory)
        with torch.set_grad_enabled(grad):
            out = attn_dispatch.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=h != hkv)
        qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
        ref = reference(*(x.transpose(1, 2) for x in (qr, kr, vr)), "causal" if is_causal else "no_mask", "bshd")
        ref = ref.view(b, s, h, d).transpose(1, 2)
        assert rel_err(out, ref) < 2e-2, (provider, step)
        if grad:
            dout = torch.randn_like(out)
            got = torch.autograd.grad(out, (q, k, v), dout)
            want = torch.autograd.grad(ref, (qr, kr, vr), dout.float())
            for g, w in zip(got, want):
                assert rel_err(g, w) < 3e-2, (provider, step)
        if step == 4 and provider.endswith(":torch"):
            assert len(unmerged) == 2, provider  # planned, then the bshd cached path (which binds); then bhsd
