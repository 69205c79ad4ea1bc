"""attn_dispatch.scaled_dot_product_attention against torch's SDPA (float64, CPU): outputs and gradients on
random shapes, bool / float / broadcast masks, fully masked rows, causal, GQA and scale; mask recognition; and
errors that name the argument."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attn_dispatch
from attn_dispatch import explain_sdpa, scaled_dot_product_attention


def tensors(b, h, hkv, sq, skv, d, dv, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    return mk(b, h, sq, d), mk(b, hkv, skv, d), mk(b, hkv, skv, dv), torch.randn(b, h, sq, dv, generator=g,
                                                                                  dtype=torch.float64)


def check(q, k, v, dout, **kw):
    ours = scaled_dot_product_attention(q, k, v, **kw)
    grads = torch.autograd.grad(ours, (q, k, v), dout)
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), hkv=st.sampled_from([1, 2]), groups=st.sampled_from([1, 2]), sq=st.integers(1, 9),
       skv=st.integers(1, 9), d=st.sampled_from([4, 8]), dv=st.sampled_from([4, 6]),
       kind=st.sampled_from(["none", "causal", "bool", "bool_broadcast", "float", "float_2d"]),
       scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 10_000))
def test_matches_torch_sdpa(b, hkv, groups, sq, skv, d, dv, kind, scale, seed):
    h = hkv * groups
    q, k, v, dout = tensors(b, h, hkv, sq, skv, d, dv, seed)
    g = torch.Generator().manual_seed(seed + 1)
    kw = dict(scale=scale, enable_gqa=groups > 1)
    if kind == "causal":
        kw["is_causal"] = True
    elif kind == "bool":
        kw["attn_mask"] = torch.rand(b, h, sq, skv, generator=g) > 0.3
    elif kind == "bool_broadcast":
        kw["attn_mask"] = torch.rand(b, 1, 1, skv, generator=g) > 0.3
    elif kind == "float":
        kw["attn_mask"] = torch.randn(1, h, sq, skv, generator=g, dtype=torch.float64)
    elif kind == "float_2d":
        kw["attn_mask"] = torch.randn(sq, skv, generator=g, dtype=torch.float64)
    check(q, k, v, dout, **kw)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float64])
def test_fully_masked_rows_match_torch(dtype):
    q, k, v, dout = tensors(2, 2, 2, 5, 6, 8, 8, seed=3)
    keep = torch.rand(2, 2, 5, 6, generator=torch.Generator().manual_seed(4)) > 0.4
    keep[0, 1, 2] = False  # a row that sees no key
    keep[1, :, 4] = False
    mask = keep if dtype == torch.bool else torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))
    check(q, k, v, dout, attn_mask=mask)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all() and out[0, 1, 2].abs().max() == 0


def test_masks_that_encode_a_causal_pattern_run_as_that_mask_type():
    q, k, v, dout = tensors(2, 4, 2, 6, 9, 8, 8, seed=5)
    tl = torch.ones(6, 9, dtype=torch.bool).tril()
    br = torch.ones(6, 9, dtype=torch.bool).tril(3)
    assert explain_sdpa(q, k, v, attn_mask=tl, enable_gqa=True).params["attn_mask_type"] == "causal"
    assert explain_sdpa(q, k, v, attn_mask=br, enable_gqa=True).params["attn_mask_type"] == "causal_bottom_right"
    check(q, k, v, dout, attn_mask=tl, enable_gqa=True)
    check(q, k, v, dout, attn_mask=br, enable_gqa=True)
    other = tl.clone()
    other[3, 0] = False
    d = explain_sdpa(q, k, v, attn_mask=other, enable_gqa=True)
    assert d.params["attn_mask_type"] == "arbitrary"
    assert explain_sdpa(q, k, v, attn_mask=tl, enable_gqa=True, recognize_masks=False).params["attn_mask_type"] \
        == "arbitrary"
    tl[3, 0] = False  # modified in place: looked at again, not the cached verdict
    assert explain_sdpa(q, k, v, attn_mask=tl, enable_gqa=True).params["attn_mask_type"] == "arbitrary"
    f = explain_sdpa(q, k, v, attn_mask=torch.zeros(6, 9, dtype=torch.float64), enable_gqa=True)
    assert f.params["bias_type"] == "post_scale_bias" and f.params["bias_shape"] == "11ss"


def test_dropout_is_applied_and_the_decision_says_so():
    q, k, v, _ = tensors(1, 2, 2, 16, 16, 8, 8, seed=6)
    torch.manual_seed(0)
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert not torch.allclose(out, F.scaled_dot_product_attention(q, k, v))
    assert explain_sdpa(q, k, v, dropout_p=0.5).params["dropout"] == 0.5


@pytest.mark.parametrize("kwargs, message", [
    (dict(attn_mask=torch.ones(3, 3, dtype=torch.bool), is_causal=True), "attn_mask and is_causal"),
    (dict(dropout_p=1.0), "dropout_p=1.0"),
    (dict(attn_mask=torch.ones(2, 7, dtype=torch.bool)), r"attn_mask has shape \[2, 7\]"),
    (dict(attn_mask=torch.ones(3, 3, dtype=torch.int32)), "attn_mask has dtype torch.int32"),
])
def test_bad_input_names_the_argument(kwargs, message):
    q, k, v, _ = tensors(1, 2, 2, 3, 3, 4, 4, seed=7)
    with pytest.raises(ValueError, match=message):
        scaled_dot_product_attention(q, k, v, **kwargs)


def test_gqa_needs_enable_gqa_and_3d_inputs_are_refused():
    q, k, v, _ = tensors(1, 4, 2, 3, 3, 4, 4, seed=8)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="query is \\[4, 3, 4\\]"):
        scaled_dot_product_attention(q[0], k[0], v[0])


def test_it_is_exported_lazily():
    assert attn_dispatch.scaled_dot_product_attention is scaled_dot_product_attention


def test_a_packed_causal_row_runs_as_thd_and_matches_torch():
    lens = [5, 1, 7, 3]
    t = sum(lens)
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    rows = torch.arange(t)
    mask = (seg[:, None] == seg[None, :]) & (rows[None, :] <= rows[:, None])
    q, k, v, dout = tensors(1, 4, 2, t, t, 8, 8, seed=9)
    d = explain_sdpa(q, k, v, attn_mask=mask[None, None], enable_gqa=True)
    assert d.params["qkv_format"] == "thd" and d.params["attn_mask_type"] == "padding_causal"
    check(q, k, v, dout, attn_mask=mask[None, None], enable_gqa=True)
    broken = mask.clone()
    broken[8, 5] = True  # a key from the previous segment: not a packed pattern any more
    assert explain_sdpa(q, k, v, attn_mask=broken, enable_gqa=True).params["attn_mask_type"] == "arbitrary"
    check(q, k, v, dout, attn_mask=broken, enable_gqa=True)


def test_repeat_calls_take_the_cached_path_and_stay_exact(monkeypatch):
    """A causal / no-mask call seen before skips planning (the module's cached path, heads unmerged), and still
    equals torch's SDPA: outputs and gradients, in training and under no_grad."""
    from attn_dispatch import module as module_mod
    from attn_dispatch.sdpa import _MODULES

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # plans
    calls = []
    real = module_mod.DotProductAttention._prepare
    monkeypatch.setattr(module_mod.DotProductAttention, "_prepare",
                        lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)
    assert calls == [] and any(m._plans.fast for m in _MODULES.values())
    with torch.no_grad():
        scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # another signature: plans once
        torch.testing.assert_close(scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), ref)
    assert len(calls) == 1


