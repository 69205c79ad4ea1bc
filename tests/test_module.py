"""DotProductAttention: Transformer Engine's interface end to end on the CPU (the unfused engine), against
the float64 reference; decisions, forcing, RNG handling, checkpointing and what is not built yet."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from attn_dispatch import DotProductAttention, NoBackendAvailableError
from attn_dispatch.decision import Decision
from attn_dispatch.validation import default_alibi_slopes
from reference import reference_attention

TOL = 1e-5


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(0.1)).item()


def qkv(fmt="bshd", b=2, sq=6, skv=6, h=4, hk=2, d=8, dv=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(s, heads, dim):
        shape = {"bshd": (b, s, heads, dim), "sbhd": (s, b, heads, dim), "thd": (s, heads, dim)}[fmt]
        return torch.randn(shape, generator=g).to(dtype).requires_grad_()
    return make(sq, h, d), make(skv, hk, d), make(skv, hk, dv)


def flat(x):
    return x.reshape(*x.shape[:-2], -1)


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def grads(out, leaves, seed=1):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.autograd.grad(out, leaves, dout.to(out.dtype)), dout


# -------------------------------------------------------------------------------------------------
# Outputs
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_output_is_flattened_and_exact(fmt, mask_type):
    q, k, v = qkv(fmt, sq=5, skv=7, dv=6)
    dpa = DotProductAttention(4, (8, 6), num_gqa_groups=2, qkv_format=fmt, attn_mask_type=mask_type)
    out = dpa(q, k, v)
    expected = (2, 5, 24) if fmt == "bshd" else (5, 2, 24)
    assert out.shape == expected
    ref, _ = reference_attention(q, k, v, qkv_format=fmt, attn_mask_type=mask_type)
    assert rel_err(out, flat(ref)) <= TOL
    (dq, dk, dv), dout = grads(out, (q, k, v))
    rq, rk, rv = torch.autograd.grad(flat(ref), (q, k, v), dout)
    assert max(rel_err(dq, rq), rel_err(dk, rk), rel_err(dv, rv)) <= TOL


def test_thd_output_shape_and_values():
    lens = [3, 5, 1]
    q, k, v = qkv("thd", sq=9, skv=9)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal")
    out = dpa(q, k, v, cu_seqlens_q=cu(lens), cu_seqlens_kv=cu(lens), max_seqlen_q=5, max_seqlen_kv=5)
    assert out.shape == (9, 32)
    ref, _ = reference_attention(q, k, v, qkv_format="thd", attn_mask_type="padding_causal",
                                 cu_seqlens_q=cu(lens), cu_seqlens_kv=cu(lens))
    assert rel_err(out, flat(ref)) <= TOL
    assert dpa.last_decision.params["max_seqlen_q"] == 5


def test_defaults_follow_transformer_engine():
    dpa = DotProductAttention(4, 16)
    assert dpa.qkv_format == "sbhd" and dpa.attn_mask_type == "causal" and dpa.window_size == (-1, 0)
    assert dpa.softmax_scale == pytest.approx(1 / math.sqrt(16)) and dpa.num_gqa_groups == 4
    q, k, v = qkv("sbhd", h=4, hk=4, d=16, dv=16)
    ref, _ = reference_attention(q, k, v, qkv_format="sbhd", attn_mask_type="causal")
    assert rel_err(dpa(q, k, v), flat(ref)) <= TOL


def test_forward_mask_type_overrides_the_constructor_without_inheriting_its_causal_window():
    q, k, v = qkv()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd")  # default causal
    out = dpa(q, k, v, attn_mask_type="no_mask")
    ref, _ = reference_attention(q, k, v, attn_mask_type="no_mask")
    assert rel_err(out, flat(ref)) <= TOL
    assert dpa.last_decision.params["window_size"] == (-1, -1)


def test_sliding_window_from_constructor_and_from_forward():
    q, k, v = qkv(sq=8, skv=8)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal", window_size=(2, 0))
    ref, _ = reference_attention(q, k, v, attn_mask_type="causal", window_size=(2, 0))
    assert rel_err(dpa(q, k, v), flat(ref)) <= TOL
    ref, _ = reference_attention(q, k, v, attn_mask_type="no_mask", window_size=(1, 3))
    assert rel_err(dpa(q, k, v, attn_mask_type="no_mask", window_size=(1, 3)), flat(ref)) <= TOL


def test_padding_mask_equals_cu_seqlens():
    q, k, v = qkv(sq=6, skv=6)
    lens = [6, 4]
    mask = torch.arange(6).view(1, 1, 1, 6) >= torch.tensor(lens).view(2, 1, 1, 1)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="padding_causal")
    by_mask = dpa(q, k, v, attention_mask=mask)
    by_cu = dpa(q, k, v, cu_seqlens_q=cu(lens), cu_seqlens_kv=cu(lens))
    assert torch.equal(by_mask, by_cu)
    ref, _ = reference_attention(q, k, v, attn_mask_type="padding_causal", cu_seqlens_q=cu(lens),
                                 cu_seqlens_kv=cu(lens))
    assert rel_err(by_mask, flat(ref)) <= TOL


def test_cross_attention_padding_mask_pair():
    q, k, v = qkv(sq=4, skv=7)
    mq = torch.arange(4).view(1, 1, 1, 4) >= torch.tensor([4, 2]).view(2, 1, 1, 1)
    mkv = torch.arange(7).view(1, 1, 1, 7) >= torch.tensor([5, 7]).view(2, 1, 1, 1)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="padding",
                              attention_type="cross")
    out = dpa(q, k, v, attention_mask=(mq, mkv), window_size=(1, 1))
    ref, _ = reference_attention(q, k, v, attn_mask_type="padding", window_size=(1, 1),
                                 cu_seqlens_q=cu([4, 2]), cu_seqlens_kv=cu([5, 7]))
    assert rel_err(out, flat(ref)) <= TOL


def test_arbitrary_mask():
    q, k, v = qkv("sbhd", sq=5, skv=7)
    mask = torch.rand(2, 4, 5, 7, generator=torch.Generator().manual_seed(3)) < 0.4
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, attn_mask_type="arbitrary")
    out = dpa(q, k, v, attention_mask=mask)
    ref, _ = reference_attention(q, k, v, qkv_format="sbhd", attn_mask_type="arbitrary", attention_mask=mask)
    assert rel_err(out, flat(ref)) <= TOL


def test_post_scale_bias_gradient_through_the_module():
    q, k, v = qkv(sq=5, skv=5)
    bias = torch.randn(1, 4, 5, 5, requires_grad=True)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="no_mask")
    out = dpa(q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    assert dpa.last_decision.params["bias_shape"] == "1hss"
    ref, _ = reference_attention(q, k, v, bias_type="post_scale_bias", bias=bias)
    (db,), dout = grads(out, (bias,))
    (rdb,) = torch.autograd.grad(flat(ref), (bias,), dout)
    assert rel_err(out, flat(ref)) <= TOL and rel_err(db, rdb) <= TOL


def test_alibi_default_slopes_are_transformer_engines():
    assert torch.allclose(default_alibi_slopes(4), torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]))
    assert torch.allclose(default_alibi_slopes(6), torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]))
    q, k, v = qkv(sq=5, skv=8)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal_bottom_right")
    out = dpa(q, k, v, core_attention_bias_type="alibi")
    ref, _ = reference_attention(q, k, v, attn_mask_type="causal_bottom_right", bias_type="alibi",
                                 alibi_slopes=default_alibi_slopes(4))
    assert rel_err(out, flat(ref)) <= TOL


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_sink_softmax_and_its_parameter(softmax_type):
    q, k, v = qkv()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", softmax_type=softmax_type)
    if softmax_type == "learnable":
        assert isinstance(dpa.softmax_offset, torch.nn.Parameter) and dpa.softmax_offset.shape == (4,)
        with torch.no_grad():
            dpa.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    out = dpa(q, k, v)
    ref, _ = reference_attention(q, k, v, attn_mask_type="causal", softmax_type=softmax_type,
                                 softmax_offset=dpa.softmax_offset)
    assert rel_err(out, flat(ref)) <= TOL
    if softmax_type == "learnable":
        (ds,), dout = grads(out, (dpa.softmax_offset,))
        (rds,) = torch.autograd.grad(flat(ref), (dpa.softmax_offset,), dout)
        assert rel_err(ds, rds) <= TOL


def test_return_max_logit():
    q, k, v = qkv()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="no_mask",
                              return_max_logit=True)
    out, max_logit = dpa(q, k, v)
    kk = k.detach().repeat_interleave(2, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.detach(), kk) / math.sqrt(8)
    assert out.shape == (2, 6, 32)
    torch.testing.assert_close(max_logit, s.amax(dim=(0, 2, 3)))


def test_bf16_through_the_module():
    q, k, v = qkv(dtype=torch.bfloat16, sq=17, skv=17, d=16, dv=16)
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd")
    out = dpa(q, k, v)
    assert out.dtype == torch.bfloat16
    ref, _ = reference_attention(q, k, v, attn_mask_type="causal")
    assert rel_err(out, flat(ref)) <= 2e-2


# -------------------------------------------------------------------------------------------------
# Decisions
# -------------------------------------------------------------------------------------------------
def test_explain_does_not_run_and_forward_records_the_decision():
    q, k, v = qkv()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd")
    decision = dpa.explain(q, k, v, attn_mask_type="no_mask")
    assert isinstance(decision, Decision) and decision.chosen == "unfused:pytorch"
    assert decision.params["attn_mask_type"] == "no_mask" and dpa.last_decision is None
    dpa(q, k, v)
    assert dpa.last_decision.chosen == "unfused:pytorch" and dpa.last_decision.params["attn_mask_type"] == "causal"
    with pytest.raises(ValueError, match="unexpected arguments"):
        dpa.explain(q, k, v, not_an_argument=1)


def test_backend_forcing():
    q, k, v = qkv()
    forced = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", backend="unfused")
    forced(q, k, v)
    assert forced.last_decision.forced == "unfused" and forced.last_decision.chosen == "unfused:pytorch"
    impossible = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", backend="flash_attn_2")
    with pytest.raises(NoBackendAvailableError, match="flash_attn_2"):
        impossible(q, k, v)
    assert impossible.explain(q, k, v).chosen is None
    with pytest.raises(ValueError, match="backend='warp_drive'"):
        DotProductAttention(4, 8, backend="warp_drive")


def test_an_environment_change_reaches_the_next_call_and_explain_agrees(monkeypatch):
    """A plan holds the environment it was made under: after NVTE_UNFUSED_ATTN=0 (the only engine on the CPU) the
    next forward refuses, as explain() and a new module say, and unsetting it lets the module run again."""
    q, k, v = qkv()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd")
    first = dpa(q, k, v)
    dpa(q, k, v)  # the cached path
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    assert dpa.explain(q, k, v).chosen is None
    with pytest.raises(NoBackendAvailableError, match="NVTE_UNFUSED_ATTN"):
        dpa(q, k, v)
    with pytest.raises(NoBackendAvailableError, match="NVTE_UNFUSED_ATTN"):
        DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd")(q, k, v)
    monkeypatch.delenv("NVTE_UNFUSED_ATTN")
    torch.testing.assert_close(dpa(q, k, v), first, rtol=0, atol=0)
    assert dpa.explain(q, k, v).chosen == dpa.last_decision.chosen


def test_plans_are_cached_per_signature():
    q, k, v = qkv()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd")
    dpa(q, k, v)
    first = dpa.last_decision
    dpa(*qkv(seed=5))
    assert n_plans(dpa) == 1 and dpa.last_decision is first
    dpa(*qkv(sq=7, skv=7))
    dpa.eval()
    dpa(q, k, v)
    assert n_plans(dpa) == 3 and dpa.last_decision.params["is_training"] is False


def n_plans(dpa):
    return sum(len(entry.plans) for entry in dpa._plans.entries.values())


def test_thd_plans_follow_the_derived_max_seqlen():
    """thd without max_seqlen: the plan depends on cu_seqlens contents, so new lengths give a new decision."""
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding")
    q, k, v = qkv("thd", sq=10, skv=10)
    dpa(q, k, v, cu_seqlens_q=cu([4, 6]), cu_seqlens_kv=cu([4, 6]))
    assert dpa.last_decision.params["max_seqlen_q"] == 6
    dpa(q, k, v, cu_seqlens_q=cu([9, 1]), cu_seqlens_kv=cu([9, 1]))
    assert dpa.last_decision.params["max_seqlen_q"] == 9 and n_plans(dpa) == 2 and len(dpa._plans.entries) == 1


def test_deterministic_flag_from_environment(monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd")
    assert dpa.explain(*qkv()).params["deterministic"] is True


def test_pad_between_sequences_is_inferred_for_thd():
    q, k, v = qkv("thd", sq=10, skv=10)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding")
    lens, slots = cu([3, 4]), cu([5, 5])
    out = dpa(q, k, v, cu_seqlens_q=lens, cu_seqlens_kv=lens, cu_seqlens_q_padded=slots, cu_seqlens_kv_padded=slots)
    assert dpa.last_decision.params["pad_between_seqs"] is True
    ref, _ = reference_attention(q, k, v, qkv_format="thd", attn_mask_type="padding", cu_seqlens_q=lens,
                                 cu_seqlens_kv=lens, cu_seqlens_q_padded=slots, cu_seqlens_kv_padded=slots)
    assert rel_err(out, flat(ref)) <= TOL
    dpa(q, k, v, cu_seqlens_q=lens, cu_seqlens_kv=lens, cu_seqlens_q_padded=lens, cu_seqlens_kv_padded=lens)
    assert dpa.last_decision.params["pad_between_seqs"] is False


# -------------------------------------------------------------------------------------------------
# Not built yet: clear errors, never ignored
# -------------------------------------------------------------------------------------------------
def test_unbuilt_features_raise_naming_the_argument():
    q, k, v = qkv()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd")
    with pytest.raises(ValueError, match="fp8_output=True needs FP8 attention"):
        dpa(q, k, v, fp8_output=True)
    with pytest.raises(TypeError, match="inference_params must be an attn_dispatch.InferenceParams"):
        dpa(q, k, v, inference_params=object())


# -------------------------------------------------------------------------------------------------
# Dropout, RNG tracker, checkpointing
# -------------------------------------------------------------------------------------------------
class CpuRngTracker:
    """A minimal stand-in for Megatron/TE's CudaRNGStatesTracker, forking the CPU generator."""

    def __init__(self, seed):
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.state = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        saved = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(saved)


