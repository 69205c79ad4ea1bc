"""The unfused engine against the float64 reference (tests/reference.py): forward, lse and gradients of
q, k, v, bias and the sink, over every valid format x mask x GQA x bias x window combination."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attn_dispatch.backends import get_engine
from attn_dispatch.backends.base import AttnAux, AttnConfig
from attn_dispatch.backends.unfused import UnfusedEngine, dropout_keep_mask
from attn_dispatch.params import MASK_TYPES, normalize_window
from reference import reference_attention

FP32_TOL, BF16_TOL, FP16_TOL = 1e-5, 2e-2, 1e-3
PADDING_MASKS = [m for m in MASK_TYPES if m.startswith("padding")]
GQA = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
WINDOWS = {"none": None, "window": (2, 1)}
BIASES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")
# thd sequence lengths (q, kv) and the padded slots they sit in
THD_LENS_Q, THD_LENS_KV = [5, 1, 3], [7, 2, 0]
THD_SLOTS_Q, THD_SLOTS_KV = [6, 1, 4], [7, 3, 2]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs error over the reference's max magnitude (floored at 0.1: an exactly-zero gradient, e.g. a row
    that attends one key, may come out as 1e-7)."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(0.1)).item()


def cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


class Case:
    """Random inputs for one combination, and how to run the engine and the reference on them."""

    def __init__(self, fmt="bshd", mask_type="no_mask", heads=(4, 4), bias_type="no_bias", window=None,
                 bias_shape="1hss", softmax_type="vanilla", dtype=torch.float32, sq=5, skv=7, b=2, d=8, dv=6,
                 padded_thd=False, dropout_p=0.0, seed=0, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        h, hk = heads
        if window is not None and "causal" in mask_type:
            window = (window[0], 0)  # causal masks allow right = 0 only
        self.fmt, self.mask_type, self.bias_type, self.window = fmt, mask_type, bias_type, window
        self.softmax_type, self.dropout_p = softmax_type, dropout_p
        self.aux = AttnAux()
        if fmt == "thd":
            slots_q = THD_SLOTS_Q if padded_thd else THD_LENS_Q
            slots_kv = THD_SLOTS_KV if padded_thd else THD_LENS_KV
            tq, tkv = sum(slots_q), sum(slots_kv)
            shape_q, shape_k, shape_v = (tq, h, d), (tkv, hk, d), (tkv, hk, dv)
            b, sq, skv = len(THD_LENS_Q), max(THD_LENS_Q), max(THD_LENS_KV)
            self.aux.cu_seqlens_q, self.aux.cu_seqlens_kv = cu(THD_LENS_Q), cu(THD_LENS_KV)
            if padded_thd:
                self.aux.cu_seqlens_q_padded, self.aux.cu_seqlens_kv_padded = cu(slots_q), cu(slots_kv)
        else:
            shape_q, shape_k, shape_v = ((b, sq, h, d), (b, skv, hk, d), (b, skv, hk, dv)) if fmt == "bshd" else \
                ((sq, b, h, d), (skv, b, hk, d), (skv, b, hk, dv))
            if mask_type.startswith("padding"):
                self.aux.cu_seqlens_q, self.aux.cu_seqlens_kv = cu([sq, 3]), cu([skv, 2])
        self.aux.max_seqlen_q, self.aux.max_seqlen_kv = sq, skv
        self.q = torch.randn(shape_q, generator=g).to(device, dtype).requires_grad_()
        self.k = torch.randn(shape_k, generator=g).to(device, dtype).requires_grad_()
        self.v = torch.randn(shape_v, generator=g).to(device, dtype).requires_grad_()
        self.dout = torch.randn(*shape_q[:-1], dv, generator=g).to(device, dtype)
        if mask_type == "arbitrary":
            mask = torch.rand(b, 1, sq, skv, generator=g) < 0.3
            mask[0, 0, 1] = True  # one fully masked row
            self.aux.attention_mask = mask.to(device)
        if bias_type in ("pre_scale_bias", "post_scale_bias"):
            bb = b if bias_shape[0] == "b" else 1
            bh = h if bias_shape[1] == "h" else 1
            self.aux.bias = torch.randn(bb, bh, sq, skv, generator=g).to(device, dtype).requires_grad_()
        if bias_type == "alibi":
            self.aux.alibi_slopes = (torch.rand(h, generator=g) + 0.1).to(device)
        if softmax_type == "learnable":
            self.aux.softmax_offset = torch.randn(h, generator=g).to(device).requires_grad_()
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            if getattr(self.aux, name) is not None:
                setattr(self.aux, name, getattr(self.aux, name).to(device))
        self.cfg = AttnConfig(qkv_format=fmt, attn_mask_type=mask_type, window_size=normalize_window(window, mask_type),
                              softmax_scale=1.0 / math.sqrt(d), dropout_p=dropout_p, bias_type=bias_type,
                              softmax_type=softmax_type, return_max_logit=True)
        self.b, self.h, self.sq, self.skv = b, h, sq, skv

    def leaves(self):
        extra = [t for t in (self.aux.bias, self.aux.softmax_offset) if t is not None and t.requires_grad]
        return [self.q, self.k, self.v] + extra

    def run(self, engine=None):
        engine = engine or get_engine("unfused:pytorch")
        out, lse, max_logit = engine(self.q, self.k, self.v, self.aux, self.cfg)
        grads = torch.autograd.grad(out, self.leaves(), self.dout)
        return out, lse, max_logit, grads

    def reference(self, dropout_keep=None):
        a = self.aux
        out, lse = reference_attention(
            self.q, self.k, self.v, qkv_format=self.fmt, attn_mask_type=self.mask_type, window_size=self.window,
            attention_mask=a.attention_mask, cu_seqlens_q=a.cu_seqlens_q, cu_seqlens_kv=a.cu_seqlens_kv,
            cu_seqlens_q_padded=a.cu_seqlens_q_padded, cu_seqlens_kv_padded=a.cu_seqlens_kv_padded,
            bias_type=self.bias_type, bias=a.bias, alibi_slopes=a.alibi_slopes, softmax_type=self.softmax_type,
            softmax_offset=a.softmax_offset, softmax_scale=self.cfg.softmax_scale, dropout_p=self.dropout_p,
            dropout_keep=dropout_keep)
        grads = torch.autograd.grad(out, self.leaves(), self.dout.double())
        return out, lse, grads


def assert_lse_close(lse, ref, tol):
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lse), finite), "masked rows must have lse = -inf exactly where the reference does"
    assert (lse[~finite] == float("-inf")).all()
    if finite.any():
        assert rel_err(lse[finite], ref[finite]) <= tol


def check(case: Case, tol: float, engine=None):
    out, lse, _, grads = case.run(engine)
    ref_out, ref_lse, ref_grads = case.reference()
    assert out.dtype == case.q.dtype and out.shape == ref_out.shape
    assert not any(torch.isnan(t).any() for t in (out, *grads))
    assert rel_err(out, ref_out) <= tol, f"out rel err {rel_err(out, ref_out):.2e}"
    assert_lse_close(lse, ref_lse, tol)
    for name, g, r in zip(("dq", "dk", "dv", "dextra", "dextra2"), grads, ref_grads):
        assert g.shape == r.shape
        assert rel_err(g, r) <= tol, f"{name} rel err {rel_err(g, r):.2e}"


# -------------------------------------------------------------------------------------------------
# Every valid combination, fp32
# -------------------------------------------------------------------------------------------------
DENSE = [(fmt, m) for fmt in ("bshd", "sbhd") for m in MASK_TYPES] + [("thd", m) for m in PADDING_MASKS]


@pytest.mark.parametrize("window", WINDOWS.values(), ids=WINDOWS.keys())
@pytest.mark.parametrize("bias_type", BIASES)
@pytest.mark.parametrize("heads", GQA.values(), ids=GQA.keys())
@pytest.mark.parametrize("fmt,mask_type", DENSE, ids=[f"{f}-{m}" for f, m in DENSE])
def test_every_combination_fp32(fmt, mask_type, heads, bias_type, window):
    check(Case(fmt, mask_type, heads, bias_type, window), FP32_TOL)


@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right", "padding_causal_bottom_right"])
@pytest.mark.parametrize("window", [None, (1, 0), (0, 2)])
def test_more_queries_than_keys(mask_type, window):
    """sq > skv: bottom-right alignment leaves leading rows fully masked (zeros, lse -inf)."""
    check(Case("bshd", mask_type, (4, 2), "alibi", window, sq=7, skv=5), FP32_TOL)


@pytest.mark.parametrize("bias_shape", ["1hss", "b1ss", "bhss", "11ss"])
@pytest.mark.parametrize("bias_type", ["pre_scale_bias", "post_scale_bias"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_bias_shapes_and_gradients(fmt, bias_type, bias_shape):
    mask = "padding_causal" if fmt == "thd" else "causal"
    check(Case(fmt, mask, (4, 2), bias_type, bias_shape=bias_shape), FP32_TOL)


@pytest.mark.parametrize("mask_type", ["no_mask", "causal_bottom_right", "arbitrary", "padding"])
@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_sink_softmax(fmt, softmax_type, mask_type):
    if fmt == "thd" and not mask_type.startswith("padding"):
        mask_type = "padding_causal"
    check(Case(fmt, mask_type, (4, 2), "post_scale_bias", (3, 1), softmax_type=softmax_type), FP32_TOL)


def test_alibi_slopes_per_batch_and_head():
    case = Case("bshd", "padding_causal_bottom_right", (4, 2), "alibi")
    case.aux.alibi_slopes = torch.rand(case.b, case.h) + 0.1
    check(case, FP32_TOL)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("mask_type", PADDING_MASKS)
def test_thd_with_padding_between_sequences(mask_type, padded):
    check(Case("thd", mask_type, (4, 2), "alibi", (2, 2), padded_thd=padded), FP32_TOL)


def test_head_dims_differ_and_scale():
    case = Case("bshd", "causal", (6, 3), "no_bias", d=16, dv=4)
    case.cfg = dataclasses.replace(case.cfg, softmax_scale=0.37)
    check(case, FP32_TOL)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_many_small_blocks_equal_one_block(fmt):
    """Query blocks of one row (forward and the recomputing backward) change nothing."""
    mask = "padding_causal_bottom_right" if fmt == "thd" else "causal"
    check(Case(fmt, mask, (4, 2), "post_scale_bias", (3, 0), softmax_type="learnable"), FP32_TOL,
          engine=UnfusedEngine(max_block_elems=1))


def test_float64_inputs_are_exact():
    check(Case("sbhd", "padding_causal", (4, 1), "pre_scale_bias", (2, 1), dtype=torch.float64), 1e-12)


@pytest.mark.parametrize("fmt,mask_type", [("bshd", "causal"), ("sbhd", "arbitrary"), ("thd", "padding_causal")])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, BF16_TOL), (torch.float16, FP16_TOL)], ids=["bf16", "fp16"])
def test_low_precision(dtype, tol, fmt, mask_type):
    check(Case(fmt, mask_type, (4, 2), "post_scale_bias", (2, 1), dtype=dtype, sq=33, skv=40, d=16, dv=16), tol)


# -------------------------------------------------------------------------------------------------
# Masked rows, thd vs padded bshd, max_logit, global lse
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one", "learnable"])
def test_fully_masked_rows_are_zero_not_nan(softmax_type):
    case = Case("bshd", "arbitrary", (4, 2), softmax_type=softmax_type)
    case.aux.attention_mask = torch.zeros(case.b, 1, case.sq, case.skv, dtype=torch.bool)
    case.aux.attention_mask[:, :, 2] = True
    out, lse, _, grads = case.run()
    assert (out[:, 2] == 0).all() and (lse[:, :, 2] == float("-inf")).all()
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][:, 2] == 0).all()
    check(case, FP32_TOL)


@pytest.mark.parametrize("mask_type", PADDING_MASKS)
def test_thd_equals_padded_bshd_sequence_by_sequence(mask_type):
    thd = Case("thd", mask_type, (4, 2), "alibi", (3, 1), padded_thd=True, softmax_type="learnable")
    out_t, _, _, grads_t = thd.run()
    lens_q, lens_kv = THD_LENS_Q, THD_LENS_KV
    starts_q, starts_kv = cu(THD_SLOTS_Q).tolist(), cu(THD_SLOTS_KV).tolist()
    b, sq, skv = thd.b, thd.sq, thd.skv
    q = torch.zeros(b, sq, 4, 8)
    k, v = torch.zeros(b, skv, 2, 8), torch.zeros(b, skv, 2, 6)
    dout = torch.zeros(b, sq, 4, 6)
    for i in range(b):
        q[i, :lens_q[i]] = thd.q.detach()[starts_q[i]:starts_q[i] + lens_q[i]]
        dout[i, :lens_q[i]] = thd.dout[starts_q[i]:starts_q[i] + lens_q[i]]
        k[i, :lens_kv[i]] = thd.k.detach()[starts_kv[i]:starts_kv[i] + lens_kv[i]]
        v[i, :lens_kv[i]] = thd.v.detach()[starts_kv[i]:starts_kv[i] + lens_kv[i]]
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    aux = AttnAux(cu_seqlens_q=cu(lens_q), cu_seqlens_kv=cu(lens_kv), max_seqlen_q=sq, max_seqlen_kv=skv,
                  alibi_slopes=thd.aux.alibi_slopes, softmax_offset=thd.aux.softmax_offset)
    cfg = dataclasses.replace(thd.cfg, qkv_format="bshd")
    out_b, _, _ = get_engine("unfused:pytorch")(q, k, v, aux, cfg)
    dq, dk, dv, _ = torch.autograd.grad(out_b, (q, k, v, thd.aux.softmax_offset), dout)
    for i in range(b):
        sl_q = slice(starts_q[i], starts_q[i] + lens_q[i])
        sl_kv = slice(starts_kv[i], starts_kv[i] + lens_kv[i])
        torch.testing.assert_close(out_t[sl_q], out_b[i, :lens_q[i]], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grads_t[0][sl_q], dq[i, :lens_q[i]], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grads_t[1][sl_kv], dk[i, :lens_kv[i]], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grads_t[2][sl_kv], dv[i, :lens_kv[i]], rtol=1e-6, atol=1e-6)
    # tokens between sequences get zero output and zero gradient
    gap = torch.ones(thd.q.shape[0], dtype=torch.bool)
    for i in range(b):
        gap[starts_q[i]:starts_q[i] + lens_q[i]] = False
    assert (out_t[gap] == 0).all() and (grads_t[0][gap] == 0).all()


def test_max_logit_is_the_largest_kept_score():
    case = Case("bshd", "causal", (4, 2), "post_scale_bias", (2, 0))
    _, _, max_logit, _ = case.run()
    q, k = case.q.detach().double(), case.k.detach().double().repeat_interleave(2, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * case.cfg.softmax_scale + case.aux.bias.detach().double()
    i, j = torch.arange(case.sq)[:, None], torch.arange(case.skv)[None, :]
    s = s.masked_fill(~((j <= i) & (j >= i - 2)), float("-inf"))
    assert max_logit.shape == (case.h,)
    torch.testing.assert_close(max_logit.double(), s.amax(dim=(0, 2, 3)), rtol=1e-6, atol=1e-6)


def test_backward_with_global_out_and_lse():
    """Context parallelism computes partial results over key chunks, merges them by log-sum-exp, and calls
    backward per chunk with the merged (global) out and lse; the summed gradients must be exact."""
    case = Case("bshd", "no_mask", (4, 2), "no_bias", skv=8)
    engine = get_engine("unfused:pytorch")
    halves = [slice(0, 4), slice(4, 8)]
    parts = []
    for sl in halves:
        k, v = case.k.detach()[:, sl], case.v.detach()[:, sl]
        parts.append((k, v, case.cfg, engine.forward(case.q.detach(), k, v, AttnAux(), case.cfg)))
    lse = torch.logaddexp(parts[0][3].lse, parts[1][3].lse)           # [b, h, sq]
    weights = [torch.exp(p[3].lse - lse).transpose(1, 2).unsqueeze(-1) for p in parts]
    out = sum(w * p[3].out for w, p in zip(weights, parts))
    dq = torch.zeros_like(case.q)
    dks, dvs = [], []
    for k, v, cfg, res in parts:
        g = engine.backward(case.dout, case.q.detach(), k, v, out, lse, res.state, AttnAux(), cfg)
        dq += g.dq
        dks.append(g.dk)
        dvs.append(g.dv)
    ref_out, _, (rdq, rdk, rdv) = case.reference()
    assert rel_err(out, ref_out) <= FP32_TOL
    assert rel_err(dq, rdq) <= FP32_TOL
    assert rel_err(torch.cat(dks, 1), rdk) <= FP32_TOL and rel_err(torch.cat(dvs, 1), rdv) <= FP32_TOL


def test_query_blocks_bound_the_score_memory():
    engine = UnfusedEngine(max_block_elems=4096)
    case = Case("bshd", "causal", (4, 2), sq=64, skv=64)
    from attn_dispatch.backends.unfused import _geometry, _to_bhsd
    q4, k4 = _to_bhsd(case.q, "bshd"), _to_bhsd(case.k, "bshd")
    g = _geometry(q4, k4, case.aux, case.cfg, torch.float32, None)
    rows = g.rows_per_block(engine.max_block_elems)
    assert rows * case.b * case.h * case.skv <= 4096 and rows == 8
    check(case, FP32_TOL, engine=engine)


# -------------------------------------------------------------------------------------------------
# Dropout
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,mask_type", [("bshd", "causal"), ("sbhd", "padding_causal_bottom_right"),
                                           ("thd", "padding_causal")])
def test_dropout_matches_reference_with_the_same_keep_mask(fmt, mask_type):
    """The keep mask is a pure function of (seed, b, h, row, col): rebuild it, hand it to the reference,
    and forward and every gradient must agree, with one or many query blocks."""
    for engine in (get_engine("unfused:pytorch"), UnfusedEngine(max_block_elems=7)):
        case = Case(fmt, mask_type, (4, 2), "post_scale_bias", (3, 1), softmax_type="learnable", dropout_p=0.25)
        case.aux.dropout_generator = torch.Generator().manual_seed(1234)
        out, lse, _, grads = case.run(engine)
        seed = torch.randint(0, 1 << 32, (2,), dtype=torch.int64, generator=torch.Generator().manual_seed(1234))
        keep = dropout_keep_mask(seed, case.b, case.h, case.sq, case.skv, 0.25)
        ref_out, ref_lse, ref_grads = case.reference(dropout_keep=keep)
        assert rel_err(out, ref_out) <= FP32_TOL
        assert_lse_close(lse, ref_lse, FP32_TOL)
        for g, r in zip(grads, ref_grads):
            assert rel_err(g, r) <= FP32_TOL


def test_dropout_same_seed_same_output_and_rate():
    def run(seed):
        case = Case("bshd", "no_mask", (4, 4), sq=16, skv=16, dropout_p=0.4)
        case.aux.dropout_generator = torch.Generator().manual_seed(seed)
        return case.run()
    out1, _, _, g1 = run(7)
    out2, _, _, g2 = run(7)
    out3, _, _, _ = run(8)
    assert torch.equal(out1, out2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert not torch.equal(out1, out3)
    keep = dropout_keep_mask(torch.tensor([3, 99]), 4, 16, 64, 64, 0.4)
    assert abs(keep.float().mean().item() - 0.6) < 0.01
    # rows and columns are not correlated in an obvious way
    assert keep.float().mean(dim=-1).std() < 0.1 and keep.float().mean(dim=-2).std() < 0.1


def test_dropout_in_backward_needs_the_forward_state():
    case = Case("bshd", "no_mask", dropout_p=0.1)
    engine = get_engine("unfused:pytorch")
    res = engine.forward(case.q.detach(), case.k.detach(), case.v.detach(), case.aux, case.cfg)
    with pytest.raises(ValueError, match="dropout seed"):
        engine.backward(case.dout, case.q, case.k, case.v, res.out, res.lse, None, case.aux, case.cfg)


# -------------------------------------------------------------------------------------------------
# On a GPU (run: python -m pytest -m gpu tests/test_unfused_engine.py)
# -------------------------------------------------------------------------------------------------
GPU_CASES = [("bshd", "causal", "post_scale_bias"), ("sbhd", "causal_bottom_right", "alibi"),
             ("bshd", "arbitrary", "pre_scale_bias"), ("thd", "padding_causal", "alibi"),
             ("thd", "padding_causal_bottom_right", "post_scale_bias"), ("sbhd", "padding", "no_bias")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt,mask_type,bias_type", GPU_CASES, ids=["-".join(c) for c in GPU_CASES])
def test_gpu_matches_reference(fmt, mask_type, bias_type, dtype, tol):
    check(Case(fmt, mask_type, (4, 2), bias_type, (3, 1), softmax_type="learnable", dtype=dtype, device="cuda",
               sq=37, skv=45, d=16, dv=16), tol)
    check(Case(fmt, mask_type, (4, 2), bias_type, (3, 1), dtype=dtype, device="cuda", sq=37, skv=45, d=16, dv=16),
          tol, engine=UnfusedEngine(max_block_elems=4096))


@pytest.mark.gpu
def test_gpu_dropout_matches_reference_with_the_same_keep_mask():
    case = Case("bshd", "causal", (4, 2), "post_scale_bias", (3, 0), dropout_p=0.2, device="cuda", sq=33, skv=33)
    case.aux.dropout_generator = torch.Generator(device="cuda").manual_seed(77)
    out, _, _, grads = case.run()
    seed = torch.randint(0, 1 << 32, (2,), dtype=torch.int64, device="cuda",
                         generator=torch.Generator(device="cuda").manual_seed(77))
    keep = dropout_keep_mask(seed, case.b, case.h, case.sq, case.skv, 0.2)
    # the hash is integer arithmetic, so the GPU mask equals the CPU one bit for bit
    assert torch.equal(keep.cpu(), dropout_keep_mask(seed.cpu(), case.b, case.h, case.sq, case.skv, 0.2))
    ref_out, _, ref_grads = case.reference(dropout_keep=keep)
    assert rel_err(out, ref_out) <= FP32_TOL
    assert all(rel_err(g, r) <= FP32_TOL for g, r in zip(grads, ref_grads))


@pytest.mark.gpu
def test_gpu_memory_stays_blockwise():
    """Forward + backward at S = 16384 stays under 1/8 of one [b, h, S, S] float32 score matrix (a naive
    implementation holds several of them)."""
    b, h, s, d = 1, 8, 16384, 64
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cfg = AttnConfig(qkv_format="bshd", attn_mask_type="causal", window_size=(-1, 0), softmax_scale=d ** -0.5)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, _, _ = get_engine("unfused:pytorch")(q, k, v, AttnAux(), cfg)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    score_matrix = b * h * s * s * 4
    assert extra < score_matrix / 8, (f"peak extra {extra / 2**20:.0f} MiB "
                                      f"vs score matrix {score_matrix / 2**20:.0f} MiB")
