"""A bool mask of causal documents given as 'arbitrary' runs as the thd call it is: the same output and gradients as
the mask read as given (float64 reference), explain says so, and anything else stays 'arbitrary'."""
from __future__ import annotations

import pytest
import torch

from attn_dispatch import DotProductAttention


def _documents_mask(batch: int, s: int, cuts: list[list[int]]) -> torch.Tensor:
    """[b, 1, s, s], True masks a pair out: causal within documents starting at the cuts of each batch element."""
    doc = torch.zeros(batch, s, dtype=torch.long)
    for b, starts in enumerate(cuts):
        for c in starts:
            doc[b, c:] += 1
    i = torch.arange(s)
    keep = (doc[:, :, None] == doc[:, None, :]) & (i[None, None, :] <= i[None, :, None])
    return (~keep)[:, None]


def _reference(q, k, v, mask, fmt):
    qb, kb, vb = ((t if fmt == "bshd" else t.transpose(0, 1)) for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", qb, kb) / q.shape[-1] ** 0.5
    out = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(mask, float("-inf")).softmax(-1), vb).flatten(-2)
    return out if fmt == "bshd" else out.transpose(0, 1)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("per_batch", [True, False])
def test_documents_run_as_thd_with_the_mask_s_results(fmt, per_batch):
    b, s, h, d = 2, 48, 2, 8
    mask = _documents_mask(b, s, [[7, 30], [20]]) if per_batch else _documents_mask(1, s, [[5, 17, 33]])
    shape = (b, s, h, d) if fmt == "bshd" else (s, b, h, d)
    q, k, v = (torch.randn(*shape, dtype=torch.float64, requires_grad=True) for _ in range(3))
    module = DotProductAttention(h, d, qkv_format=fmt, attn_mask_type="arbitrary")
    decision = module.explain(q, k, v, attention_mask=mask)
    assert decision.params["qkv_format"] == "thd" and decision.params["attn_mask_type"] == "padding_causal"
    assert any("consecutive documents" in n for n in decision.notes)
    out = module(q, k, v, attention_mask=mask)
    want = _reference(q, k, v, mask, fmt)
    torch.testing.assert_close(out, want)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    expected = torch.autograd.grad(want, (q, k, v), dout)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_other_masks_stay_arbitrary_and_an_edited_mask_is_read_again():
    b, s, h, d = 1, 32, 2, 8
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float64) for _ in range(3))
    module = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="arbitrary")
    prefix = _documents_mask(1, s, [[]])
    prefix[..., :8, :8] = False  # a bidirectional prefix: not causal documents
    prefix[..., 20, 3] = True  # and a hole: no prefix-LM mask either (those run as two calls: test_prefix_masks)
    decision = module.explain(q, k, v, attention_mask=prefix)
    assert decision.params["attn_mask_type"] == "arbitrary"
    assert not any("consecutive documents" in n for n in decision.notes)
    torch.testing.assert_close(module(q, k, v, attention_mask=prefix), _reference(q, k, v, prefix, "bshd"))
    mask = _documents_mask(1, s, [[10]])
    assert module.explain(q, k, v, attention_mask=mask).params["qkv_format"] == "thd"
    mask[0, 0, 20, 3] = False  # row 20 now also sees a key of the first document
    assert module.explain(q, k, v, attention_mask=mask).params["attn_mask_type"] == "arbitrary"
    torch.testing.assert_close(module(q, k, v, attention_mask=mask), _reference(q, k, v, mask, "bshd"))


def test_a_window_or_a_bias_keeps_the_mask_as_given():
    s, h, d = 32, 2, 8
    q, k, v = (torch.randn(1, s, h, d, dtype=torch.float64) for _ in range(3))
    mask = _documents_mask(1, s, [[12]])
    bias = torch.randn(1, h, s, s, dtype=torch.float64)
    module = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="arbitrary")
    with_bias = module.explain(q, k, v, attention_mask=mask, core_attention_bias_type="post_scale_bias",
                               core_attention_bias=bias)
    assert with_bias.params["attn_mask_type"] == "arbitrary"
    windowed = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="arbitrary", window_size=(4, 0))
    assert windowed.explain(q, k, v, attention_mask=mask).params["attn_mask_type"] == "arbitrary"


def test_a_forced_backend_runs_the_mask_as_given():
    s, h, d = 32, 2, 8
    q, k, v = (torch.randn(1, s, h, d, dtype=torch.float64) for _ in range(3))
    mask = _documents_mask(1, s, [[12]])
    forced = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="arbitrary", backend="unfused")
    decision = forced.explain(q, k, v, attention_mask=mask)
    assert decision.params["qkv_format"] == "bshd" and decision.params["attn_mask_type"] == "arbitrary"
    torch.testing.assert_close(forced(q, k, v, attention_mask=mask), _reference(q, k, v, mask, "bshd"))


def test_a_backend_forced_by_the_environment_runs_the_mask_as_given(monkeypatch):
    s, h, d = 32, 2, 8
    q, k, v = (torch.randn(1, s, h, d, dtype=torch.float64) for _ in range(3))
    mask = _documents_mask(1, s, [[12]])
    module = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="arbitrary")
    assert module.explain(q, k, v, attention_mask=mask).params["qkv_format"] == "thd"
    monkeypatch.setenv("ATTN_DISPATCH_BACKEND", "unfused")
    decision = module.explain(q, k, v, attention_mask=mask)
    assert decision.params["qkv_format"] == "bshd" and decision.params["attn_mask_type"] == "arbitrary"
    assert decision.chosen == "unfused:pytorch"
    torch.testing.assert_close(module(q, k, v, attention_mask=mask), _reference(q, k, v, mask, "bshd"))
