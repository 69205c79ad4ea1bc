"""forward's keywords as one value (attn_dispatch.call_args.CallArgs): the value and forward's signature stay in
step, explain() takes the same keywords, and a call spelling out the defaults is the q, k, v-only call."""
from __future__ import annotations

import inspect

import pytest
import torch

from attn_dispatch import DotProductAttention
from attn_dispatch.call_args import KEYWORDS, QKV_ONLY, CallArgs
from reference import reference_attention

FORWARD = inspect.signature(DotProductAttention.forward).parameters
DEFAULTS = {name: p.default for name, p in FORWARD.items()
            if name not in ("self", "query_layer", "key_layer", "value_layer")}


def qkv(seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 6, heads, 8, generator=g, dtype=torch.float64).requires_grad_()
                 for heads in (4, 2, 2))


def test_call_args_holds_forward_keywords_with_forward_defaults():
    assert set(DEFAULTS) == KEYWORDS  # a keyword added to forward needs its CallArgs field (and back)
    assert {name: DEFAULTS[name] for name in CallArgs._fields} == CallArgs._field_defaults
    with pytest.raises(AttributeError):
        QKV_ONLY.qkv_format = "thd"  # shared by every q, k, v-only call: must not change


def test_explain_takes_every_forward_keyword_and_agrees_with_forward():
    q, k, v = qkv(seed=3)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    decision = dpa.explain(q, k, v, **DEFAULTS)
    dpa(q, k, v, **DEFAULTS)
    assert decision.chosen == dpa.last_decision.chosen and decision.params == dpa.last_decision.params


@pytest.mark.parametrize("mask_type", ["causal", "no_mask"])
def test_defaults_spelled_out_are_the_qkv_only_call(mask_type):
    """Keywords passed at their default values plan once for the cached fast path, as q, k, v alone would; a
    keyword with another value (even one the module would pick anyway) keeps the general path."""
    q, k, v = qkv(seed=11)
    ref = reference_attention(q, k, v, qkv_format="bshd", attn_mask_type=mask_type)[0].flatten(-2)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type=mask_type)
    out = dpa(q, k, v, attn_mask_type=mask_type)
    torch.testing.assert_close(out, ref)
    assert not dpa._fast
    out = dpa(q, k, v, **DEFAULTS)
    torch.testing.assert_close(out, ref)
    assert len(dpa._fast) == 1
    dq, dk, dv = torch.autograd.grad(dpa(q, k, v), (q, k, v), ref.detach())
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), ref.detach())
    for got, expected in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(got, expected)


def test_forward_puts_each_keyword_in_its_own_field(monkeypatch):
    """forward builds CallArgs positionally (keywords would cost ~0.6 us per call): each value must land in the
    field of its name."""
    seen = []
    monkeypatch.setattr(DotProductAttention, "_forward_args", lambda self, q, k, v, args: seen.append(args))
    sentinels = {name: object() for name in DEFAULTS if name != "fast_zero_fill"}
    q, k, v = qkv(seed=5)
    DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd")(q, k, v, **sentinels)
    assert {name: getattr(seen[0], name) for name in sentinels} == sentinels
