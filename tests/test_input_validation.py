"""Bad input to DotProductAttention: a ValueError that names the argument, the value and what is allowed."""
from __future__ import annotations

import pytest
import torch

from attn_dispatch import DotProductAttention


def cu(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


def dense(b=2, sq=6, skv=6, h=4, hk=2, d=8, dv=8, fmt="bshd", dtype=torch.float32):
    def make(s, heads, dim):
        return torch.randn((b, s, heads, dim) if fmt == "bshd" else (s, b, heads, dim), dtype=dtype)
    return make(sq, h, d), make(skv, hk, d), make(skv, hk, dv)


def packed(t=12, h=4, hk=2, d=8):
    return torch.randn(t, h, d), torch.randn(t, hk, d), torch.randn(t, hk, d)


def dpa(**kwargs):
    return DotProductAttention(4, 8, num_gqa_groups=2, **{"qkv_format": "bshd", **kwargs})


def thd_call(**kwargs):
    base = dict(cu_seqlens_q=cu([0, 3, 7, 12]), cu_seqlens_kv=cu([0, 3, 7, 12]))
    return dpa(qkv_format="thd", attn_mask_type="padding")(*packed(), **{**base, **kwargs})


def padding_mask(lens, s=6):
    return torch.arange(s).view(1, 1, 1, s) >= torch.tensor(lens).view(-1, 1, 1, 1)


# (id, callable, regex the message must match)
CALL_ERRORS = [
    ("dtype_mismatch", lambda: dpa()(*(lambda q, k, v: (q, k.double(), v))(*dense())),
     r"key_layer has dtype torch.float64 but query_layer has torch.float32"),
    ("device_mismatch", lambda: dpa()(*(lambda q, k, v: (q, k.to("meta"), v))(*dense())),
     r"key_layer is on meta but query_layer is on cpu"),
    ("int_dtype", lambda: dpa()(*(x.long() for x in dense())),
     r"query_layer has dtype torch.int64; expected one of float16, bfloat16, float32, float64"),
    ("kv_shape_mismatch", lambda: dpa()(*dense()[:2], torch.randn(2, 5, 2, 8)),
     r"key_layer \[2, 6, 2, 8\] and value_layer \[2, 5, 2, 8\] must agree"),
    ("batch_mismatch", lambda: dpa(attn_mask_type="no_mask")(dense()[0], *dense(b=3)[1:]),
     r"different batch sizes \(2 vs 3\)"),
    ("rank", lambda: dpa()(torch.randn(2, 6, 32), *dense()[1:]),
     r"query_layer is \[2, 6, 32\]; qkv_format='bshd' needs a 4-D tensor"),
    ("q_heads", lambda: dpa()(*dense(h=6)), r"query_layer has 6 heads; .*num_attention_heads / tp_size = 4"),
    ("kv_heads", lambda: dpa()(*dense(hk=4)), r"key_layer/value_layer have 4 heads; .*num_gqa_groups / tp_size = 2"),
    ("head_dim", lambda: dpa()(*dense(dv=4)), r"head dims \(qk=8, v=4\) do not match kv_channels \(qk=8, v=8\)"),
    ("qkv_format", lambda: dpa()(*dense(), qkv_format="bhsd"), r"qkv_format='bhsd' is not supported; expected one of"),
    ("mask_type", lambda: dpa()(*dense(), attn_mask_type="weird"), r"attn_mask_type='weird' is not supported"),
    ("window_left", lambda: dpa()(*dense(), window_size=(-2, 0)),
     r"window_size=\(-2, 0\): left=-2 must be >= 0, or -1"),
    ("window_causal_right", lambda: dpa()(*dense(), window_size=(2, 3)),
     r"window_size=\(2, 3\) with attn_mask_type='causal': a causal mask needs right=0 or -1"),
    ("window_not_pair", lambda: dpa()(*dense(), window_size=(4,)), r"window_size=\(4,\) must be a pair"),
    ("window_type", lambda: dpa()(*dense(), window_size=4), r"window_size=4 must be None or a pair"),
    # cu_seqlens
    ("cu_dtype", lambda: thd_call(cu_seqlens_q=cu([0, 3, 7, 12], torch.int64)),
     r"cu_seqlens_q has dtype torch.int64; it must be torch.int32"),
    ("cu_not_monotonic", lambda: thd_call(cu_seqlens_q=cu([0, 7, 3, 12])),
     r"cu_seqlens_q=\[0, 7, 3, 12\] must be non-decreasing .* index 2 \(7 -> 3\)"),
    ("cu_not_zero", lambda: thd_call(cu_seqlens_q=cu([1, 3, 7, 12])), r"cu_seqlens_q=\[1, 3, 7, 12\] must start at 0"),
    ("cu_beyond_tensor", lambda: thd_call(cu_seqlens_kv=cu([0, 3, 7, 20])),
     r"cu_seqlens_kv=\[0, 3, 7, 20\] ends at 20 but key_layer has only t=12 tokens"),
    ("cu_batch_mismatch", lambda: thd_call(cu_seqlens_kv=cu([0, 12])),
     r"cu_seqlens_kv has 2 entries but the batch has 3 sequences; it needs batch_size \+ 1 = 4"),
    ("cu_2d", lambda: thd_call(cu_seqlens_q=cu([[0, 3], [7, 12]])), r"cu_seqlens_q has shape \[2, 2\]; it must be 1-D"),
    ("cu_not_tensor", lambda: thd_call(cu_seqlens_q=[0, 3, 7, 12]), r"cu_seqlens_q must be a torch.int32 tensor"),
    ("cu_padded_too_small", lambda: thd_call(cu_seqlens_q_padded=cu([0, 2, 6, 12]),
                                             cu_seqlens_kv_padded=cu([0, 3, 7, 12])),
     r"sequence 0 has 3 tokens \(cu_seqlens_q\) but only 2 slots in cu_seqlens_q_padded"),
    ("cu_padded_alone", lambda: thd_call(cu_seqlens_q_padded=cu([0, 3, 7, 12])),
     r"cu_seqlens_q_padded and cu_seqlens_kv_padded must be given together"),
    ("max_seqlen_small", lambda: thd_call(max_seqlen_q=4),
     r"max_seqlen_q=4 is smaller than the longest sequence \(5 tokens, from cu_seqlens_q\)"),
    ("max_seqlen_type", lambda: thd_call(max_seqlen_kv=5.0), r"max_seqlen_kv=5.0 must be a positive int"),
    ("thd_missing_cu", lambda: dpa(qkv_format="thd", attn_mask_type="padding")(*packed()),
     r"qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv"),
    ("thd_needs_padding_mask", lambda: thd_call(attn_mask_type="causal"),
     r"attn_mask_type='causal' with qkv_format='thd': packed sequences need a padding mask type"),
    ("dense_cu_too_long", lambda: dpa(attn_mask_type="padding")(*dense(), cu_seqlens_q=cu([0, 6, 15]),
                                                                 cu_seqlens_kv=cu([0, 6, 12])),
     r"cu_seqlens_q=\[0, 6, 15\] gives sequence 1 9 tokens but the tensor holds only 6"),
    ("dense_max_seqlen", lambda: dpa()(*dense(), max_seqlen_q=9),
     r"max_seqlen_q=9 but the bshd tensor's sequence dimension is 6"),
    ("cu_without_padding_type", lambda: dpa()(*dense(), cu_seqlens_q=cu([0, 6, 12]), cu_seqlens_kv=cu([0, 6, 12])),
     r"cu_seqlens_q is given with attn_mask_type='causal', which has no padding"),
    ("dense_padded_offsets", lambda: dpa(attn_mask_type="padding")(*dense(), cu_seqlens_q=cu([0, 6, 12]),
                                                                    cu_seqlens_kv=cu([0, 6, 12]),
                                                                    cu_seqlens_q_padded=cu([0, 6, 12])),
     r"cu_seqlens_q_padded is given with qkv_format='bshd'; padded offsets only apply to 'thd'"),
    ("padding_without_lengths", lambda: dpa(attn_mask_type="padding")(*dense()),
     r"attn_mask_type='padding' with qkv_format='bshd' needs the sequence lengths"),
    # masks
    ("mask_with_causal", lambda: dpa()(*dense(), attention_mask=torch.zeros(2, 1, 6, 6, dtype=torch.bool)),
     r"attention_mask is given with attn_mask_type='causal', which takes none"),
    ("arbitrary_missing", lambda: dpa(attn_mask_type="arbitrary")(*dense()),
     r"attn_mask_type='arbitrary' needs attention_mask, a bool tensor \[1 or 2, 1 or 4, 6, 6\]"),
    ("arbitrary_dtype", lambda: dpa(attn_mask_type="arbitrary")(*dense(), attention_mask=torch.zeros(2, 1, 6, 6)),
     r"attention_mask has dtype torch.float32; it must be torch.bool"),
    ("arbitrary_shape", lambda: dpa(attn_mask_type="arbitrary")(*dense(), attention_mask=torch.zeros(
        2, 3, 6, 6, dtype=torch.bool)),
     r"attention_mask has shape \[2, 3, 6, 6\]; 'arbitrary' needs \[1 or 2, 1 or 4, 6, 6\]"),
    ("padding_mask_shape", lambda: dpa(attn_mask_type="padding")(*dense(), attention_mask=torch.zeros(
        2, 1, 6, 6, dtype=torch.bool)),
     r"attention_mask has shape \[2, 1, 6, 6\]; "
     r"a padding mask must be \[batch_size, 1, 1, seqlen\] = \[2, 1, 1, 6\]"),
    ("padding_mask_dtype", lambda: dpa(attn_mask_type="padding")(*dense(), attention_mask=torch.zeros(2, 1, 1, 6)),
     r"attention_mask has dtype torch.float32; padding masks must be torch.bool"),
    ("padding_mask_left_padded", lambda: dpa(attn_mask_type="padding")(*dense(), attention_mask=padding_mask(
        [6, 4]).flip(-1)), r"padding must come after the real tokens .* sequences \[1\]"),
    ("padding_mask_cross_single", lambda: dpa(attn_mask_type="padding")(*dense(skv=7), attention_mask=padding_mask(
        [6, 4])), r"attention_mask is a single tensor but sq=6 != skv=7"),
    ("padding_mask_and_cu", lambda: dpa(attn_mask_type="padding")(*dense(), attention_mask=padding_mask([6, 4]),
                                                                   cu_seqlens_q=cu([0, 6, 10]),
                                                                   cu_seqlens_kv=cu([0, 6, 10])),
     r"give either attention_mask or cu_seqlens_q/cu_seqlens_kv"),
    ("thd_mask", lambda: thd_call(attention_mask=torch.zeros(3, 1, 1, 5, dtype=torch.bool)),
     r"attention_mask is given with qkv_format='thd'"),
    # bias
    ("bias_type", lambda: dpa()(*dense(), core_attention_bias_type="scaled"),
     r"core_attention_bias_type='scaled' is not supported; expected one of"),
    ("bias_missing", lambda: dpa()(*dense(), core_attention_bias_type="post_scale_bias"),
     r"core_attention_bias_type='post_scale_bias' needs core_attention_bias"),
    ("bias_shape", lambda: dpa()(*dense(), core_attention_bias_type="post_scale_bias",
                                 core_attention_bias=torch.randn(2, 3, 6, 6)),
     r"core_attention_bias has shape \[2, 3, 6, 6\]; expected \[1 or 2, 1 or 4, 6, 6\]"),
    ("bias_seq_dims", lambda: dpa()(*dense(), core_attention_bias_type="pre_scale_bias",
                                    core_attention_bias=torch.randn(1, 4, 6, 5)),
     r"core_attention_bias has shape \[1, 4, 6, 5\]"),
    ("bias_without_type", lambda: dpa()(*dense(), core_attention_bias=torch.randn(1, 4, 6, 6)),
     r"core_attention_bias is given with core_attention_bias_type='no_bias'"),
    ("alibi_shape", lambda: dpa()(*dense(), core_attention_bias_type="alibi", alibi_slopes=torch.rand(3)),
     r"alibi_slopes has shape \[3\]; expected \[4\] or \[2, 4\]"),
    ("alibi_without_type", lambda: dpa()(*dense(), alibi_slopes=torch.rand(4)),
     r"alibi_slopes is given with core_attention_bias_type='no_bias'; it needs 'alibi'"),
    ("pad_between_dense", lambda: dpa()(*dense(), pad_between_seqs=True),
     r"pad_between_seqs=True with qkv_format='bshd': it only applies to 'thd'"),
]


@pytest.mark.parametrize("call,pattern", [c[1:] for c in CALL_ERRORS], ids=[c[0] for c in CALL_ERRORS])
def test_forward_rejects(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


CONSTRUCTOR_ERRORS = [
    ("gqa_divisible", dict(num_attention_heads=6, kv_channels=8, num_gqa_groups=4),
     r"num_attention_heads=6 is not divisible by num_gqa_groups=4"),
    ("heads", dict(num_attention_heads=0, kv_channels=8), r"num_attention_heads=0 must be a positive int"),
    ("kv_channels", dict(num_attention_heads=4, kv_channels=(8,)), r"kv_channels=\(8,\) must be an int or a pair"),
    ("dropout", dict(num_attention_heads=4, kv_channels=8, attention_dropout=1.5),
     r"attention_dropout=1.5 must be a float in \[0, 1\)"),
    ("qkv_format", dict(num_attention_heads=4, kv_channels=8, qkv_format="bhsd"),
     r"qkv_format='bhsd' is not supported"),
    ("mask_type", dict(num_attention_heads=4, kv_channels=8, attn_mask_type="diagonal"),
     r"attn_mask_type='diagonal' is not supported"),
    ("window", dict(num_attention_heads=4, kv_channels=8, window_size=(3, 2)),
     r"window_size=\(3, 2\) with attn_mask_type='causal'"),
    ("attention_type", dict(num_attention_heads=4, kv_channels=8, attention_type="mutual"),
     r"attention_type='mutual' is not supported; expected one of 'self', 'cross'"),
    ("cp_comm_type", dict(num_attention_heads=4, kv_channels=8, cp_comm_type="ring"),
     r"cp_comm_type='ring' is not supported"),
    ("softmax_type", dict(num_attention_heads=4, kv_channels=8, softmax_type="sparsemax"),
     r"softmax_type='sparsemax' is not supported"),
    ("tp_size", dict(num_attention_heads=4, kv_channels=8, num_gqa_groups=2, tp_size=4),
     r"tp_size=4 must divide num_attention_heads=4 and num_gqa_groups=2"),
]


@pytest.mark.parametrize("kwargs,pattern", [c[1:] for c in CONSTRUCTOR_ERRORS], ids=[c[0] for c in CONSTRUCTOR_ERRORS])
def test_constructor_rejects(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        DotProductAttention(**kwargs)


def test_te_mask_type_spellings_are_accepted():
    assert DotProductAttention(4, 8, attn_mask_type="padding,causal").attn_mask_type == "padding_causal"
    assert DotProductAttention(4, 8, attn_mask_type="causal_padding").attn_mask_type == "padding_causal"


def test_contents_are_rechecked_when_a_tensor_changes_in_place():
    """Content checks are cached on the tensor, but an in-place edit (version bump) re-validates it."""
    cu_q = cu([0, 3, 7, 12])
    module = dpa(qkv_format="thd", attn_mask_type="padding")
    q, k, v = packed()
    module(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu([0, 3, 7, 12]))
    cu_q[2] = 1
    with pytest.raises(ValueError, match="non-decreasing"):
        module(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu([0, 3, 7, 12]))