def test_an_arbitrary_bool_mask_is_inverted_once_per_tensor_and_version():
    """Every layer of a model gets the same mask tensor: the engines must get one inverted tensor too (their own
    caches, a BlockMask or a bias, key on it); an in-place change of the mask is seen."""
    from attn_dispatch.sdpa import _mask_kwargs

    g = torch.Generator().manual_seed(7)
    mask = torch.rand(2, 1, 6, 6, generator=g) > 0.5
    mask[..., 0] = True
    first = _mask_kwargs(mask, 2, 4, 6, 6, mask.device, True)["attention_mask"]
    assert _mask_kwargs(mask, 2, 4, 6, 6, mask.device, True)["attention_mask"] is first
    torch.testing.assert_close(first, ~mask)
    mask[0, 0, 3, 2] = ~mask[0, 0, 3, 2]
    changed = _mask_kwargs(mask, 2, 4, 6, 6, mask.device, True)["attention_mask"]
    assert changed is not first and torch.equal(changed, ~mask)


def test_inside_fp8_autocast_the_sdpa_function_keeps_its_dtype_and_explain_agrees():
    """fp8_autocast is the module's FP8 (Transformer Engine's fp8_dpa); the SDPA function keeps torch SDPA's
    semantics there, and explain_sdpa says what it runs."""
    from attn_dispatch.fp8 import DelayedScaling, fp8_autocast

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 10, 8, generator=g, dtype=torch.float64) for _ in range(3))
    outside = attn_dispatch.scaled_dot_product_attention(q, k, v, is_causal=True)
    with fp8_autocast(recipe=DelayedScaling(fp8_dpa=True)):
        inside = attn_dispatch.scaled_dot_product_attention(q, k, v, is_causal=True)
        decision = attn_dispatch.explain_sdpa(q, k, v, is_causal=True)
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)
    assert decision.chosen is not None and not decision.params["fp8"]


def test_values_remembered_for_a_tensor_answer_without_a_read_and_go_stale_on_a_write(monkeypatch):
    """tensor_cache.remember_values lets same_values compare host copies (no device read); an in-place write or a
    different tensor object is not answered from them."""
    from attn_dispatch import tensor_cache

    a = torch.tensor([0, 3, 7], dtype=torch.int32)
    b = torch.tensor([0, 3, 7], dtype=torch.int32)
    c = torch.tensor([0, 3, 8], dtype=torch.int32)
    for t in (a, b, c):
        tensor_cache.remember_values(t, t.tolist())
    assert tensor_cache.known_values(a) == [0, 3, 7]
    assert tensor_cache.known_values(torch.tensor([0, 3, 7], dtype=torch.int32)) is None
    reads = []
    monkeypatch.setattr(torch, "equal", lambda x, y: reads.append(1) or torch.Tensor.equal(x, y))
    assert tensor_cache.same_values(a, b) and not tensor_cache.same_values(a, c)
    assert reads == []
    b[2] = 9  # in place: the recorded values no longer hold, and the comparison reads the device
    assert tensor_cache.known_values(b) is None
    assert not tensor_cache.same_values(a, b) and reads == [1]
