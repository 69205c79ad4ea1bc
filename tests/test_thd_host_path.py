"""The thd call's host path: facts read once from validated cu_seqlens (AttnAux.packed), device tensors derived
from cu_seqlens cached per tensor and version, and the FlashAttention plumbing that skips the clean-ups those facts
show to be no-ops while still zeroing rows past the last sequence (lse -inf) when there are some.

The facts are checked against tests/reference.py (which rows see no key), the plumbing with the float64 stand-in
kernel of tests/test_flash_plumbing.py, whose unwritten rows are NaN.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from attn_dispatch import DotProductAttention, inputs, sequences, tensor_cache
from attn_dispatch.backends import _flash_io
from attn_dispatch.backends.base import AttnAux, PackedFacts
from attn_dispatch.call_args import CallArgs
from attn_dispatch.params import normalize_window
from reference import reference_attention
from test_flash_plumbing import CASES, StandInKernel, assert_matches_reference, make_case

THD_MASKS = ("padding", "padding_causal", "padding_causal_bottom_right")


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def facts_of(q, k, aux: AttnAux, mask: str, window) -> PackedFacts | None:
    """What the module's validation derives for these tensors (sequences.sequence_info, cached on cu_seqlens)."""
    args = CallArgs(qkv_format="thd", cu_seqlens_q=aux.cu_seqlens_q, cu_seqlens_kv=aux.cu_seqlens_kv,
                    cu_seqlens_q_padded=aux.cu_seqlens_q_padded, cu_seqlens_kv_padded=aux.cu_seqlens_kv_padded,
                    attn_mask_type=mask)
    return sequences.packed_facts(sequences.sequence_info("thd", mask, q, k, args), mask, tuple(window))


# ---------------------------------------------------------------------------------------------------------------
# The facts, against the reference
# ---------------------------------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=4),
       tail_q=st.integers(0, 3), tail_kv=st.integers(0, 3), mask=st.sampled_from(THD_MASKS),
       left=st.integers(-1, 5), right=st.integers(-1, 5), seed=st.integers(0, 2 ** 16))
def test_facts_say_exactly_whether_a_row_sees_no_key(lengths, tail_q, tail_kv, mask, left, right, seed):
    lens_q, lens_kv = [n for n, _ in lengths], [n for _, n in lengths]
    window = normalize_window((left, -1 if "causal" in mask else right), mask)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q) + tail_q, 1, 2, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lens_kv) + tail_kv, 1, 2, generator=g, dtype=torch.float64) for _ in range(2))
    aux = AttnAux(cu_seqlens_q=_cu(lens_q), cu_seqlens_kv=_cu(lens_kv))
    facts = facts_of(q, k, aux, mask, window)
    _, lse = reference_attention(q, k, v, qkv_format="thd", attn_mask_type=mask, window_size=window,
                                 cu_seqlens_q=aux.cu_seqlens_q, cu_seqlens_kv=aux.cu_seqlens_kv)
    end_q = sum(lens_q)
    assert (facts.end_q, facts.end_kv) == (end_q, sum(lens_kv))
    assert facts.keyless_rows == bool(torch.isneginf(lse[:, :end_q]).any()), (lens_q, lens_kv, mask, window)
    assert bool(torch.isneginf(lse[:, end_q:]).all())  # rows past the end: what the engines must still give


def test_facts_are_unknown_unless_the_caller_gives_the_window():
    q = torch.randn(10, 2, 8)
    aux = AttnAux(cu_seqlens_q=_cu([4, 6]), cu_seqlens_kv=_cu([4, 6]))
    args = CallArgs(qkv_format="thd", cu_seqlens_q=aux.cu_seqlens_q, cu_seqlens_kv=aux.cu_seqlens_kv)
    seq = sequences.sequence_info("thd", "padding", q, q, args)
    assert inputs.make_aux(seq, "padding", None, None, None, None).packed is None  # e.g. context parallelism
    assert inputs.make_aux(seq, "padding", None, None, None, None, (-1, -1)).packed == PackedFacts(10, 10, False)
    dense = sequences.sequence_info("bshd", "padding", q.view(2, 5, 2, 8), q.view(2, 5, 2, 8),
                                 CallArgs(cu_seqlens_q=_cu([3, 5]), cu_seqlens_kv=_cu([3, 5])))
    assert sequences.packed_facts(dense, "padding", (-1, -1)) is None


