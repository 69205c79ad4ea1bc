import pytest
import torch

from attn_dispatch.params import AttentionParams


def test_defaults_fill_in_mha_and_equal_dims():
    p = AttentionParams(num_heads=8, head_dim_qk=64, max_seqlen_q=100)
    assert (p.num_gqa_groups, p.head_dim_v, p.max_seqlen_kv) == (8, 64, 100)
    assert p.gqa_ratio == 1


def test_dtype_aliases_and_torch_dtypes():
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


@pytest.mark.parametrize("mask, sq, skv, window, plain", [
    ("causal", 8, 8, (7, 0), (-1, 0)),
    ("causal", 8, 8, (6, 0), (6, 0)),
    ("causal_bottom_right", 4, 9, (8, 0), (-1, 0)),
    ("causal_bottom_right", 4, 9, (7, 0), (7, 0)),
    ("no_mask", 6, 3, (100, 2), (-1, 2)),
    ("no_mask", 6, 3, (2, 5), (2, -1)),
    ("padding", 5, 5, (4, 4), (-1, -1)),
])
def test_a_window_side_that_masks_nothing_is_dropped(mask, sq, skv, window, plain):
    p = AttentionParams(attn_mask_type=mask, max_seqlen_q=sq, max_seqlen_kv=skv, window_size=window)
    assert p.without_idle_window().window_size == plain
    assert (p.without_idle_window() is p) == (plain == p.window_size)


def test_an_idle_window_is_kept_under_context_parallelism_and_with_a_kv_cache():
    cp = AttentionParams(attn_mask_type="causal", max_seqlen_q=8, window_size=(64, 0), cp_size=2)
    kv = AttentionParams(attn_mask_type="causal", max_seqlen_q=8, window_size=(64, 0), inference_kv_cache=True,
                         is_training=False, qkv_format="thd")
    assert cp.without_idle_window() is cp and kv.without_idle_window() is kv


@pytest.mark.parametrize("mask", ["no_mask", "causal", "causal_bottom_right"])
@pytest.mark.parametrize("sq, skv", [(5, 5), (3, 7), (7, 3)])
def test_dropping_an_idle_window_leaves_the_attention_unchanged(mask, sq, skv):
    """At the threshold, in float64 against the reference: exact for both diagonal alignments."""
    from reference import reference_attention
    g = torch.Generator().manual_seed(sq * 10 + skv)
    q, k, v = (torch.randn(2, s, 3, 4, generator=g, dtype=torch.float64) for s in (sq, skv, skv))
    reach = max(sq, skv) - 1
    right = 0 if "causal" in mask else reach
    for window in ((reach, right), (reach + 5, right), (1, right)):
        p = AttentionParams(attn_mask_type=mask, max_seqlen_q=sq, max_seqlen_kv=skv, window_size=window)
        plain = p.without_idle_window()
        assert plain is not p or window[0] < reach
        if plain is p:
            continue
        want, _ = reference_attention(q, k, v, attn_mask_type=mask, window_size=p.window_size)
        got, _ = reference_attention(q, k, v, attn_mask_type=mask, window_size=plain.window_size)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
