"""A one-query step over a growing cache takes the plan its key-length bucket already has (no validation or selection
per new token), runs its own length against a float64 reference, says what explain() says, and a call that is wrong
only in a key-length dim is still refused with the reason."""
from __future__ import annotations

import pytest
import torch

from attn_dispatch import DotProductAttention, inputs, sdpa
from attn_dispatch.inputs import DECODE_KV_STEP
from tests.reference import reference_attention

B, H, HK, D = 2, 4, 2, 16


@pytest.fixture
def plans_made(monkeypatch):
    made = []
    make_plan = inputs.make_plan

    def counting(spec, params, lengths=None):
        made.append(params.max_seqlen_kv)
        return make_plan(spec, params, lengths)
    monkeypatch.setattr(inputs, "make_plan", counting)
    return made


def _step(skv: int, pad: int = 3):
    q = torch.randn(B, H, 1, D, dtype=torch.float64)
    k, v = (torch.randn(B, HK, skv, D, dtype=torch.float64) for _ in range(2))
    keep = torch.ones(B, 1, 1, skv, dtype=torch.bool)
    keep[1, ..., :pad] = False  # the second row left-padded, as transformers' decode masks are
    return q, k, v, keep


def test_sdpa_decode_steps_share_their_buckets_plan(plans_made):
    sdpa._MODULES.clear()
    lengths = list(range(2 * DECODE_KV_STEP - 3, 2 * DECODE_KV_STEP + 4))  # crosses one bucket bound
    for skv in lengths:
        q, k, v, keep = _step(skv)
        with torch.no_grad():
            out = sdpa.scaled_dot_product_attention(q, k, v, keep, enable_gqa=True, recognize_masks=False)
            decision = sdpa.explain_sdpa(q, k, v, keep, enable_gqa=True, recognize_masks=False)
        bshd = [x.transpose(1, 2) for x in (q, k, v)]
        want, _ = reference_attention(*bshd, attn_mask_type="arbitrary", attention_mask=~keep)
        torch.testing.assert_close(out.transpose(1, 2), want)
        module = next(m for m in sdpa._MODULES.values() if m.last_decision is not None)
        assert module.last_decision.chosen == decision.chosen
        assert module.last_decision.params == decision.params
        assert set(module.last_decision.notes) <= set(decision.notes)  # explain adds how the mask was read
    # one plan per bucket: (2 * 128 - 3 .. 2 * 128) and (2 * 128 + 1 ..)
    assert plans_made == [2 * DECODE_KV_STEP, 3 * DECODE_KV_STEP], plans_made


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_module_decode_steps_share_a_plan_and_still_refuse_bad_lengths(fmt, plans_made):
    module = DotProductAttention(H, D, num_gqa_groups=HK, qkv_format=fmt, attn_mask_type="arbitrary").eval()

    def laid_out(x):  # [b, h, s, d] -> the module's format
        return x.transpose(1, 2) if fmt == "bshd" else x.permute(2, 0, 1, 3)

    for skv in range(DECODE_KV_STEP + 1, DECODE_KV_STEP + 6):
        q, k, v, keep = _step(skv)
        with torch.no_grad():
            out = module(laid_out(q), laid_out(k), laid_out(v), attention_mask=~keep)
        want, _ = reference_attention(laid_out(q), laid_out(k), laid_out(v), qkv_format=fmt,
                                      attn_mask_type="arbitrary", attention_mask=~keep)
        torch.testing.assert_close(out, want.flatten(-2))
    assert plans_made == [2 * DECODE_KV_STEP]
    assert len(module._plans.entries) == 1  # the previous lengths' entries went: a long generation keeps one
    q, k, v, keep = _step(DECODE_KV_STEP + 7)
    short_mask = ~keep[..., :-1]  # one key short of the keys' length: still refused, naming its shape
    with pytest.raises(ValueError, match="attention_mask has shape"):
        module(laid_out(q), laid_out(k), laid_out(v), attention_mask=short_mask)
    with pytest.raises(ValueError, match="must agree"):  # values one key longer than the keys
        module(laid_out(q), laid_out(k), laid_out(torch.randn(B, HK, DECODE_KV_STEP + 8, D, dtype=torch.float64)),
               attention_mask=~keep)
    with torch.no_grad():  # the bucket's plan still serves a good call after the refusals
        module(laid_out(q), laid_out(k), laid_out(v), attention_mask=~keep)
    assert plans_made == [2 * DECODE_KV_STEP]


def test_training_and_multi_query_calls_are_planned_for_their_own_length(plans_made):
    module = DotProductAttention(H, D, num_gqa_groups=HK, qkv_format="bshd", attn_mask_type="no_mask")
    for skv in (DECODE_KV_STEP + 1, DECODE_KV_STEP + 2):  # training: each length its own plan
        q = torch.randn(B, 1, H, D, dtype=torch.float64, requires_grad=True)
        module(q, *(torch.randn(B, skv, HK, D, dtype=torch.float64) for _ in range(2))).sum().backward()
    module.eval()
    for skv in (DECODE_KV_STEP + 1, DECODE_KV_STEP + 2):  # two queries: not a decode step
        module(torch.randn(B, 2, H, D, dtype=torch.float64),
               *(torch.randn(B, skv, HK, D, dtype=torch.float64) for _ in range(2)))
    assert plans_made == [DECODE_KV_STEP + 1, DECODE_KV_STEP + 2] * 2


def test_layers_of_a_step_reuse_the_masks_translation(monkeypatch):
    """Every layer of a step passes one mask tensor: the first layer's translation serves the others; a write to the
    mask, other shapes or arguments translate again (and are checked again); a dead mask takes it with it."""
    translated = []
    translate = sdpa._translate

    def counting(*args, **kwargs):
        translated.append(args[0].shape)
        return translate(*args, **kwargs)
    monkeypatch.setattr(sdpa, "_translate", counting)
    q, k, v, keep = _step(DECODE_KV_STEP + 9)

    def check(mask, **kw):
        with torch.no_grad():
            out = sdpa.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, **kw)
        want, _ = reference_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask_type="arbitrary",
                                      attention_mask=~mask, softmax_scale=kw.get("scale"))
        torch.testing.assert_close(out.transpose(1, 2), want)

    for _ in range(3):  # three layers, one mask
        check(keep, recognize_masks=False)
    assert len(translated) == 1
    keep[0, ..., 5:9] = False  # written in place: read again
    check(keep, recognize_masks=False)
    check(keep, recognize_masks=False, scale=0.5)  # another argument: translated for it
    assert len(translated) == 3
    with pytest.raises(ValueError, match="broadcast"):  # the same mask with one key fewer: checked, refused
        sdpa.scaled_dot_product_attention(q, k[:, :, 1:], v[:, :, 1:], keep, enable_gqa=True, recognize_masks=False)
    check(keep, recognize_masks=False)
    assert len(translated) == 5
    assert sdpa._LAST_MASKED[0] is not None
    del keep
    assert sdpa._LAST_MASKED[0] is None  # what was read from the mask (its inverse) goes with it
