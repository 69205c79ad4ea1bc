"""flex_attention:torch on the CPU (torch runs FlexAttention eagerly there, inference only) against the float64
reference: outputs and the LSE for every mask kind, bias, ALiBi, softcap, GQA, packed sequences, a user's own
mask_mod / score_mod; fully masked rows; the BlockMask built once per tensor and version; bad input."""
from __future__ import annotations

import math
import zlib
from unittest.mock import patch

import pytest
import torch

from attn_dispatch.backends import _flex_masks
from attn_dispatch.backends.base import AttnAux, AttnConfig
from attn_dispatch.backends.flex_attention import FlexAttentionEngine, FlexFlashEngine, describe_mask
from attn_dispatch.constraints.flex_attention import CPU_BACKWARD_ERROR
from attn_dispatch.params import normalize_window
from tests.reference import reference_attention

D = 16
F64 = torch.float64


@pytest.fixture(scope="module")
def engine():
    return FlexAttentionEngine()


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _qkv(gen, fmt, b, sq, skv, h, hk, dv=D):
    def shape(s, n, d):
        return {"bshd": (b, s, n, d), "sbhd": (s, b, n, d), "thd": (s, n, d)}[fmt]
    return (torch.randn(shape(sq, h, D), generator=gen, dtype=F64),
            torch.randn(shape(skv, hk, D), generator=gen, dtype=F64),
            torch.randn(shape(skv, hk, dv), generator=gen, dtype=F64))


def _cfg(mask_type="no_mask", window=None, fmt="bshd", **kw):
    return AttnConfig(qkv_format=fmt, attn_mask_type=mask_type, window_size=normalize_window(window, mask_type),
                      softmax_scale=1 / math.sqrt(D), **kw)


def _assert_matches(got, want):
    (out, lse), (ref_out, ref_lse) = got, want
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows without keys differ"
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-9, atol=1e-9)


def _run(engine, q, k, v, aux, cfg):
    out, lse, _ = engine(q, k, v, aux, cfg)
    return out, lse


@pytest.mark.parametrize("fmt, mask_type, window, sq, skv, h, hk", [
    ("bshd", "no_mask", None, 70, 70, 4, 4),
    ("bshd", "causal", None, 50, 90, 4, 2),
    ("sbhd", "causal", None, 50, 90, 4, 2),
    ("bshd", "causal_bottom_right", None, 90, 50, 4, 1),     # sq > skv: the first rows see no key
    ("sbhd", "causal_bottom_right", None, 90, 50, 4, 1),
    ("bshd", "causal_bottom_right", (16, 0), 70, 130, 2, 2),
    ("bshd", "no_mask", (9, 5), 70, 70, 2, 1),
])
def test_structured_masks_and_gqa(engine, fmt, mask_type, window, sq, skv, h, hk):
    q, k, v = _qkv(_gen(fmt, mask_type, window, sq), fmt, 2, sq, skv, h, hk)
    cfg = _cfg(mask_type, window, fmt)
    got = _run(engine, q, k, v, AttnAux(), cfg)
    _assert_matches(got, reference_attention(q, k, v, qkv_format=fmt, attn_mask_type=mask_type,
                                             window_size=cfg.window_size))
    if mask_type == "causal_bottom_right" and sq > skv:
        assert got[0][:, : sq - skv].abs().max() == 0 if fmt == "bshd" else got[0][: sq - skv].abs().max() == 0


@pytest.mark.parametrize("mask_type, window", [("padding", None), ("padding_causal", None),
                                                ("padding_causal_bottom_right", (7, 0))])
def test_padding_masks(engine, mask_type, window):
    b, sq, skv = 3, 40, 48
    q, k, v = _qkv(_gen(mask_type), "bshd", b, sq, skv, 4, 2)
    cu_q = torch.tensor([0, 40, 53, 53], dtype=torch.int32)      # the last sequence has no query
    cu_kv = torch.tensor([0, 30, 78, 100], dtype=torch.int32)
    aux = AttnAux(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=sq, max_seqlen_kv=skv)
    cfg = _cfg(mask_type, window)
    _assert_matches(_run(engine, q, k, v, aux, cfg),
                    reference_attention(q, k, v, attn_mask_type=mask_type, window_size=cfg.window_size,
                                        cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv))


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("mask_type, window", [("padding", None), ("padding_causal", (3, 0)),
                                                ("padding_causal_bottom_right", None)])
