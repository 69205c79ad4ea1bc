"""mem_efficient:torch's glue on the CPU against the float64 reference: layouts, GQA, the additive bias it builds
(bool masks, padding from cu_seqlens, a bottom-right diagonal, ALiBi) plus a call's own bias, rows without keys,
the LSE, and gradients through both paths (the op's C++ autograd, and the engine's own backward used under a
deterministic backward), bias gradients reduced to the bias's shape.

torch has no CPU kernel for aten::_scaled_dot_product_efficient_attention, so this module registers the op's
contract (outputs, lse rows padded to 32, its backward) in float64 for the CPU, for these tests only; the CUDA
kernels themselves are checked by tests/gpu/test_masked_engines_gpu.py."""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from attn_dispatch.backends.base import AttnAux, AttnConfig
from attn_dispatch.backends.mem_efficient import MemEfficientEngine
from attn_dispatch.params import normalize_window
from tests.reference import reference_attention

D = 16
F64 = torch.float64


def _scores(q, k, bias, is_causal, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    if is_causal:
        sq, skv = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, skv, dtype=torch.bool).triu(1), float("-inf"))
    return s


def _op_forward(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, *, scale=None):
    assert dropout_p == 0.0 and q.shape[1] == k.shape[1] == v.shape[1]
    assert bias is None or (bias.dtype == q.dtype and bias.stride(-1) == 1
                            and all(st % 16 == 0 for st in bias.stride()[:-1])), "unaligned bias"
    s = _scores(q, k, bias, is_causal, scale)
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v
    pad = (-lse.shape[-1]) % 32
    lse = torch.nn.functional.pad(lse.float(), (0, pad), value=float("nan"))  # the kernel's rows past sq: unused
    return out, lse, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def _op_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout_p, mask, is_causal=False, *, scale=None):
    s = _scores(q, k, bias, is_causal, scale)
    p = torch.exp(s - lse[..., : s.shape[-2]].to(s.dtype).unsqueeze(-1))
    dv = p.transpose(-1, -2) @ dout
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    dq, dk = ds @ k * scale, ds.transpose(-1, -2) @ q * scale
    dbias = ds.contiguous() if mask[3] else None
    return dq, dk, dv, dbias


@pytest.fixture(scope="module")
def engine():
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_efficient_attention", _op_forward, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention_backward", _op_backward, "CPU")
    yield MemEfficientEngine()
    del lib


def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _qkv(gen, fmt, b, sq, skv, h, hk):
    def make(s, n):
        shape = (b, s, n, D) if fmt == "bshd" else (s, b, n, D)
        return torch.randn(shape, generator=gen, dtype=F64, requires_grad=True)
    return make(sq, h), make(skv, hk), make(skv, hk)


def _cfg(mask_type="no_mask", fmt="bshd", **kw):
    return AttnConfig(qkv_format=fmt, attn_mask_type=mask_type, window_size=normalize_window(None, mask_type),
                      softmax_scale=1 / math.sqrt(D), **kw)


def _check(engine, q, k, v, aux, cfg, ref_kwargs, leaves):
    out, lse, _ = engine(q, k, v, aux, cfg)
    ref_out, ref_lse = reference_attention(q, k, v, qkv_format=cfg.qkv_format, attn_mask_type=cfg.attn_mask_type,
                                           **ref_kwargs)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-6, atol=1e-6)  # lse is float32
    dout = torch.randn(out.shape, generator=_gen("dout", out.shape), dtype=F64)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref_out, leaves, dout)
    for g, w in zip(got, want):  # the op keeps its lse in float32, which the backward reads
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("fmt, mask_type, sq, skv, h, hk", [
    ("bshd", "causal", 40, 40, 4, 2),
    ("sbhd", "causal_bottom_right", 40, 56, 4, 1),   # sq != skv: the diagonal goes into the bias
    ("bshd", "causal_bottom_right", 56, 40, 2, 2),   # the first rows see no key: 0 and -inf
    ("bshd", "no_mask", 33, 47, 2, 2),               # rows of 47 keys: the bias needs no padding, but the LSE does
])
def test_structured_masks_gqa_and_both_backward_paths(engine, deterministic, fmt, mask_type, sq, skv, h, hk):
    q, k, v = _qkv(_gen(fmt, mask_type, sq), fmt, 2, sq, skv, h, hk)
    _check(engine, q, k, v, AttnAux(), _cfg(mask_type, fmt, deterministic=deterministic), {}, (q, k, v))


