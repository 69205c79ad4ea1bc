"""Issue 17: a module's output never depends on its call history. Settings assigned after a call take effect,
torch's determinism flag reaches the decision, clear_cache() reaches module plans, an engine that fails to load
is skipped with its reason, packed-batch plans stay bounded, and torch.fx can keep the module as a leaf."""
from __future__ import annotations

import pytest
import torch

from attn_dispatch import runtime_facts

import attn_dispatch
from attn_dispatch import DotProductAttention, backends, constraints, selection
from attn_dispatch.constraints.base import Table, fail
from attn_dispatch.constraints.common import loads
from attn_dispatch.inputs import MAX_DYNAMIC_PLANS


def qkv(b=2, s=6, h=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s, h, d, generator=g, dtype=torch.float64),
            torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64),
            torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64))


def reference(q, k, v, causal: bool, scale: float):
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).flatten(-2)


def test_settings_assigned_after_a_call_take_effect_and_explain_agrees():
    q, k, v = qkv()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    torch.testing.assert_close(dpa(q, k, v), reference(q, k, v, True, 8 ** -0.5))
    dpa(q, k, v)  # the cached path too
    dpa.attn_mask_type = "no_mask"
    torch.testing.assert_close(dpa(q, k, v), reference(q, k, v, False, 8 ** -0.5))
    assert dpa.explain(q, k, v).params["attn_mask_type"] == "no_mask"
    assert dpa.last_decision.params["attn_mask_type"] == "no_mask"
    dpa.softmax_scale = 0.5
    torch.testing.assert_close(dpa(q, k, v), reference(q, k, v, False, 0.5))
    dpa.attention_dropout = 0.25
    dpa.train()
    assert dpa.explain(q, k, v).params["dropout"] == 0.25
    dpa.window_size = (2, 0)
    assert dpa.window_size == (2, 0) and dpa.explain(q, k, v).params["window_size"] == (2, 0)


@pytest.mark.parametrize("name, value, message", [
    ("attn_mask_type", "diagonal", "attn_mask_type"), ("attention_dropout", 1.5, "attention_dropout=1.5"),
    ("softmax_scale", -1.0, "softmax_scale=-1.0"), ("backend", "flash9", "backend='flash9'"),
    ("qkv_format", "bhsd", "qkv_format='bhsd'")])
def test_a_bad_assignment_raises_and_leaves_the_module_as_it_was(name, value, message):
    q, k, v = qkv()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    before = dpa(q, k, v)
    with pytest.raises(ValueError, match=message):
        setattr(dpa, name, value)
    torch.testing.assert_close(dpa(q, k, v), before, rtol=0, atol=0)
    assert dpa.attn_mask_type == "causal" and dpa.qkv_format == "bshd"


def test_determinism_switched_on_after_construction_reaches_the_decision():
    q, k, v = qkv()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd")
    dpa(q, k, v)
    dpa(q, k, v)
    assert dpa.last_decision.params["deterministic"] is False
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        dpa(q, k, v)
        assert dpa.last_decision.params["deterministic"] is True
    finally:
        torch.use_deterministic_algorithms(previous)
    dpa(q, k, v)
    assert dpa.last_decision.params["deterministic"] is False


def test_clear_cache_and_refresh_detected_reach_module_plans():
    q, k, v = qkv()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd")
    dpa(q, k, v)
    dpa(q, k, v)
    first = dpa.last_decision
    attn_dispatch.clear_cache()
    dpa(q, k, v)
    assert dpa.last_decision is not first  # decided again, not the stale plan
    second = dpa.last_decision
    selection.refresh_detected()
    dpa(q, k, v)
    assert dpa.last_decision is not second