def test_packed_sequences(engine, gaps, mask_type, window):
    cu_q = torch.tensor([0, 20, 33, 60], dtype=torch.int32)
    cu_kv = torch.tensor([0, 30, 40, 70], dtype=torch.int32)
    extra = {}
    tq, tkv = 64, 72   # tokens past the last sequence belong to none: output 0, lse -inf
    if gaps:
        extra = dict(cu_seqlens_q_padded=torch.tensor([0, 22, 40, 80], dtype=torch.int32),
                     cu_seqlens_kv_padded=torch.tensor([0, 30, 45, 100], dtype=torch.int32))
        tq, tkv = 90, 110
    q, k, v = _qkv(_gen(gaps, mask_type), "thd", 1, tq, tkv, 4, 2)
    aux = AttnAux(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=27, max_seqlen_kv=30, **extra)
    cfg = _cfg(mask_type, window, "thd")
    _assert_matches(_run(engine, q, k, v, aux, cfg),
                    reference_attention(q, k, v, qkv_format="thd", attn_mask_type=mask_type,
                                        window_size=cfg.window_size, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **extra))


def _random_mask(gen, shape, p=0.4):
    return torch.rand(shape, generator=gen) < p   # True = masked out


@pytest.mark.parametrize("shape", ["bhss", "11ss", "b1ss", "b11s (keys only)", "ss (2-D)", "expanded b11s"])
def test_arbitrary_masks_of_every_broadcastable_shape(engine, shape):
    b, h, sq, skv = 2, 4, 40, 56
    gen = _gen(shape)
    q, k, v = _qkv(gen, "bshd", b, sq, skv, h, 2)
    dims = {"bhss": (b, h, sq, skv), "11ss": (1, 1, sq, skv), "b1ss": (b, 1, sq, skv),
            "b11s (keys only)": (b, 1, 1, skv), "ss (2-D)": (sq, skv), "expanded b11s": (b, 1, 1, skv)}[shape]
    mask = _random_mask(gen, dims)
    if shape == "expanded b11s":
        mask = mask.expand(b, 1, sq, skv)
    full = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(-1, -1, sq, skv)
    if shape == "bhss":  # fully masked rows: zeros and -inf, as SDPA's
        mask[0, 1, 5] = True
        mask[1, :, 7:9] = True
    _assert_matches(_run(engine, q, k, v, AttnAux(attention_mask=mask), _cfg("arbitrary")),
                    reference_attention(q, k, v, attn_mask_type="arbitrary", attention_mask=full.contiguous()))


def test_fully_masked_rows_give_zeros(engine):
    b, h, sq, skv = 1, 2, 33, 33
    q, k, v = _qkv(_gen("rows"), "bshd", b, sq, skv, h, h)
    mask = torch.zeros(b, h, sq, skv, dtype=torch.bool)
    mask[0, 0, 3] = True
    mask[0, :, 20:] = True
    out, lse = _run(engine, q, k, v, AttnAux(attention_mask=mask), _cfg("arbitrary"))
    assert out[0, 3, 0].abs().max() == 0 and out[0, 20:].abs().max() == 0
    assert torch.isneginf(lse[0, 0, 3]) and torch.isneginf(lse[0, :, 20:]).all()
    assert torch.isfinite(lse[0, 1, :20]).all() and not torch.isnan(out).any()


@pytest.mark.parametrize("bias_type, shape, mask_type", [
    ("post_scale_bias", "1hss", "causal"), ("pre_scale_bias", "b1ss", "no_mask"),
    ("post_scale_bias", "bhss", "causal_bottom_right"), ("pre_scale_bias", "11ss", "no_mask"),
])
def test_bias_tensors(engine, bias_type, shape, mask_type):
    b, h, sq, skv = 2, 4, 40, 48
    gen = _gen(bias_type, shape)
    q, k, v = _qkv(gen, "bshd", b, sq, skv, h, 4)
    dims = {"1hss": (1, h), "b1ss": (b, 1), "bhss": (b, h), "11ss": (1, 1)}[shape]
    bias = torch.randn(*dims, sq, skv, generator=gen, dtype=F64)
    cfg = _cfg(mask_type, bias_type=bias_type)
    _assert_matches(_run(engine, q, k, v, AttnAux(bias=bias), cfg),
                    reference_attention(q, k, v, attn_mask_type=mask_type, bias_type=bias_type, bias=bias))