def test_padded_offsets_with_gaps_leave_the_facts_unknown():
    q = torch.randn(16, 2, 8)
    cu, gapped, same = _cu([4, 6]), _cu([5, 8]), _cu([4, 6])
    for padded, expected in ((gapped, None), (same, PackedFacts(10, 10, False))):
        args = CallArgs(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                        cu_seqlens_kv_padded=padded)
        seq = sequences.sequence_info("thd", "padding", q, q, args)
        assert sequences.packed_facts(seq, "padding", (-1, -1)) == expected


def test_the_module_hands_the_facts_to_the_engine():
    m = DotProductAttention(2, 8, qkv_format="thd", attn_mask_type="padding_causal_bottom_right")
    q, k = torch.randn(12, 2, 8), torch.randn(9, 2, 8)
    args = CallArgs(cu_seqlens_q=_cu([5, 4]), cu_seqlens_kv=_cu([2, 6]), window_size=(3, 0))
    _, aux = m._prepare(q, k, k, args)
    assert aux.packed == PackedFacts(9, 8, True)  # sequence 0: 5 queries, 2 keys, bottom-right: rows 0-2 see none
    _, aux = m._prepare(q, k, k, args._replace(cu_seqlens_kv=_cu([5, 4])))
    assert aux.packed == PackedFacts(9, 9, False)