def test_an_engine_that_fails_to_load_is_skipped_with_its_reason(monkeypatch):
    """The first provider's engine cannot be imported (a wheel built for another torch, say): the call runs on the
    next one, and explain() says why the first was skipped."""
    def table(provider: str) -> Table:
        t = Table("unfused", provider, f"test engine {provider}")
        t.add(loads(t))

        @t.check("cpu_only_" + provider, requires="CPU", topic="platform", source="tests")
        def _cpu(p, plat, env):
            return fail("test engines run on the CPU") if p.device_type != "cpu" else None
        return t

    tables = {"unfused:broken": table("broken"), "unfused:pytorch": table("pytorch")}
    monkeypatch.setattr(selection, "TABLES", tables)
    monkeypatch.setattr(constraints, "TABLES", tables)
    monkeypatch.setitem(backends.ENGINE_CLASSES, "unfused:broken", "attn_dispatch_no_such_module:Engine")
    monkeypatch.setattr(runtime_facts, "_CURRENT", [runtime_facts.RuntimeFacts()])
    attn_dispatch.clear_cache()
    q, k, v = qkv()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    assert dpa.explain(q, k, v).chosen == "unfused:broken"  # nothing tried to load it yet
    out = dpa(q, k, v)
    torch.testing.assert_close(out, reference(q, k, v, True, 8 ** -0.5))
    assert dpa.last_decision.chosen == "unfused:pytorch"
    verdict = dpa.explain(q, k, v).verdict("unfused", "broken")
    assert not verdict.eligible and any("failed to load" in r.message and "attn_dispatch_no_such_module" in r.message
                                        for r in verdict.reasons)
    attn_dispatch.clear_cache()


def test_packed_batch_plans_stay_bounded():
    dpa = DotProductAttention(2, 4, qkv_format="thd", attn_mask_type="padding_causal")
    g = torch.Generator().manual_seed(0)
    for i in range(1000):
        lens = torch.randint(1, 40, (3,), generator=g)
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
        t = int(cu[-1])
        q = torch.randn(t, 2, 4, generator=g)
        if i % 50 == 0:  # a few checked against the reference; all planned
            out = dpa(q, q, q, cu_seqlens_q=cu, cu_seqlens_kv=cu)
            first = int(lens[0])
            ref = reference(q[None, :first].double(), q[None, :first].double(), q[None, :first].double(), True,
                            0.5)[0]
            torch.testing.assert_close(out[:first].double(), ref, rtol=1e-4, atol=1e-4)
        else:
            dpa(q, q, q, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        plans = sum(len(e.plans) for e in dpa._plans.entries.values())
        assert plans <= MAX_DYNAMIC_PLANS * len(dpa._plans.entries) and len(dpa._plans.entries) <= 64


def test_torch_fx_traces_a_model_holding_the_module_as_a_leaf():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8, dtype=torch.float64)
            self.attn = DotProductAttention(2, 4, qkv_format="bshd", attn_mask_type="causal")

        def forward(self, x):
            q = self.proj(x).view(x.shape[0], x.shape[1], 2, 4)
            return self.attn(q, q, q)

    block = Block()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    block(x)
    block(x)  # the module's cached shortcut is live: tracing must still see a leaf
    class LeafTracer(torch.fx.Tracer):  # how a user keeps a fused-attention module opaque
        def is_leaf_module(self, m, qualname):
            return isinstance(m, DotProductAttention) or super().is_leaf_module(m, qualname)

    graph = LeafTracer().trace(block)
    traced = torch.fx.GraphModule(block, graph)
    assert any(n.op == "call_module" and n.target == "attn" for n in traced.graph.nodes)
    torch.testing.assert_close(traced(x), block(x), rtol=0, atol=0)


def test_decisions_are_immutable_values():
    import pydantic

    from attn_dispatch import AttentionParams, explain

    d = explain(AttentionParams(device_type="cpu", dtype="fp32"))
    with pytest.raises(pydantic.ValidationError):
        d.chosen = "cudnn_fused:frontend"
    with pytest.raises(pydantic.ValidationError):
        d.verdicts[0].eligible = False
    assert isinstance(d.verdicts, tuple) and isinstance(d.verdicts[0].reasons, tuple)
    assert explain(AttentionParams(device_type="cpu", dtype="fp32")).chosen == "unfused:pytorch"
