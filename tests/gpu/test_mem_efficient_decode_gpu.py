"""mem_efficient:torch's one-query GQA calls (decode steps: the query heads of a group folded into query rows of their
key/value head, the keys and values passed as they are) on the GPU's own kernel, bf16, against a float32 reference
on fresh random inputs: a left-padded cache's mask with a row that sees no key, with and without gradients (the
inference path clears rows in the pass that restores head order), and a float mask added per call."""
from __future__ import annotations

import math

import pytest
import torch

from attn_dispatch.backends import get_engine
from attn_dispatch.backends.base import AttnAux, AttnConfig
from attn_dispatch.params import normalize_window

from gpu_common import rel_err

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

TOL = 2e-2
DEV = "cuda"


def _reference(q4, k4, v4, keep, bias, scale):
    rep = q4.shape[1] // k4.shape[1]
    k4, v4 = k4.repeat_interleave(rep, 1), v4.repeat_interleave(rep, 1)
    s = q4 @ k4.transpose(-1, -2) * scale + (0 if bias is None else bias)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1).nan_to_num(neginf=0.0)).masked_fill(~keep, 0.0)
    return p @ v4, lse


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("h, hk, skv", [(16, 8, 517), (32, 8, 1030), (8, 1, 77)])
def test_one_query_gqa_on_the_gpu_kernel(grad, h, hk, skv):
    b, d = 8, 128
    gen = torch.Generator(device=DEV).manual_seed(h * 1000 + skv)
    q, k, v = (torch.randn(b, n, heads, d, generator=gen, device=DEV, dtype=torch.bfloat16).requires_grad_(grad)
               for n, heads in ((1, h), (skv, hk), (skv, hk)))
    keep = torch.ones(b, 1, 1, skv, dtype=torch.bool, device=DEV)
    for row in range(b):
        keep[row, ..., : row * skv // (2 * b)] = False
    keep[3] = False  # a row that sees no key: 0 (and lse -inf)
    bias = torch.randn(1, h, 1, skv, generator=gen, device=DEV, dtype=torch.bfloat16) if grad else None
    cfg = AttnConfig(attn_mask_type="arbitrary", window_size=normalize_window(None, "arbitrary"),
                     softmax_scale=1 / math.sqrt(d), bias_type="post_scale_bias" if grad else "no_bias")
    engine = get_engine("mem_efficient:torch")
    with torch.set_grad_enabled(grad):
        out, lse, _ = engine(q, k, v, AttnAux(attention_mask=~keep, bias=bias), cfg)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = _reference(*(x.transpose(1, 2) for x in leaves), keep,
                                  None if bias is None else bias.float(), cfg.softmax_scale)
    ref_out = ref_out.transpose(1, 2)
    assert out.shape == ref_out.shape and rel_err(out, ref_out) < TOL, rel_err(out, ref_out)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    if not grad:
        assert lse is None
        return
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max() < 5e-2
    dout = torch.randn(out.shape, generator=gen, device=DEV, dtype=out.dtype)
    for name, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout),
                          torch.autograd.grad(ref_out, leaves, dout.float())):
        assert rel_err(g, w) < TOL, (name, rel_err(g, w))


@pytest.mark.parametrize("h, hk", [(16, 8), (8, 8)])
def test_masked_binding_on_the_gpu_kernel(h, hk):
    """bind_masked's call (the SDPA function's [b, h, s, d] tensors, the mask an argument: a decode step's bound call)
    over the masks of several steps, new tensors of growing length and changing padding, one with a row that sees no
    key (its bias row left -inf, the kernel's output for it replaced by 0), against the float32 reference."""
    b, d = 8, 128
    engine = get_engine("mem_efficient:torch")
    cfg = AttnConfig(attn_mask_type="arbitrary", window_size=normalize_window(None, "arbitrary"),
                     softmax_scale=1 / math.sqrt(d))
    gen = torch.Generator(device=DEV).manual_seed(h * 100 + hk)
    call = None
    for step, skv in enumerate((517, 518, 530, 531)):
        q = torch.randn(b, h, 1, d, generator=gen, device=DEV, dtype=torch.bfloat16)
        k, v = (torch.randn(b, hk, skv, d, generator=gen, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        keep = torch.ones(b, 1, 1, skv, dtype=torch.bool, device=DEV)
        for row in range(b):
            keep[row, ..., : (row + step) * skv // (3 * b)] = False
        if step == 1:
            keep[3] = False
        if call is None:
            call = engine.bind_masked(q, k, v, AttnAux(attention_mask=~keep, max_seqlen_q=1, max_seqlen_kv=skv), cfg)
            assert call is not None
        out = call(q, k, v, ~keep)
        ref_out, _ = _reference(q.float(), k.float(), v.float(), keep, None, cfg.softmax_scale)
        assert out.shape == ref_out.shape and rel_err(out, ref_out) < TOL, (step, rel_err(out, ref_out))
        if step == 1:
            assert torch.equal(out[3], torch.zeros_like(out[3]))