def dropout_module(**kwargs):
    return DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attention_dropout=0.3, **kwargs)


def test_dropout_is_reproducible_and_off_in_eval():
    q, k, v = qkv()
    dpa = dropout_module()
    torch.manual_seed(11)
    a = dpa(q, k, v)
    torch.manual_seed(11)
    b = dpa(q, k, v)
    torch.manual_seed(12)
    c = dpa(q, k, v)
    assert torch.equal(a, b) and not torch.equal(a, c)
    dpa.eval()
    ref, _ = reference_attention(q, k, v, attn_mask_type="causal")
    assert rel_err(dpa(q, k, v), flat(ref)) <= TOL


def test_rng_tracker_fork_is_honoured():
    q, k, v = qkv()
    tracked = dropout_module(get_rng_state_tracker=lambda: CpuRngTracker(21))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    out_tracked = tracked(q, k, v)
    assert torch.equal(torch.get_rng_state(), before), "dropout must draw from the tracker's state only"
    torch.manual_seed(21)
    assert torch.equal(out_tracked, dropout_module()(q, k, v))
    # sequence parallelism: Transformer Engine does not fork, so the default generator is used
    sp = dropout_module(get_rng_state_tracker=lambda: CpuRngTracker(21), sequence_parallel=True)
    torch.manual_seed(0)
    sp(q, k, v)
    assert not torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_checkpoint_core_attention_gives_the_same_results(dropout):
    q, k, v = qkv()
    bias = torch.randn(2, 4, 6, 6, requires_grad=True)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attention_dropout=dropout,
                              softmax_type="learnable")
    kwargs = dict(core_attention_bias_type="pre_scale_bias", core_attention_bias=bias)
    results = []
    for ckpt in (False, True):
        torch.manual_seed(5)
        out = dpa(q, k, v, checkpoint_core_attention=ckpt, **kwargs)
        leaves = (q, k, v, bias, dpa.softmax_offset)
        results.append((out, grads(out, leaves)[0]))
    (o1, g1), (o2, g2) = results
    assert torch.equal(o1, o2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# -------------------------------------------------------------------------------------------------
# The cached fast path must not skip what a fresh call would check
# -------------------------------------------------------------------------------------------------
def test_fast_path_still_rejects_mismatched_dtype_or_shape_after_a_cached_call():
    q, k, v = qkv()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="no_mask")
    dpa(q, k, v)
    dpa(q, k, v)  # now cached
    with pytest.raises(ValueError, match="dtype"):
        dpa(q, k.double(), v)
    with pytest.raises(ValueError):
        dpa(q, k[:, :, :1], v)  # one kv head: not the configured num_gqa_groups