def test_bias_on_packed_sequences(engine):
    cu = torch.tensor([0, 20, 45], dtype=torch.int32)
    q, k, v = _qkv(_gen("thd bias"), "thd", 1, 45, 45, 2, 2)
    bias = torch.randn(2, 2, 25, 25, generator=_gen("bias"), dtype=F64)
    aux = AttnAux(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=25, max_seqlen_kv=25, bias=bias)
    cfg = _cfg("padding_causal", fmt="thd", bias_type="post_scale_bias")
    _assert_matches(_run(engine, q, k, v, aux, cfg),
                    reference_attention(q, k, v, qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu,
                                        cu_seqlens_kv=cu, bias_type="post_scale_bias", bias=bias))


@pytest.mark.parametrize("slopes_shape, mask_type, fmt", [("h", "causal_bottom_right", "bshd"),
                                                           ("bh", "padding_causal", "bshd"), ("bh", "padding", "thd")])
def test_alibi_with_padding(engine, slopes_shape, mask_type, fmt):
    b, h = 3, 4
    cu_q = torch.tensor([0, 20, 31, 50], dtype=torch.int32)
    cu_kv = torch.tensor([0, 24, 31, 60], dtype=torch.int32)
    gen = _gen(slopes_shape, mask_type, fmt)
    slopes = torch.rand((h,) if slopes_shape == "h" else (b, h), generator=gen, dtype=torch.float32)
    padded = mask_type.startswith("padding")
    if fmt == "thd":
        q, k, v = _qkv(gen, "thd", 1, 50, 60, h, 2)
    else:
        q, k, v = _qkv(gen, "bshd", b, 20, 29, h, 2)
    lens = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv) if padded else {}
    aux = AttnAux(max_seqlen_q=20, max_seqlen_kv=29, alibi_slopes=slopes, **lens)
    got = _run(engine, q, k, v, aux, _cfg(mask_type, fmt=fmt, bias_type="alibi"))
    want = reference_attention(q, k, v, qkv_format=fmt, attn_mask_type=mask_type, bias_type="alibi",
                               alibi_slopes=slopes, **lens)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)  # slopes are float32
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1]))
    torch.testing.assert_close(got[1][torch.isfinite(want[1])], want[1][torch.isfinite(want[1])], rtol=1e-6,
                               atol=1e-6)


def _dense_reference(q4, k4, v4, keep, score_fn):
    """[b, h, s, d] float64 attention with a keep mask [b|1, h|1, sq, skv] and a score function of the scaled
    scores; rows without keys give 0 and lse -inf."""
    group = q4.shape[1] // k4.shape[1]
    k4, v4 = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1)
    s = score_fn(q4 @ k4.transpose(-1, -2) / math.sqrt(D)).masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(keep, torch.exp(s - lse.unsqueeze(-1).clamp(min=-1e300)), torch.zeros_like(s))
    return p @ v4, lse


def test_softcap_with_bias_and_causal(engine):
    b, h, s, cap = 2, 2, 45, 3.0
    gen = _gen("softcap")
    q, k, v = _qkv(gen, "bshd", b, s, s, h, h)
    bias = torch.randn(1, h, s, s, generator=gen, dtype=F64)
    cfg = _cfg("causal", softcap=cap, bias_type="post_scale_bias")
    out, lse = _run(engine, q, k, v, AttnAux(bias=bias), cfg)
    keep = torch.ones(s, s, dtype=torch.bool).tril()
    ref_out, ref_lse = _dense_reference(*(x.transpose(1, 2) for x in (q, k, v)), keep,
                                        lambda x: cap * torch.tanh(x / cap) + bias)
    _assert_matches((out, lse), (ref_out.transpose(1, 2), ref_lse))


def test_user_mask_mod_and_score_mod(engine):
    b, h, s, prefix = 2, 4, 50, 12
    gen = _gen("user mods")
    q, k, v = _qkv(gen, "bshd", b, s, s, h, 2)
    rel = torch.randn(h, 2 * s, generator=gen, dtype=F64)

    def prefix_lm(b_, h_, q_idx, kv_idx):
        return (kv_idx < prefix) | (kv_idx <= q_idx)

    def relative(score, b_, h_, q_idx, kv_idx):
        return score + rel[h_, q_idx - kv_idx + s]
    cu = torch.tensor([0, 50, 90], dtype=torch.int32)    # ANDed with the call's own padding mask
    aux = AttnAux(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s,
                  extra={"mask_mod": prefix_lm, "score_mod": relative})
    out, lse = _run(engine, q, k, v, aux, _cfg("padding"))
    i, j = torch.arange(s).view(s, 1), torch.arange(s).view(1, s)
    lens = torch.tensor([50, 40]).view(b, 1, 1, 1)
    keep = ((j < prefix) | (j <= i)) & (i < lens) & (j < lens)
    ref_out, ref_lse = _dense_reference(*(x.transpose(1, 2) for x in (q, k, v)), keep,
                                        lambda x: x + rel[:, (i - j + s)].unsqueeze(0))
    _assert_matches((out, lse), (ref_out.transpose(1, 2), ref_lse))


