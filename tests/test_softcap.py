"""Logit soft-capping (Gemma 2): the unfused engine against a dense float64 autograd reference, forward and
gradients; every other engine refuses it with a reason."""
from __future__ import annotations

import pytest
import torch

from attn_dispatch import AttentionParams, Platform, explain
from attn_dispatch.module import DotProductAttention


def _reference(q, k, v, scale, cap, bias=None, causal=False):
    """bshd, dense: scores * scale -> cap * tanh(s / cap) -> + bias -> causal mask -> softmax -> @ v."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    s = qh @ kh.transpose(-1, -2) * scale
    s = cap * torch.tanh(s / cap)
    if bias is not None:
        s = s + bias
    if causal:
        sq, skv = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, skv, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ vh).transpose(1, 2)


@pytest.mark.parametrize("causal, with_bias", [(False, False), (True, False), (True, True)])
def test_unfused_softcap_matches_reference(causal, with_bias):
    g = torch.Generator().manual_seed(0)
    b, s, h, hk, d = 2, 7, 4, 2, 8
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64) * 3  # large logits: the cap bites
    k = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64) * 3
    v = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    bias = torch.randn(1, h, s, s, generator=g, dtype=torch.float64) if with_bias else None
    leaves = [x.requires_grad_() for x in (q, k, v)] + ([bias.requires_grad_()] if with_bias else [])
    attn = DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="bshd",
                               attn_mask_type="causal" if causal else "no_mask", softmax_scale=0.3, softcap=2.5)
    kwargs = dict(core_attention_bias_type="post_scale_bias", core_attention_bias=bias) if with_bias else {}
    out = attn(q, k, v, **kwargs).view(b, s, h, d)
    ref = _reference(q, k, v, 0.3, 2.5, bias, causal)
    uncapped = _reference(q, k, v, 0.3, 1e6, bias, causal)
    assert (ref - uncapped).abs().max() > 1e-2  # the cap changes the result
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    grad = torch.randn_like(ref)
    for name, a, e in zip(("q", "k", "v", "bias"), torch.autograd.grad(out, leaves, grad),
                          torch.autograd.grad(ref, leaves, grad)):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-12, msg=lambda m: f"d{name}: {m}")
    assert attn.last_decision.params["softcap"] == 2.5


def test_flash_attn_4_and_flex_take_softcap_and_every_other_fused_engine_refuses_it_with_a_reason():
    params = AttentionParams(dtype="bfloat16", batch_size=2, max_seqlen_q=1024, head_dim_qk=128, softcap=50.0,
                             attn_mask_type="causal")
    decision = explain(params, Platform.parse("h100-cudnn9"))
    assert decision.verdict("flash_attn_4").eligible and decision.verdict("unfused").eligible
    assert decision.verdict("flex_attention").eligible
    # the pick rests on the measured softcap call (bench_masks.py), never on rows without softcap
    assert decision.chosen == "flex_attention:torch" and "softcap_padding" in decision.policy_reason
    for verdict in decision.verdicts:
        if verdict.backend not in ("unfused", "flash_attn_4", "flex_attention"):
            assert verdict.has(f"{verdict.backend}.softcap"), verdict.id
    b200 = Platform.parse("b200-cudnn9")
    assert explain(params, b200).verdict("flash_attn_4").eligible
    hd256 = params.replace(head_dim_qk=256, head_dim_v=256)
    assert explain(hd256, b200).verdict("flash_attn_4").has("flash_attn_4.softcap")  # dedicated hd256 backward
    assert explain(hd256.replace(is_training=False), b200).verdict("flash_attn_4").eligible
    assert explain(hd256, Platform.parse("h100-cudnn9")).verdict("flash_attn_4").eligible
    cached = params.replace(inference_kv_cache=True, is_training=False, attn_mask_type="padding_causal_bottom_right")
    assert explain(cached, Platform.parse("h100-cudnn9")).verdict("flash_attn_4").has("flash_attn_4.softcap")


@pytest.mark.parametrize("value", [-1.0, float("inf"), True, "50"])
def test_bad_softcap_is_refused(value):
    with pytest.raises(ValueError, match="softcap"):
        DotProductAttention(4, 8, softcap=value)
    with pytest.raises(ValueError, match="softcap"):
        AttentionParams(softcap=value)