def test_fast_path_sees_cleared_decisions(monkeypatch):
    import attn_dispatch

    q, k, v = qkv()
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    dpa(q, k, v)
    dpa(q, k, v)  # the cached path
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    attn_dispatch.clear_cache()
    with pytest.raises(NoBackendAvailableError, match="NVTE_UNFUSED_ATTN=0"):
        dpa(q, k, v)


def test_fast_path_gradients_match_a_fresh_module():
    q, k, v = qkv(seed=3)
    grads = []
    for calls in (1, 3):  # the third call takes the cached path
        dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        for _ in range(calls - 1):
            dpa(*leaves).sum().backward()
            for t in leaves:
                t.grad = None
        out = dpa(*leaves)
        out.backward(torch.ones_like(out) * torch.arange(out.shape[-1], dtype=out.dtype))
        grads.append([out.detach()] + [t.grad for t in leaves])
    for fresh, cached in zip(*grads):
        torch.testing.assert_close(cached, fresh, rtol=0, atol=0)


@pytest.mark.parametrize("scope", ["module", "global"])
def test_hooks_run_on_the_cached_path(scope):
    """__call__'s shortcut skips nn.Module.__call__ only when no hook is registered: hooks added after the call
    signature is cached still see every call, and a forward hook's replacement output is what the caller gets."""
    q, k, v = qkv(seed=4)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    expected = dpa(q, k, v)
    dpa(q, k, v)  # now cached
    seen = []

    def pre_hook(module, args):
        seen.append(("pre", len(args)))

    def post_hook(module, args, out):
        seen.append(("post", tuple(out.shape)))
        return out * 2

    if scope == "module":
        handles = [dpa.register_forward_pre_hook(pre_hook), dpa.register_forward_hook(post_hook)]
    else:
        handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre_hook),
                   torch.nn.modules.module.register_module_forward_hook(post_hook)]
    try:
        out = dpa(q, k, v)
    finally:
        for handle in handles:
            handle.remove()
    assert seen == [("pre", 3), ("post", tuple(expected.shape))]
    torch.testing.assert_close(out, expected * 2, rtol=0, atol=0)
    torch.testing.assert_close(dpa(q, k, v), expected, rtol=0, atol=0)  # hooks removed: the shortcut again


