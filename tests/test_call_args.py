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
    """Keywords passed at their default values share the q, k, v-only call's cached plan; a keyword with another
    value (even one the module would pick anyway) is cached under its own key."""
    q, k, v = qkv(seed=11)
    ref = reference_attention(q, k, v, qkv_format="bshd", attn_mask_type=mask_type)[0].flatten(-2)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type=mask_type)
    out = dpa(q, k, v, attn_mask_type=mask_type)
    torch.testing.assert_close(out, ref)
    assert len(dpa._plans.fast) == 1
    out = dpa(q, k, v, **DEFAULTS)
    torch.testing.assert_close(out, ref)
    assert len(dpa._plans.fast) == 2
    dq, dk, dv = torch.autograd.grad(dpa(q, k, v), (q, k, v), ref.detach())
    assert len(dpa._plans.fast) == 2  # q, k, v alone: the plan the spelled-out defaults made
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), ref.detach())
    for got, expected in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(got, expected)


def _count_planning(monkeypatch, dpa) -> list:
    """Each call that plans (forward's general path) appends to the returned list."""
    planned = []
    full = DotProductAttention._forward_args

    def counting(self, q, k, v, args):
        planned.append(args)
        return full(self, q, k, v, args)
    monkeypatch.setattr(DotProductAttention, "_forward_args", counting)
    return planned


@pytest.mark.private_torch
def test_keyword_settings_take_the_cached_path_with_their_own_plan(monkeypatch):
    """Megatron passes attn_mask_type (and friends) on every call: a repeat of such a call skips planning, and a
    call with another value of a setting runs that setting, not the cached plan of the last one."""
    q, k, v = qkv(seed=13)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="no_mask")
    planned = _count_planning(monkeypatch, dpa)
    refs = {mask: reference_attention(q, k, v, qkv_format="bshd", attn_mask_type=mask)[0].flatten(-2)
            for mask in ("causal", "no_mask")}
    for mask in ("causal", "no_mask", "causal", "no_mask"):
        out = dpa(q, k, v, attn_mask_type=mask, qkv_format="bshd", window_size=(-1, 0) if mask == "causal" else None)
        torch.testing.assert_close(out, refs[mask])
    assert len(planned) == 2  # one plan per setting, then the cached path
    out = dpa(q, k, v, None, "bshd", attn_mask_type="causal", window_size=(-1, 0))  # the same call, positionally
    torch.testing.assert_close(out, refs["causal"])
    assert len(planned) == 2
    grads = torch.autograd.grad(dpa(q, k, v, attn_mask_type="causal", qkv_format="bshd", window_size=(-1, 0)),
                                (q, k, v), refs["causal"].detach())
    expected = torch.autograd.grad(refs["causal"], (q, k, v), refs["causal"].detach())
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)
    assert len(planned) == 2  # the training call (grad recorded) ran the cached plan too


@pytest.mark.parametrize("extra", [
    {"attention_mask": "mask"}, {"checkpoint_core_attention": True}, {"window_size": [-1, 0]},
    {"max_seqlen_q": 6.0}, {"core_attention_bias_type": "alibi", "alibi_slopes": "slopes"}])
def test_calls_with_per_call_data_or_unhashable_settings_plan_every_time(monkeypatch, extra):
    """Tensors (a mask, ALiBi slopes), recomputation and settings that are not plain values never take the cached
    path: every such call goes through forward's checks."""
    q, k, v = qkv(seed=17)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    values = {"mask": torch.tensor([0, 0, 0, 0, 1, 1], dtype=torch.bool).expand(2, 1, 1, 6),
              "slopes": torch.rand(4, dtype=torch.float64)}
    kwargs = {name: values.get(value, value) if isinstance(value, str) else value for name, value in extra.items()}
    if "attention_mask" in kwargs:
        kwargs["attn_mask_type"] = "padding_causal"
    planned = _count_planning(monkeypatch, dpa)
    first = dpa(q, k, v, **kwargs)
    again = dpa(q, k, v, **kwargs)
    torch.testing.assert_close(first, again)
    assert len(planned) == 2


def test_a_rejected_keyword_value_after_a_cached_call_still_raises():
    """A bad value never reaches the cached path: the call plans, and planning says what is wrong."""
    q, k, v = qkv(seed=19)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    dpa(q, k, v, attn_mask_type="causal")
    dpa(q, k, v, attn_mask_type="causal")
    with pytest.raises(ValueError, match="attn_mask_type"):
        dpa(q, k, v, attn_mask_type="diagonal")
    with pytest.raises(TypeError):
        dpa(q, k, v, attn_mask_typo="causal")


def test_forward_puts_each_keyword_in_its_own_field(monkeypatch):
    """forward builds CallArgs positionally (keywords would cost ~0.6 us per call): each value must land in the
    field of its name."""
    seen = []
    monkeypatch.setattr(DotProductAttention, "_forward_args", lambda self, q, k, v, args: seen.append(args))
    sentinels = {name: object() for name in DEFAULTS if name != "fast_zero_fill"}
    q, k, v = qkv(seed=5)
    DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd")(q, k, v, **sentinels)
    assert {name: getattr(seen[0], name) for name in sentinels} == sentinels