def test_block_mask_is_built_once_per_tensor_and_version(engine, monkeypatch):
    builds = []
    real = _flex_masks._from_dense
    monkeypatch.setattr(_flex_masks, "_from_dense", lambda *a: builds.append(1) or real(*a))
    b, h, s = 1, 2, 40
    gen = _gen("cache")
    q, k, v = _qkv(gen, "bshd", b, s, s, h, h)
    mask = _random_mask(gen, (b, 1, s, s))
    cfg = _cfg("arbitrary")
    for _ in range(3):
        _assert_matches(_run(engine, q, k, v, AttnAux(attention_mask=mask), cfg),
                        reference_attention(q, k, v, attn_mask_type="arbitrary", attention_mask=mask))
    assert len(builds) == 1
    mask[0, 0, :, :20] = True  # an in-place write: a new version, a new BlockMask
    _assert_matches(_run(engine, q, k, v, AttnAux(attention_mask=mask), cfg),
                    reference_attention(q, k, v, attn_mask_type="arbitrary", attention_mask=mask))
    assert len(builds) == 2


def test_packed_block_mask_is_built_once_per_cu_seqlens(engine, monkeypatch):
    builds = []
    real = _flex_masks._from_bounds
    monkeypatch.setattr(_flex_masks, "_from_bounds", lambda *a, **kw: builds.append(1) or real(*a, **kw))
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    q, k, v = _qkv(_gen("packed cache"), "thd", 1, 40, 40, 2, 2)
    aux = AttnAux(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=23, max_seqlen_kv=23)
    for _ in range(2):
        _run(engine, q, k, v, aux, _cfg("padding_causal", fmt="thd"))
    assert len(builds) == 1


def test_the_block_mask_cache_holds_no_mask_tensor(engine):
    """A mask that changes every step must not stay alive in the cache."""
    import gc
    import weakref

    q, k, v = _qkv(_gen("leak"), "bshd", 1, 40, 40, 2, 2)
    mask = _random_mask(_gen("leak mask"), (1, 1, 40, 40))
    ref = weakref.ref(mask)
    _run(engine, q, k, v, AttnAux(attention_mask=mask), _cfg("arbitrary"))
    del mask
    gc.collect()
    assert ref() is None


def test_a_dense_mask_is_said_to_give_no_sparsity():
    s = 300
    nothing_masked = torch.zeros(1, 1, s, s, dtype=torch.bool)
    assert "no sparsity" in describe_mask(nothing_masked, 1, 2, s, s)
    documents = torch.ones(s, s, dtype=torch.bool)
    documents[:128, :128] = False
    documents[128:, 128:] = False
    text = describe_mask(documents.view(1, 1, s, s), 1, 2, s, s)
    # 3 x 3 tiles: four cross-document tiles are skipped; the edge tiles of the second document are partial (the
    # rows/keys past 300 count as masked), its first tile and the first document's are full
    assert "skips 4 of 9" in text and "2 are fully attended, 3 partly" in text, text


@pytest.mark.parametrize("mod, words", [
    (lambda b, h, q_idx: q_idx >= 0, ["mask_mod", "(b, h, q_idx, kv_idx)", "4 positional"]),
    (lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).float(), ["mask_mod", "bool tensor", "float"]),
    ("causal", ["mask_mod", "str", "function of (b, h, q_idx, kv_idx)"]),
])
def test_a_bad_mask_mod_is_a_clear_error(engine, mod, words):
    q, k, v = _qkv(_gen("bad"), "bshd", 1, 20, 20, 2, 2)
    with pytest.raises(ValueError) as info:
        _run(engine, q, k, v, AttnAux(extra={"mask_mod": mod}), _cfg())
    for word in words:
        assert word in str(info.value), str(info.value)


