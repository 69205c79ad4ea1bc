import pytest

from attn_dispatch.params import AttentionParams


def test_defaults_fill_in_mha_and_equal_dims():
    p = AttentionParams(num_heads=8, head_dim_qk=64, max_seqlen_q=100)
    assert (p.num_gqa_groups, p.head_dim_v, p.max_seqlen_kv) == (8, 64, 100)
    assert p.gqa_ratio == 1


def test_dtype_aliases_and_torch_dtypes():
    import torch

    assert AttentionParams(dtype="bf16").dtype == "bfloat16"
    assert AttentionParams(dtype=torch.float16).dtype == "float16"


def test_hash_and_equality_follow_values():
    a = AttentionParams(max_seqlen_q=512, attn_mask_type="causal")
    b = AttentionParams(max_seqlen_q=512, attn_mask_type="causal")
    c = a.replace(max_seqlen_q=513)
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2


def test_causal_window_is_normalised():
    p = AttentionParams(attn_mask_type="causal", window_size=(128, -1))
    assert p.window_size == (128, 0)
    assert p.has_sliding_window
    assert not AttentionParams(attn_mask_type="causal").has_sliding_window
    assert AttentionParams(attn_mask_type="no_mask", window_size=(-1, 0)).has_sliding_window


@pytest.mark.parametrize("kwargs, words", [
    (dict(qkv_format="bhsd"), ["qkv_format", "'bhsd'", "'bshd'"]),
    (dict(attn_mask_type="causal_top_left"), ["attn_mask_type", "causal_top_left", "'padding_causal'"]),
    (dict(num_heads=12, num_gqa_groups=5), ["num_heads=12", "num_gqa_groups=5"]),
    (dict(head_dim_qk=0), ["head_dim_qk=0", "positive"]),
    (dict(dropout=1.5), ["dropout=1.5", "[0, 1)"]),
    (dict(window_size=(-3, 0)), ["window_size", "-3", "-1"]),
    (dict(attn_mask_type="causal", window_size=(4, 4)), ["window_size", "right=0"]),
    (dict(bias_type="post_scale_bias", bias_shape="hss"), ["bias_shape", "'hss'", "'1hss'"]),
    (dict(dtype="int8"), ["dtype", "int8"]),
    (dict(cp_comm_type="ring"), ["cp_comm_type", "'ring'", "'p2p'"]),
])
def test_bad_values_name_argument_value_and_allowed(kwargs, words):
    with pytest.raises(ValueError) as info:
        AttentionParams(**kwargs)
    for word in words:
        assert word in str(info.value)