def test_thd_under_inference_mode_runs_without_caching():
    """Inference tensors have no version counter: validation and derived tensors are recomputed, never cached."""
    m = DotProductAttention(2, 8, qkv_format="thd", attn_mask_type="padding")
    with torch.inference_mode():
        q, cu = torch.randn(10, 2, 8), _cu([4, 6])
        out = m(q, q, q, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        ref, _ = reference_attention(q, q, q, qkv_format="thd", attn_mask_type="padding", cu_seqlens_q=cu,
                                     cu_seqlens_kv=cu, softmax_scale=8 ** -0.5)
    torch.testing.assert_close(out.double(), ref.flatten(-2), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------------------------
def test_cached_on_hits_the_same_tensor_and_misses_a_modified_or_new_one():
    calls = []

    def derive(cu):
        calls.append(1)
        return cu * 2

    cu = _cu([3, 4])
    first = tensor_cache.cached_on((cu,), ("test",), lambda: derive(cu))
    assert tensor_cache.cached_on((cu,), ("test",), lambda: derive(cu)) is first and len(calls) == 1
    assert tensor_cache.cached_on((cu,), ("other",), lambda: derive(cu)) is not first  # the context is the key too
    cu[1] = 5  # in place: the version moves
    changed = tensor_cache.cached_on((cu,), ("test",), lambda: derive(cu))
    assert changed.tolist() == [0, 10, 14] and len(calls) == 3
    twin = cu.clone()  # equal values, another tensor
    assert tensor_cache.cached_on((twin,), ("test",), lambda: derive(twin)) is not changed and len(calls) == 4
    with torch.inference_mode():
        frozen = _cu([1, 1])
        a = tensor_cache.cached_on((frozen,), ("test",), lambda: derive(frozen))
        b = tensor_cache.cached_on((frozen,), ("test",), lambda: derive(frozen))
    assert a is not b and len(calls) == 6


def test_the_cache_is_bounded():
    keep = [torch.zeros(1) for _ in range(tensor_cache.CACHE_LIMIT + 10)]
    for t in keep:
        tensor_cache.cached_on((t,), ("bounded",), lambda: 0)
    assert len(tensor_cache._CACHE) <= tensor_cache.CACHE_LIMIT


def test_flash_int32_copies_are_made_once_per_tensor_version():
    cu = torch.tensor([0, 3, 7], dtype=torch.int64)
    a = _flash_io._int32_cu(cu, "cu_seqlens_q", cu.device)
    assert a.dtype == torch.int32 and _flash_io._int32_cu(cu, "cu_seqlens_q", cu.device) is a
    cu[2] = 9
    b = _flash_io._int32_cu(cu, "cu_seqlens_q", cu.device)
    assert b is not a and b.tolist() == [0, 3, 9]


def test_cudnn_lengths_and_ragged_offsets_are_made_once_per_tensor_version_and_stride():
    from attn_dispatch.backends import cudnn_fused as cd

    cu = _cu([3, 4, 2])
    lens = cd._cached_lens(cu)
    assert lens.view(-1).tolist() == [3, 4, 2] and lens.dtype == torch.int32 and cd._cached_lens(cu) is lens
    off = cd._ragged_offsets(cu, torch.int64, 96)
    assert off.view(-1).tolist() == [0, 288, 672, 864] and cd._ragged_offsets(cu, torch.int64, 96) is off
    assert cd._ragged_offsets(cu, torch.int64, 32).view(-1).tolist() == [0, 96, 224, 288]
    assert cd._ragged_offsets(cu, torch.int32, 96).dtype == torch.int32
    cu.add_(0)  # an in-place write, even one that changes nothing, misses
    assert cd._cached_lens(cu) is not lens and cd._ragged_offsets(cu, torch.int64, 96) is not off


# ---------------------------------------------------------------------------------------------------------------
# The FlashAttention plumbing with the facts
# ---------------------------------------------------------------------------------------------------------------
THD_CASES = {name: case for name, case in CASES.items() if case.get("fmt") == "thd"}
THD_CASES.update({
    "thd no tail": dict(fmt="thd", mask="padding", lens_q=[5, 1, 8], lens_kv=[7, 3, 2]),
    "thd causal, empty sequence, tail": dict(fmt="thd", mask="padding_causal", lens_q=[5, 0, 8], tail=4),
    "thd bottom-right keyless rows, tail": dict(fmt="thd", mask="padding_causal_bottom_right",
                                                lens_q=[6, 2, 8], lens_kv=[3, 0, 8], tail=1),
})


class OpLog(TorchDispatchMode):
    """The aten ops run outside the stand-in's kernel (each one is a kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class LoggedStandIn(StandInKernel):
    log: OpLog | None = None

    def _kernel_fwd(self, *args):
        with self._paused():
            return super()._kernel_fwd(*args)

    def _kernel_bwd(self, *args):
        with self._paused():
            return super()._kernel_bwd(*args)

    def _paused(self):
        import contextlib

        @contextlib.contextmanager
        def pause():
            if self.log is not None:
                self.log.paused = True
            try:
                yield
            finally:
                if self.log is not None:
                    self.log.paused = False
        return pause()


def _with_facts(name):
    q, k, v, aux, cfg = make_case(**THD_CASES[name])
    return q, k, v, dataclasses.replace(aux, packed=facts_of(q, k, aux, cfg.attn_mask_type, cfg.window_size)), cfg


PAIRS = [(style, name) for name in THD_CASES for style in ("fa2", "fa4")
         if style == "fa4" or THD_CASES[name].get("softmax", "vanilla") == "vanilla"]


@pytest.mark.parametrize("style, name", PAIRS)
def test_plumbing_with_the_facts_matches_the_reference(style, name):
    q, k, v, aux, cfg = _with_facts(name)
    engine = StandInKernel(style)
    assert_matches_reference(engine, q, k, v, aux, cfg)  # tail rows 0 and lse -inf (the stand-in leaves NaN there)
    if cfg.softmax_type == "learnable":
        assert not torch.isneginf(engine.seen_lse[-1]).any()  # the kernel got its own convention back


def _ops_outside_the_kernel(style, q, k, v, aux, cfg) -> tuple[list[str], list[str]]:
    engine = LoggedStandIn(style)
    with torch.no_grad():
        engine.backward(*_fwd_bwd_args(engine, q, k, v, aux, cfg))  # warm: cached derivations made
        dout = torch.ones(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        engine.log = OpLog()
        with engine.log:
            res = engine.forward(q, k, v, aux, cfg)
            fwd_ops, engine.log.ops = engine.log.ops, []
            engine.backward(dout, q, k, v, res.out, res.lse, res.state, aux, cfg)
    return fwd_ops, engine.log.ops


def _fwd_bwd_args(engine, q, k, v, aux, cfg):
    res = engine.forward(q, k, v, aux, cfg)
    return torch.ones_like(res.out), q, k, v, res.out, res.lse, res.state, aux, cfg


DEVICE_MASKING = {"arange", "masked_fill", "masked_fill_", "ge", "eq", "searchsorted", "where", "isneginf"}


@pytest.mark.parametrize("style", ["fa2", "fa4"])
def test_a_call_whose_facts_show_no_tail_and_no_keyless_row_runs_only_the_kernels(style):
    q, k, v, aux, cfg = _with_facts("thd no tail")
    assert aux.packed == PackedFacts(14, 12, False)
    fwd_ops, bwd_ops = _ops_outside_the_kernel(style, q.detach(), k.detach(), v.detach(), aux, cfg)
    assert fwd_ops == [] and bwd_ops == []
    # without the facts, every clean-up runs on the device (what a context-parallel block call still does)
    fwd_ops, bwd_ops = _ops_outside_the_kernel(style, q.detach(), k.detach(), v.detach(),
                                               dataclasses.replace(aux, packed=None), cfg)
    assert DEVICE_MASKING & set(fwd_ops) and DEVICE_MASKING & set(bwd_ops)


def test_a_tail_known_on_the_host_is_cleared_by_slicing():
    q, k, v, aux, cfg = _with_facts("thd padding")  # tail of 3 rows, rows without keys possible: no
    assert aux.packed.end_q < q.shape[0] and not aux.packed.keyless_rows
    fwd_ops, bwd_ops = _ops_outside_the_kernel("fa2", q.detach(), k.detach(), v.detach(), aux, cfg)
    assert not DEVICE_MASKING & set(fwd_ops + bwd_ops)
    assert fwd_ops.count("fill_") == 2 and bwd_ops.count("fill_") == 3  # out and lse; dq, dk, dv


def test_while_a_cuda_graph_is_captured_the_facts_are_not_used_and_nothing_derived_is_cached(monkeypatch):
    """A captured call's replays may run with other cu_seqlens contents: the clean-ups must then be on the device
    and the cu_seqlens-derived tensors made inside the graph (tests/gpu/test_thd_host_gpu.py replays one)."""
    from attn_dispatch.backends import cudnn_fused as cd

    tensor_cache.clear()  # a full cache is emptied whole: what earlier tests left could drop an entry in between
    monkeypatch.setattr(_flash_io, "capturing", lambda t: True)
    q, k, v, aux, cfg = _with_facts("thd no tail")
    fwd_ops, bwd_ops = _ops_outside_the_kernel("fa2", q.detach(), k.detach(), v.detach(), aux, cfg)
    assert DEVICE_MASKING & set(fwd_ops) and DEVICE_MASKING & set(bwd_ops)
    monkeypatch.setattr(cd, "_require_cuda", lambda q: None)
    for capture in (False, True):
        monkeypatch.setattr(cd, "capturing", lambda t, capture=capture: capture)
        first, second = (cd._prepare(q, k, v, aux, cfg, io_dtypes=(q.dtype,)) for _ in range(2))
        assert (first.end_q is None) == capture and first.capturing == capture
        assert (first.lens_q is second.lens_q) != capture  # cached outside a capture only
        offsets = [cd._ragged_offsets(aux.cu_seqlens_q, torch.int64, 32, first.capturing) for _ in range(2)]
        assert (offsets[0] is offsets[1]) != capture
        assert first.lens_q.view(-1).tolist() == [5, 1, 8]


@pytest.mark.parametrize("mask, window, sq, skv", [("padding", (-1, -1), 16, 16), ("padding", (2, 1), 9, 23),
                                                   ("padding_causal", (-1, 0), 16, 16),
                                                   ("padding_causal_bottom_right", (3, 0), 24, 7),
                                                   ("padding_causal", (1, 0), 20, 6)])
def test_synthetic_calls_carry_the_facts_validation_would_give(mask, window, sq, skv):
    """Timed and probed calls (attn_dispatch.synthetic) run the path the module's calls run."""
    from attn_dispatch import AttentionParams
    from attn_dispatch.synthetic import make_call

    params = AttentionParams(dtype="float32", qkv_format="thd", batch_size=4, num_heads=2, head_dim_qk=8,
                             max_seqlen_q=sq, max_seqlen_kv=skv, attn_mask_type=mask, window_size=window,
                             device_type="cpu")
    for seed in range(4):
        call = make_call(params, seed=seed)
        assert call.aux.packed == facts_of(call.q, call.k, call.aux, mask, params.window_size)