def test_a_bad_score_mod_is_a_clear_error(engine):
    q, k, v = _qkv(_gen("bad score"), "bshd", 1, 20, 20, 2, 2)
    with pytest.raises(ValueError, match=r"score_mod.*\(score, b, h, q_idx, kv_idx\)"):
        _run(engine, q, k, v, AttnAux(extra={"score_mod": lambda score, b, h: score}), _cfg())


@pytest.mark.parametrize("shape", [(1, 2, 21, 20), (3, 1, 20, 20), (2, 1, 1, 1, 20)])
def test_a_mask_of_the_wrong_shape_is_a_clear_error(engine, shape):
    q, k, v = _qkv(_gen("bad mask"), "bshd", 2, 20, 20, 2, 2)
    mask = torch.zeros(shape, dtype=torch.bool)
    with pytest.raises(ValueError) as info:
        _run(engine, q, k, v, AttnAux(attention_mask=mask), _cfg("arbitrary"))
    assert f"attention_mask has shape {list(shape)}" in str(info.value)
    assert "[1 or 2, 1 or 2, 1 or 20, 1 or 20]" in str(info.value)


def test_cpu_training_fails_with_the_error_the_table_cites(engine):
    q, k, v = _qkv(_gen("grad"), "bshd", 1, 20, 20, 2, 2)
    q.requires_grad_(True)
    with pytest.raises(NotImplementedError) as info:
        _run(engine, q, k, v, AttnAux(), _cfg("causal"))
    assert str(info.value) == CPU_BACKWARD_ERROR


def test_a_compiled_copy_serves_one_grad_mode_head_configuration_and_dtype():
    """torch.compile's recompile limit is per code object: each fact that costs a recompile (grad mode, head counts,
    head dims, dtype) gets its own copy of the call, and sequence lengths (dynamic after one recompile) do not."""
    kind = (True, "padding_causal", (-1, 0), "no_bias", False, False, False, True)

    def key(t=100, h=8, hk=2, d=64, dv=64, dtype=torch.bfloat16, grad=True):
        q4, k4, v4 = torch.empty(1, h, t, d, dtype=dtype), torch.empty(1, hk, t, d, dtype=dtype), \
            torch.empty(1, hk, t, dv, dtype=dtype)
        with torch.set_grad_enabled(grad):
            return FlexAttentionEngine.compiled_key(kind, q4, k4, v4)

    assert key(t=100) == key(t=4000)
    others = [key(grad=False), key(h=16), key(hk=8), key(d=128), key(dv=128), key(dtype=torch.float16)]
    assert len({key(), *others}) == 1 + len(others)
    assert all(k[:len(kind)] == kind for k in others)


def _twice_plus_one(x):
    return x * 2 + 1


def test_compiled_copies_of_two_keys_do_not_share_dynamic_shapes(monkeypatch):
    """dynamo keys its automatic-dynamic state by file, line and code name: copies that shared a name shared it, and
    one copy's varying sizes made the other's symbolic from its first call."""
    from torch._dynamo.utils import counters

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn: compile_(fn, backend="eager"))  # no C++ toolchain needed
    first, second = (_flex_masks.compiled_copy(_twice_plus_one, "copy", (kind,)) for kind in ("first", "second"))
    first(torch.randn(4))
    first(torch.randn(6))  # the first copy's length turns dynamic after one recompile
    before = counters["stats"]["unique_graphs"]
    second(torch.randn(8))
    second(torch.randn(10))
    assert counters["stats"]["unique_graphs"] - before == 2  # the second starts static, as a copy of its own


def test_a_compiled_copy_is_named_by_its_engine_and_key_alike_in_every_engine_instance():
    def name(engine):
        q4 = torch.empty(1, 8, 100, 64, dtype=torch.bfloat16, device="meta")
        kind = (True, "padding_causal", (-1, 0), "no_bias", False, False, False, True)
        with patch.object(torch, "compile", lambda fn: fn):
            compiled = engine._kernel(torch.device("cuda"), engine.compiled_key(kind, q4, q4, q4))
        return compiled.__code__.co_name

    flash = object.__new__(FlexFlashEngine)  # flash_attn.cute is not installed on the CPU runner
    FlexAttentionEngine.__init__(flash)
    assert name(FlexAttentionEngine()) == name(FlexAttentionEngine()) != name(flash)
    assert name(flash).startswith("flex_attention_flash_attn_4_")
