"""mem_efficient:torch on one-query GQA calls (decode steps): the query heads of a group fold into query rows of
their key/value head, so the keys and values are passed as they are (no repeat), against the float64 reference:
outputs, lse, gradients (the op's C++ autograd and the engine's own deterministic backward), a bias taking
gradients, ALiBi, rows without keys, and the inference path (no lse, rows cleared in place). The op's contract runs
on the CPU as tests/test_mem_efficient_engine.py registers it."""
from __future__ import annotations

import collections
import math
import zlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attn_dispatch.backends.base import AttnAux, AttnConfig
from attn_dispatch.backends.mem_efficient import MemEfficientEngine
from attn_dispatch.params import normalize_window
from tests.reference import reference_attention
from tests.test_mem_efficient_engine import _op_backward, _op_forward

D = 16
F64 = torch.float64


@pytest.fixture(scope="module")
def engine():
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_efficient_attention", _op_forward, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention_backward", _op_backward, "CPU")
    yield MemEfficientEngine()
    del lib


def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _decode_call(gen, fmt, b, skv, h, hk, grad=True):
    def make(s, n):
        shape = (b, s, n, D) if fmt == "bshd" else (s, b, n, D)
        return torch.randn(shape, generator=gen, dtype=F64, requires_grad=grad)
    return make(1, h), make(skv, hk), make(skv, hk)


def _cfg(mask_type, fmt="bshd", **kw):
    return AttnConfig(qkv_format=fmt, attn_mask_type=mask_type, window_size=normalize_window(None, mask_type),
                      softmax_scale=1 / math.sqrt(D), **kw)


def _left_padded(gen, b, skv, keyless_row: int | None):
    """[b, 1, 1, skv] bool, True = masked out: row i's first keys padded, some keys inside masked too."""
    mask = torch.rand(b, 1, 1, skv, generator=gen) < 0.2
    for i in range(b):
        mask[i, ..., : i * skv // (2 * b)] = True
    if keyless_row is not None:
        mask[keyless_row] = True
    return mask


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = collections.defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes[str(func.overloadpacket)].append(tuple(out.shape) if isinstance(out, torch.Tensor) else None)
        return out


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("fmt, h, hk", [("bshd", 8, 2), ("sbhd", 6, 3), ("bshd", 4, 1)])
def test_one_query_gqa_matches_the_reference_with_gradients(engine, deterministic, fmt, h, hk):
    b, skv = 3, 37
    gen = _gen("decode", fmt, h, hk, deterministic)
    q, k, v = _decode_call(gen, fmt, b, skv, h, hk)
    mask = _left_padded(gen, b, skv, keyless_row=1)
    bias = torch.randn(1, h, 1, skv, generator=gen, dtype=F64, requires_grad=True)
    cfg = _cfg("arbitrary", fmt, bias_type="post_scale_bias", deterministic=deterministic)
    out, lse, _ = engine(q, k, v, AttnAux(attention_mask=mask, bias=bias), cfg)
    ref_out, ref_lse = reference_attention(q, k, v, qkv_format=fmt, attn_mask_type="arbitrary", attention_mask=mask,
                                           bias_type="post_scale_bias", bias=bias)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) and torch.isneginf(lse[1]).all()
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-6, atol=1e-6)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    leaves = (q, k, v, bias)
    for got, want in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(ref_out, leaves, dout)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mask_type", ["arbitrary", "no_mask", "padding"])
def test_inference_keeps_keys_and_values_as_they_are(engine, mask_type):
    """Without gradients a decode step dispatches the op on the keys and values as given (nothing of their size is
    made), no lse, and one pass writing the output in head order with rows without keys zeroed."""
    b, skv, h, hk = 4, 29, 8, 2
    gen = _gen("inference", mask_type)
    q, k, v = _decode_call(gen, "bshd", b, skv, h, hk, grad=False)
    aux, ref = AttnAux(), {}
    if mask_type == "arbitrary":
        mask = _left_padded(gen, b, skv, keyless_row=2)
        aux, ref = AttnAux(attention_mask=mask), dict(attention_mask=mask)
    elif mask_type == "padding":
        cu_q = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)
        cu_kv = torch.tensor([0, 29, 29, 40, 50], dtype=torch.int32)  # the second sequence has no key
        aux = AttnAux(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=1, max_seqlen_kv=skv)
        ref = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    ops = _Ops()
    with ops:
        out, lse, _ = engine(q, k, v, aux, _cfg(mask_type))
    ref_out, _ = reference_attention(q, k, v, attn_mask_type=mask_type, **ref)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    assert lse is None and out.is_contiguous()
    repeated = (b, h, skv, D)
    made = [(name, s) for name, shapes in ops.shapes.items() for s in shapes if s == repeated]
    assert not made, made
    assert "aten.repeat_interleave" not in ops.shapes and "aten.clone" not in ops.shapes, dict(ops.shapes)
    assert len(ops.shapes["aten._scaled_dot_product_efficient_attention"]) == 1


