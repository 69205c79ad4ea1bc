"""A user's FlexAttention modifiers through DotProductAttention(mask_mod=..., score_mod=...) and
attn_dispatch.scaled_dot_product_attention(..., mask_mod=..., score_mod=...): run by flex_attention (eager on the CPU,
inference) against a float64 reference; refused, with reasons, wherever no engine can run them."""
from __future__ import annotations

import pytest
import torch

import attn_dispatch as ad
from attn_dispatch import DotProductAttention, NoBackendAvailableError

B, S, H, D = 2, 24, 4, 16


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(3))


def _reference(q, k, v, keep=None, score=None):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    if score is not None:
        s = score(s)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).flatten(-2)


def prefix_lm(b, h, q_idx, kv_idx):  # 8 bidirectional prefix tokens, causal after them
    return (kv_idx <= q_idx) | (kv_idx < 8)


def tanh_cap(score, b, h, q_idx, kv_idx):
    return 5.0 * torch.tanh(score / 5.0)


def test_a_mask_mod_and_a_score_mod_run_in_flex_against_float64():
    q, k, v = _qkv()
    module = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask", mask_mod=prefix_lm,
                                 score_mod=tanh_cap).eval()
    with torch.no_grad():
        out = module(q, k, v)
    i, j = torch.arange(S).view(S, 1), torch.arange(S).view(1, S)
    keep = ((j <= i) | (j < 8)).view(1, 1, S, S)
    torch.testing.assert_close(out, _reference(q, k, v, keep, lambda s: 5.0 * torch.tanh(s / 5.0)))
    assert module.last_decision.chosen == "flex_attention:torch"
    assert module.explain(q, k, v).chosen == "flex_attention:torch"
    assert module.last_decision.params["mask_mod"] and module.last_decision.params["score_mod"]


def test_the_mask_mod_is_anded_with_the_calls_mask():
    q, k, v = _qkv(1)
    module = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="causal",
                                 mask_mod=lambda b, h, qi, ki: qi - ki < 4).eval()
    with torch.no_grad():
        out = module(q, k, v)
    i, j = torch.arange(S).view(S, 1), torch.arange(S).view(1, S)
    torch.testing.assert_close(out, _reference(q, k, v, ((j <= i) & (i - j < 4)).view(1, 1, S, S)))


def test_the_sdpa_function_takes_the_modifiers():
    q, k, v = (x.transpose(1, 2) for x in _qkv(2))
    with torch.no_grad():
        out = ad.scaled_dot_product_attention(q, k, v, mask_mod=prefix_lm)
    i, j = torch.arange(S).view(S, 1), torch.arange(S).view(1, S)
    want = _reference(*(x.transpose(1, 2) for x in (q, k, v)), ((j <= i) | (j < 8)).view(1, 1, S, S))
    torch.testing.assert_close(out.transpose(1, 2).flatten(-2), want)
    assert ad.explain_sdpa(q, k, v, mask_mod=prefix_lm).chosen == "flex_attention:torch"


def test_modifiers_no_engine_runs_are_refused_with_reasons():
    q, k, v = _qkv(3)
    forced = DotProductAttention(H, D, qkv_format="bshd", mask_mod=prefix_lm, backend="unfused").eval()
    with pytest.raises(NoBackendAvailableError, match="mask_mod"), torch.no_grad():
        forced(q, k, v)
    training = DotProductAttention(H, D, qkv_format="bshd", score_mod=tanh_cap)  # flex has no CPU backward
    q.requires_grad_()
    with pytest.raises(NoBackendAvailableError, match="backward on CPU"):
        training(q, k, v)


@pytest.mark.parametrize("name", ["mask_mod", "score_mod"])
def test_a_modifier_that_is_not_a_function_is_refused(name):
    with pytest.raises(ValueError, match=f"{name}=3 must be a function"):
        DotProductAttention(H, D, **{name: 3})


def test_a_users_mask_mods_share_a_compiled_block_mask_builder_only_with_the_same_code():
    """torch.compile's recompile limit is per code object: each user mask_mod's code (and batch/head sizes) gets its
    own compiled copy of the builder; closures of one code over other values share one."""
    from attn_dispatch.backends._flex_masks import compiled_builder

    def window_of(n):
        return lambda b, h, q, kv: (q - kv).abs() < n

    def prefix(b, h, q, kv):
        return kv < 64

    assert compiled_builder(window_of(8), 1, 1) is compiled_builder(window_of(300), 1, 1)
    assert compiled_builder(window_of(8), 1, 1) is not compiled_builder(prefix, 1, 1)
    assert compiled_builder(prefix, 1, 1) is not compiled_builder(prefix, 2, 1)
    assert compiled_builder(prefix, 2, 1) is not compiled_builder(prefix, 2, 8)