@pytest.mark.parametrize("deterministic", [False, True])
def test_arbitrary_mask_with_a_bias_that_takes_gradients(engine, deterministic):
    b, h, sq, skv = 2, 4, 40, 45
    gen = _gen("mask bias", deterministic)
    q, k, v = _qkv(gen, "bshd", b, sq, skv, h, 2)
    mask = torch.rand(b, 1, sq, skv, generator=gen) < 0.4
    mask[0, 0, 3] = True                                    # a row without keys
    bias = torch.randn(1, h, sq, skv, generator=gen, dtype=F64, requires_grad=True)
    cfg = _cfg("arbitrary", bias_type="post_scale_bias", deterministic=deterministic)
    _check(engine, q, k, v, AttnAux(attention_mask=mask, bias=bias), cfg,
           dict(attention_mask=mask, bias_type="post_scale_bias", bias=bias), (q, k, v, bias))


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_padding_with_alibi(engine, mask_type):
    b, h, sq, skv = 3, 4, 24, 30
    gen = _gen("alibi", mask_type)
    q, k, v = _qkv(gen, "bshd", b, sq, skv, h, 4)
    cu_q = torch.tensor([0, 24, 35, 35], dtype=torch.int32)   # the last sequence has no query
    cu_kv = torch.tensor([0, 20, 50, 60], dtype=torch.int32)
    slopes = torch.rand(b, h, generator=gen)
    aux = AttnAux(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=sq, max_seqlen_kv=skv, alibi_slopes=slopes)
    _check(engine, q, k, v, aux, _cfg(mask_type, bias_type="alibi"),
           dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, bias_type="alibi", alibi_slopes=slopes), (q, k, v))


def test_pre_scale_bias_gradient_keeps_its_shape(engine):
    b, h, s = 2, 2, 24
    gen = _gen("pre")
    q, k, v = _qkv(gen, "bshd", b, s, s, h, h)
    bias = torch.randn(b, 1, s, s, generator=gen, dtype=F64, requires_grad=True)
    for deterministic in (False, True):
        cfg = _cfg("causal", bias_type="pre_scale_bias", deterministic=deterministic)
        _check(engine, q, k, v, AttnAux(bias=bias), cfg, dict(bias_type="pre_scale_bias", bias=bias),
               (q, k, v, bias))


def test_a_mask_that_changes_every_step_is_not_kept(engine):
    import gc
    import weakref

    q, k, v = _qkv(_gen("steps"), "bshd", 1, 20, 20, 2, 2)
    mask = torch.rand(1, 1, 20, 20, generator=_gen("m")) < 0.3
    ref = weakref.ref(mask)
    engine(q, k, v, AttnAux(attention_mask=mask), _cfg("arbitrary"))
    del mask
    gc.collect()
    assert ref() is None


def test_a_custom_dropout_generator_is_refused(engine):
    q, k, v = _qkv(_gen("gen"), "bshd", 1, 20, 20, 2, 2)
    aux = AttnAux(dropout_generator=torch.Generator())
    with pytest.raises(ValueError, match="dropout_generator"):
        engine(q, k, v, aux, _cfg("causal", dropout_p=0.1))


def test_a_mask_written_in_place_is_read_again(engine):
    """The bias an 'arbitrary' mask gives is kept on the mask per version: an in-place write (a new version) is
    seen by the next call, and the same mask at other sizes gets its own bias."""
    gen = _gen("in place")
    mask = torch.rand(2, 1, 1, 24, generator=gen) < 0.3
    for sq, skv in ((1, 24), (1, 24), (5, 24)):
        q, k, v = _qkv(gen, "bshd", 2, sq, skv, 4, 2)
        with torch.no_grad():  # one mask tensor for every call, broadcast over the queries
            out, _, _ = engine(q, k, v, AttnAux(attention_mask=mask), _cfg("arbitrary"))
        want, _ = reference_attention(q, k, v, attn_mask_type="arbitrary", attention_mask=mask)
        torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
        mask[0, ..., :7] = ~mask[0, ..., :7]  # in place: the next call reads the new mask
