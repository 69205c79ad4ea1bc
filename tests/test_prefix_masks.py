"""A bool prefix-LM mask (a bidirectional prefix, causal after it) runs as its two calls: rows of the prefix without a
mask, the rest causal bottom-right. The same output and gradients as the mask read as given (float64 reference), on
the module and the SDPA function; explain names both calls and its Decision is the one forward acted on last; any
other mask, a forced backend, or a user's modifier keeps the mask as given."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attn_dispatch
from attn_dispatch import DotProductAttention
from attn_dispatch.prefix_masks import prefix_length


def _prefix_mask(batch: int, s: int, prefixes: list[int]) -> torch.Tensor:
    """[b, 1, s, s], True masks a pair out: row i of element b sees keys [0, max(prefixes[b], i + 1))."""
    i = torch.arange(s)
    keep = torch.stack([(i[None, :] < p) | (i[None, :] <= i[:, None]) for p in prefixes])
    return (~keep)[:, None].expand(batch, 1, s, s) if len(prefixes) == 1 else (~keep)[:, None]


def _reference(q, k, v, mask, fmt):
    qb, kb, vb = ((t if fmt == "bshd" else t.transpose(0, 1)) for t in (q, k, v))
    groups = qb.shape[2] // kb.shape[2]
    kb, vb = (t.repeat_interleave(groups, dim=2) for t in (kb, vb))
    scores = torch.einsum("bqhd,bkhd->bhqk", qb, kb) / q.shape[-1] ** 0.5
    out = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(mask, float("-inf")).softmax(-1), vb).flatten(-2)
    return out if fmt == "bshd" else out.transpose(0, 1)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("batch, prefix, hkv", [(1, 9, 4), (3, 5, 2), (2, 47, 1)])
def test_prefix_lm_runs_as_two_calls_with_the_mask_s_results(fmt, batch, prefix, hkv):
    s, h, d = 48, 4, 8
    gen = torch.Generator().manual_seed(batch * 100 + prefix)
    mask = _prefix_mask(batch, s, [prefix])
    shape = lambda heads: (batch, s, heads, d) if fmt == "bshd" else (s, batch, heads, d)  # noqa: E731
    q = torch.randn(*shape(h), generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(*shape(hkv), generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    module = DotProductAttention(h, d, num_gqa_groups=hkv, qkv_format=fmt, attn_mask_type="arbitrary")
    decision = module.explain(q, k, v, attention_mask=mask)
    assert decision.params["attn_mask_type"] == "causal_bottom_right"
    assert (decision.params["max_seqlen_q"], decision.params["max_seqlen_kv"]) == (s - prefix, s)
    assert any(f"prefix of {prefix} tokens" in n and "two calls" in n for n in decision.notes)
    out = module(q, k, v, attention_mask=mask)
    assert module.last_decision.params == decision.params and module.last_decision.chosen == decision.chosen
    want = _reference(q, k, v, mask, fmt)
    torch.testing.assert_close(out, want)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for g, e in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(g, e)


def test_recognition_takes_only_the_prefix_lm_pattern():
    s = 32
    assert prefix_length(_prefix_mask(1, s, [8]), 1, s) == 8
    assert prefix_length(_prefix_mask(2, s, [8]), 2, s) == 8
    assert prefix_length(_prefix_mask(2, s, [8, 9]), 2, s) is None  # a prefix per element: not one split
    assert prefix_length(_prefix_mask(1, s, [1]), 1, s) is None  # causal: the documents reading's
    assert prefix_length(_prefix_mask(1, s, [s]), 1, s) is None  # no mask at all
    holed = _prefix_mask(1, s, [8]).clone()
    holed[0, 0, 20, 21] = False  # row 20 also sees a later key
    assert prefix_length(holed, 1, s) is None
    holed = _prefix_mask(1, s, [8]).clone()
    holed[0, 0, 3, 2] = True  # a prefix row misses a key
    assert prefix_length(holed, 1, s) is None
    keeps = ~_prefix_mask(1, s, [8])
    assert prefix_length(keeps, 1, s, true_keeps=True) == 8


def test_an_edited_mask_is_read_again_and_other_masks_stay_arbitrary():
    s, h, d = 32, 2, 8
    q, k, v = (torch.randn(1, s, h, d, dtype=torch.float64) for _ in range(3))
    module = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="arbitrary")
    mask = _prefix_mask(1, s, [6]).clone()
    assert module.explain(q, k, v, attention_mask=mask).params["attn_mask_type"] == "causal_bottom_right"
    torch.testing.assert_close(module(q, k, v, attention_mask=mask), _reference(q, k, v, mask, "bshd"))
    mask[0, 0, 25, 2] = True  # a hole: no longer a prefix-LM mask
    assert module.explain(q, k, v, attention_mask=mask).params["attn_mask_type"] == "arbitrary"
    torch.testing.assert_close(module(q, k, v, attention_mask=mask), _reference(q, k, v, mask, "bshd"))


def test_a_forced_backend_a_window_or_a_user_mask_mod_keeps_the_mask_as_given():
    s, h, d = 32, 2, 8
    q, k, v = (torch.randn(1, s, h, d, dtype=torch.float64) for _ in range(3))
    mask = _prefix_mask(1, s, [10])
    forced = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="arbitrary", backend="unfused")
    assert forced.explain(q, k, v, attention_mask=mask).params["attn_mask_type"] == "arbitrary"
    torch.testing.assert_close(forced(q, k, v, attention_mask=mask), _reference(q, k, v, mask, "bshd"))
    windowed = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="arbitrary", window_size=(4, 0))
    assert windowed.explain(q, k, v, attention_mask=mask).params["attn_mask_type"] == "arbitrary"
    keep = ~mask
    modded = attn_dispatch.explain_sdpa(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=keep,
                                        mask_mod=lambda b, hh, qi, ki: qi >= 0)
    assert modded.params["attn_mask_type"] == "arbitrary"


@pytest.mark.parametrize("grad", [True, False])
def test_the_sdpa_function_splits_a_prefix_lm_mask(grad):
    b, h, s, d, prefix = 2, 4, 40, 8, 11
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(b, h, s, d, generator=gen, dtype=torch.float64, requires_grad=grad) for _ in range(3))
    keep = ~_prefix_mask(1, s, [prefix])
    decision = attn_dispatch.explain_sdpa(q, k, v, attn_mask=keep)
    assert decision.params["attn_mask_type"] == "causal_bottom_right"
    assert any(f"prefix of {prefix} tokens" in n for n in decision.notes)
    with torch.set_grad_enabled(grad):
        out = attn_dispatch.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    torch.testing.assert_close(out, want)
    if grad:
        dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        for g, e in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("tail_over_causal, split", [(1.05, True), (1.9, False)])
def test_the_two_calls_run_only_where_predicted_to_pay(monkeypatch, tail_over_causal, split):
    """Where the profile predicts the calls (a GPU platform), the two calls run only within 1 / FLEX_PREFIX_FRACTION
    of the causal call over the same tensors; else the mask runs as given, and explain's note says why with the
    predicted times. The predictions stand in here for a platform's (the CPU has no profile)."""
    from attn_dispatch import question

    real = question._pick

    def predicted(module, q, k, v, args):
        chosen, _ = real(module, q, k, v, args)
        if q.shape[1] < k.shape[1]:  # the tail: rows after the prefix, every key
            return chosen, tail_over_causal
        return chosen, 1.0 if args.attn_mask_type == "causal" else 0.01  # the causal call; the prefix's rows

    monkeypatch.setattr(question, "_pick", predicted)
    s, h, d = 32, 2, 8
    q, k, v = (torch.randn(1, s, h, d, dtype=torch.float64) for _ in range(3))
    mask = _prefix_mask(1, s, [8]).clone()
    module = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="arbitrary")
    decision = module.explain(q, k, v, attention_mask=mask)
    assert decision.params["attn_mask_type"] == ("causal_bottom_right" if split else "arbitrary")
    note = next(n for n in decision.notes if "prefix-LM" in n)
    assert f"{tail_over_causal + 0.01:.2f}x the causal call" in note
    assert ("run as given" in note) is not split
    out = module(q, k, v, attention_mask=mask)
    assert module.last_decision.params["attn_mask_type"] == decision.params["attn_mask_type"]
    torch.testing.assert_close(out, _reference(q, k, v, mask, "bshd"))