def test_full_backward_hook_sees_the_gradient_on_the_cached_path():
    q, k, v = qkv(seed=5)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="no_mask")
    dpa(q, k, v)
    dpa(q, k, v)
    grads_out = []
    handle = dpa.register_full_backward_hook(lambda module, gin, gout: grads_out.append(gout[0]))
    try:
        out = dpa(q, k, v)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
        out.backward(dout)
    finally:
        handle.remove()
    assert len(grads_out) == 1
    torch.testing.assert_close(grads_out[0], dout, rtol=0, atol=0)


def test_keyword_and_extra_arguments_bypass_the_shortcut_and_still_work():
    q, k, v = qkv(seed=7)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    positional = dpa(q, k, v)
    dpa(q, k, v)
    by_keyword = dpa(query_layer=q, key_layer=k, value_layer=v)
    explicit = dpa(q, k, v, attn_mask_type="causal")
    torch.testing.assert_close(by_keyword, positional, rtol=0, atol=0)
    torch.testing.assert_close(explicit, positional, rtol=0, atol=0)
    with pytest.raises(TypeError):
        dpa(q, k)  # value_layer missing: Python's own message, as with nn.Module.__call__


def test_torch_compile_runs_the_module_eagerly_without_recompiling():
    """Inside a compiled model the attention call is one graph break (the dispatcher runs eagerly, on its cached
    path), later calls with fresh tensors compile nothing new, and outputs and gradients match eager."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)
            self.attn = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal")

        def forward(self, q, k, v):
            q = self.proj(q.flatten(-2)).unflatten(-1, (2, 8))
            return torch.tanh(self.attn(q, k, v))

    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    block = Block()
    compiled = torch.compile(block, backend=counting_backend)
    try:
        for seed in range(4):
            q, k, v = qkv(b=2, sq=12, skv=12, h=2, hk=2, d=8, dv=8, seed=20 + seed)
            out = compiled(q, k, v)
            dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
            if seed == 0:
                first = len(graphs)
            eager = block(q, k, v)
            eager_grads = torch.autograd.grad(eager.sum(), (q, k, v))
            torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
            for g, e in zip((dq, dk, dv), eager_grads):
                torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
        assert first >= 1 and len(graphs) == first  # nothing compiled after the first call
        assert len(counters["graph_break"]) == 1 and "disable" in next(iter(counters["graph_break"]))
        assert block.attn.last_decision is not None and block.attn._plans.fast  # the eager island used the cached path
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("with_guard", [True, False])
def test_cached_path_with_and_without_the_tensor_guard(monkeypatch, with_guard):
    """The cached path matches a call's tensors by a C++ tensor guard where torch has one, else by a Python key;
    either way a same-shape call with other strides, or another dtype, is not mistaken for the cached one."""
    from attn_dispatch import inputs

    if not with_guard:
        monkeypatch.setattr(inputs, "_TensorGuards", None)
    elif inputs._TensorGuards is None:
        pytest.skip("this torch has no usable tensor guard")
    q, k, v = qkv(seed=8)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    ref = flat(reference_attention(q, k, v, qkv_format="bshd", attn_mask_type="causal")[0]).detach()
    dpa(q, k, v)
    assert (dpa._plans.last[0] is not None) is with_guard
    assert rel_err(dpa(q, k, v), ref) <= TOL
    strided = [t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]  # same shape
    assert rel_err(dpa(*strided), ref) <= TOL
    with pytest.raises(ValueError, match="dtype"):
        dpa(q, k.double(), v)


def test_a_window_that_masks_nothing_runs_as_the_plain_mask_and_says_so():
    q, k, v = qkv(sq=8, skv=8)
    dpa = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal", window_size=(7, 0))
    ref, _ = reference_attention(q, k, v, attn_mask_type="causal", window_size=(7, 0))
    assert rel_err(dpa(q, k, v), flat(ref)) <= TOL
    decision = dpa.last_decision
    assert decision.params["window_size"] == (-1, 0)
    assert any("window_size=(7, 0) masks nothing" in note for note in decision.notes)
    assert dpa.explain(q, k, v).notes == decision.notes
    narrow = dpa.explain(q, k, v, window_size=(6, 0))  # one key less in the last row: the window stays
    assert narrow.params["window_size"] == (6, 0) and not narrow.notes