def test_alibi_and_longer_queries_still_match(engine):
    """Calls the fold does not take (several queries; ALiBi, whose bias differs per head, folds) stay exact."""
    b, h, hk = 2, 4, 2
    gen = _gen("alibi")
    slopes = torch.rand(h, generator=gen)
    for sq in (1, 5):
        q = torch.randn(b, sq, h, D, generator=gen, dtype=F64, requires_grad=True)
        k, v = (torch.randn(b, 23, hk, D, generator=gen, dtype=F64, requires_grad=True) for _ in range(2))
        cfg = _cfg("no_mask", bias_type="alibi")
        out, lse, _ = engine(q, k, v, AttnAux(alibi_slopes=slopes), cfg)
        ref_out, ref_lse = reference_attention(q, k, v, bias_type="alibi", alibi_slopes=slopes)
        torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
        dout = torch.randn(out.shape, generator=gen, dtype=F64)
        for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref_out, (q, k, v), dout)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("h, hk, sq, mask_heads", [(8, 2, 1, 1), (8, 2, 1, 8), (4, 4, 1, 1), (6, 3, 3, 1)])
def test_masked_binding_serves_new_masks_and_key_lengths(engine, h, hk, sq, mask_heads):
    """bind_masked's call (the SDPA function's [b, h, s, d] tensors, the mask an argument) on the masks of several
    steps, each new and of its own length and padding (a row without keys among them; one mask for every head, or
    one per head), and on a mask written in place: each output is its own mask's against the float64 reference (a
    row without keys: 0), in the op's [b, h, sq, d_v] order; the fold where there is one query, the repeat
    otherwise."""
    b = 3
    gen = _gen("bind_masked", h, hk, sq, mask_heads)

    def tensors(skv):
        return (torch.randn(b, h, sq, D, generator=gen, dtype=F64),
                *(torch.randn(b, hk, skv, D, generator=gen, dtype=F64) for _ in range(2)))

    def step_mask(skv, keyless):
        mask = _left_padded(gen, b, skv, keyless_row=keyless).expand(b, mask_heads, sq, skv).clone()
        if mask_heads > 1:
            mask[:, 1::2, ..., -2] = True  # odd heads also lose their next-to-last key
        return mask

    q, k, v = tensors(21)
    mask = step_mask(21, None)
    call = engine.bind_masked(q, k, v, AttnAux(attention_mask=mask, max_seqlen_q=sq, max_seqlen_kv=21),
                              _cfg("arbitrary"))
    assert call is not None
    steps = [(21, None), (22, 1), (23, None), (40, 0)]
    for skv, keyless in steps:
        q, k, v = tensors(skv)
        mask = step_mask(skv, keyless)
        for _ in range(2):  # a step's layers: the mask's bias made once, then found
            q, k, v = tensors(skv)
            out = call(q, k, v, mask)
            want, _ = reference_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask_type="arbitrary",
                                          attention_mask=mask)
            assert out.shape == (b, h, sq, D)
            torch.testing.assert_close(out.transpose(1, 2), want, rtol=1e-9, atol=1e-9)
            if keyless is not None:
                assert not out[keyless].any()
    written = step_mask(30, None)
    q, k, v = tensors(30)
    before = call(q, k, v, written)
    written[2] = False  # written in place: the bias follows it (row 2 now sees every key)
    out = call(q, k, v, written)
    want, _ = reference_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask_type="arbitrary",
                                  attention_mask=written)
    torch.testing.assert_close(out.transpose(1, 2), want, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(out[2], before[2]) and torch.equal(out[:2], before[:2])


def test_masked_binding_refuses_what_it_cannot_serve(engine):
    """No binding for gradients, dropout, a bias tensor, softcapping, or a call without an 'arbitrary' mask."""
    b, skv, h, hk = 2, 9, 4, 2
    gen = _gen("bind_masked_refusals")
    q = torch.randn(b, h, 1, D, generator=gen, dtype=F64)
    k, v = (torch.randn(b, hk, skv, D, generator=gen, dtype=F64) for _ in range(2))
    aux = AttnAux(attention_mask=_left_padded(gen, b, skv, None))
    assert engine.bind_masked(q, k, v, aux, _cfg("arbitrary")) is not None
    assert engine.bind_masked(q.requires_grad_(), k, v, aux, _cfg("arbitrary")) is None
    q.requires_grad_(False)
    assert engine.bind_masked(q, k, v, aux, _cfg("arbitrary", dropout_p=0.1)) is None
    assert engine.bind_masked(q, k, v, aux, _cfg("arbitrary", bias_type="post_scale_bias")) is None
    assert engine.bind_masked(q, k, v, aux, _cfg("arbitrary", softcap=5.0)) is None
    assert engine.bind_masked(q, k, v, AttnAux(), _cfg("no_mask")) is None
