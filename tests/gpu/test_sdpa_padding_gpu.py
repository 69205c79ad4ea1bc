"""Padding patterns in the SDPA function's bool masks, on the GPU (bf16): the fused engine the recognised mask type
reaches (not the unfused one; on stock torch, whose ops take no sequence lengths, the unfused one) against a float32
reference on the same bool mask, every row (padded rows too), output and q/k/v gradients; and torch's own SDPA on
that mask within the same tolerance. Also flash-attn-4's logit soft-capping against a float32 reference."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from attn_dispatch import explain_sdpa, scaled_dot_product_attention

from gpu_common import TOL, rel_err
from test_sdpa_padding import padding_mask as cpu_padding_mask

# fused engines that take padding (sequence lengths): cudnn-frontend's graphs, flash-attn's varlen kernels
PADDING_ENGINES = [name for name in ("cudnn", "flash_attn") if importlib.util.find_spec(name) is not None]

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def padding_mask(kind: str, ranges, sq: int, skv: int, window: int | None = None) -> torch.Tensor:
    """The CPU tests' padding pattern (tests/test_sdpa_padding.py), on the GPU."""
    return cpu_padding_mask(kind, ranges, sq, skv, window).cuda()


def reference(q, k, v, mask=None, softcap=0.0, causal=False):
    """float32 on [b, h, s, d]; rows that see no key give 0 (torch SDPA's convention)."""
    q, k, v = (x.float() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


CASES = [  # name, kind, ranges per batch element, sq, skv, h, hkv, engine family expected, window
    ("right_padded_causal (HF training)", "top_left", [(0, 256), (0, 200), (0, 97)], 256, 256, 8, 2, "cudnn_fused"),
    ("left_padded_causal (HF prefill)", "top_left", [(0, 256), (56, 256), (159, 256)], 256, 256, 8, 2,
     "cudnn_fused"),
    ("right_padded_keys (BERT)", "keys", [(0, 192), (0, 130)], 192, 192, 8, 8, None),
    ("left_padded_keys", "keys", [(0, 192), (10, 192)], 192, 192, 8, 8, "cudnn_fused"),
    ("decode_left_padded (q_len 1)", "keys", [(0, 320), (77, 320), (300, 320)], 1, 320, 8, 2, "cudnn_fused"),
    ("chunk_left_padded (q_len 4, bottom-right)", "bottom_right", [(0, 320), (64, 320)], 4, 320, 8, 2,
     "cudnn_fused"),
    ("sliding_window (Mistral layer)", "top_left", [(0, 384), (0, 384)], 384, 384, 8, 2, None, 127),
    ("sliding_window_right_padded", "top_left", [(0, 384), (0, 150)], 384, 384, 8, 2, "cudnn_fused", 127),
    ("sliding_window_left_padded", "top_left", [(0, 384), (200, 384)], 384, 384, 8, 2, "cudnn_fused", 127),
]
CASES = [c if len(c) == 9 else c + (None,) for c in CASES]


@pytest.mark.parametrize("name, kind, ranges, sq, skv, h, hkv, family, window", CASES, ids=[c[0] for c in CASES])
def test_recognised_mask_runs_fused_and_matches_the_reference(name, kind, ranges, sq, skv, h, hkv, family, window):
    g = torch.Generator(device="cuda").manual_seed(0)
    b, d = len(ranges), 128
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16().requires_grad_()  # noqa: E731
    q, k, v = rnd(b, h, sq, d), rnd(b, hkv, skv, d), rnd(b, hkv, skv, d)
    dout = torch.randn(b, h, sq, d, device="cuda", generator=g).bfloat16()
    mask = padding_mask(kind, ranges, sq, skv, window)
    decision = explain_sdpa(q, k, v, attn_mask=mask, enable_gqa=hkv != h)
    assert decision.params["attn_mask_type"] != "arbitrary", decision.notes
    if PADDING_ENGINES:
        assert decision.backend != "unfused", decision.summary()
        if family is not None:
            assert decision.backend == family, decision.summary()
    else:  # stock torch: its cuDNN and FA2 ops take no sequence lengths, so the mask runs unfused (still checked)
        assert decision.backend == "unfused", decision.summary()
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hkv != h)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = reference(*leaves, mask=mask)
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hkv != h)
    torch_grads = torch.autograd.grad(torch_out, (q, k, v), dout)
    errors = {"out": rel_err(out, ref), **{f"d{n}": rel_err(a, e) for n, a, e in zip("qkv", grads, ref_grads)}}
    torch_errors = {"out": rel_err(torch_out, ref),
                    **{f"d{n}": rel_err(a, e) for n, a, e in zip("qkv", torch_grads, ref_grads)}}
    assert all(e <= TOL[torch.bfloat16] for e in errors.values()), (decision.chosen, errors, torch_errors)
    empty = ~mask.any(-1)  # rows that see no key: 0, as torch's SDPA
    if empty.any():
        assert out.masked_select(empty[..., None].expand_as(out)).abs().max() == 0


@pytest.mark.parametrize("causal", [False, True])
def test_softcap_runs_on_flash_attn_4_and_matches_the_reference(causal, monkeypatch):
    from attn_dispatch import selection

    pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed (carry both wheel bundles)")

    monkeypatch.setenv("ATTN_DISPATCH_BACKEND", "flash_attn_4")  # this test is about that engine's softcap
    selection.clear_cache()
    g = torch.Generator(device="cuda").manual_seed(1)
    rnd = lambda *s: (3 * torch.randn(*s, device="cuda", generator=g)).bfloat16().requires_grad_()  # noqa: E731
    q, k, v = rnd(2, 8, 512, 128), rnd(2, 4, 512, 128), rnd(2, 4, 512, 128)
    dout = torch.randn(2, 8, 512, 128, device="cuda", generator=g).bfloat16()
    decision = explain_sdpa(q, k, v, is_causal=causal, enable_gqa=True, softcap=5.0)
    assert decision.chosen == "flash_attn_4:cute", decision.summary()
    out = scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, softcap=5.0)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = reference(*leaves, softcap=5.0, causal=causal)
    ref_grads = torch.autograd.grad(ref, leaves, dout.float())
    uncapped = reference(*leaves, causal=causal)
    assert rel_err(uncapped, ref) > 0.05  # the cap bites at these logits
    errors = {"out": rel_err(out, ref), **{f"d{n}": rel_err(a, e) for n, a, e in zip("qkv", grads, ref_grads)}}
    assert all(e <= TOL[torch.bfloat16] for e in errors.values()), (decision.chosen, errors)