@settings(max_examples=30, deadline=None)
@given(s=st.integers(3, 40), data=st.data())
def test_recognition_agrees_with_the_pattern_on_random_masks(s, data):
    """A prefix-LM mask is recognised with its prefix, and the same mask with any one pair flipped is not (unless the
    flip leaves another prefix-LM mask, which the reference pattern then names)."""
    prefix = data.draw(st.integers(2, s - 1))
    mask = _prefix_mask(1, s, [prefix]).clone()
    assert prefix_length(mask, 1, s) == prefix
    row, col = data.draw(st.integers(0, s - 1)), data.draw(st.integers(0, s - 1))
    mask[0, 0, row, col] = ~mask[0, 0, row, col]
    still = next((p for p in range(2, s) if torch.equal(mask, _prefix_mask(1, s, [p]))), None)
    assert prefix_length(mask, 1, s) == still


@pytest.mark.parametrize("recognize", [True, False])
@pytest.mark.parametrize("kind", ["prefix", "documents"])
def test_the_sdpa_function_s_explanation_is_what_it_ran(kind, recognize):
    """A self-attention bool mask the module can read (a prefix-LM mask; causal documents over several rows) runs on
    the module's own path where masks are recognised, and as given with recognize_masks=False: explain_sdpa's
    Decision is the one the call acted on either way, and the output is torch SDPA's."""
    b, h, s, d = 2, 2, 32, 8
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, h, s, d, generator=gen, dtype=torch.float64) for _ in range(3))
    if kind == "prefix":
        keep = ~_prefix_mask(1, s, [9])
    else:
        doc = torch.zeros(b, s, dtype=torch.long)
        doc[:, 10:] += 1
        doc[1, 20:] += 1
        i = torch.arange(s)
        keep = ((doc[:, :, None] == doc[:, None, :]) & (i[None, None, :] <= i[None, :, None]))[:, None]
    decision = attn_dispatch.explain_sdpa(q, k, v, attn_mask=keep, recognize_masks=recognize)
    out = attn_dispatch.scaled_dot_product_attention(q, k, v, attn_mask=keep, recognize_masks=recognize)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=keep))
    ran = next(m for m in attn_dispatch.sdpa._MODULES.values() if m.last_decision is not None
               and m.last_decision.params == decision.params)
    assert ran.last_decision.chosen == decision.chosen
    read = {"prefix": "causal_bottom_right", "documents": "padding_causal"}[kind] if recognize else "arbitrary"
    assert decision.params["attn_mask_type"] == read
