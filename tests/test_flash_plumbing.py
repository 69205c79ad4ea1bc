"""The FlashAttention engines' shared plumbing (backends/_flash_io.py), on the CPU.

The kernels only run on a GPU, so a stand-in kernel with FlashAttention's conventions (bshd or packed varlen
inputs, bottom-right windows, FA2's +inf or flash-attn-4's sink-valued lse for empty rows, unwritten rows past
the last sequence left as NaN) runs in their place. Everything around it - sbhd views, padding -> varlen
packing, thd tails, top-left checks, lse conventions, sink gradients - is compared with tests/reference.py.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attn_dispatch.backends import EngineUnavailableError, get_engine
from attn_dispatch.backends._flash_io import FlashEngineBase, KernelCall, Varlen, bind_supported
from attn_dispatch.backends.base import AttnAux, AttnConfig
from attn_dispatch.params import normalize_window
from reference import reference_attention

F64 = torch.float64


class StandInKernel(FlashEngineBase):
    """FlashAttention's contract, computed densely in float64."""

    family, provider = "flash_attn_2", "stand-in"
    supports_alibi = True
    supports_sink = True

    def __init__(self, style: str):
        self.style = style
        self.empty_rows_lse_positive_inf = style == "fa2"
        self.takes_out_buffer = style == "fa4"
        self.seen_lse: list[torch.Tensor] = []

    def _scores(self, q, k, call: KernelCall, slopes):
        sq, sk, h = q.shape[0], k.shape[0], q.shape[1]
        kh = k.repeat_interleave(h // k.shape[1], dim=1)
        s = torch.einsum("qhd,khd->hqk", q, kh) * call.scale
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        keep = torch.ones(sq, sk, dtype=torch.bool)
        left, right = call.window
        if left >= 0:
            keep &= j >= i + sk - sq - left
        if right >= 0:
            keep &= j <= i + sk - sq + right
        if slopes is not None:
            s = s - slopes[:, None, None] * (i + sk - sq - j).abs()
        return s.masked_fill(~keep, float("-inf")), keep

    def _one(self, q, k, v, call: KernelCall, slopes):
        h, sq = q.shape[1], q.shape[0]
        s, keep = self._scores(q, k, call, slopes)
        sink = None if call.sink is None else call.sink.to(F64)
        columns = s if sink is None else torch.cat([s, sink[:, None, None].expand(h, sq, 1)], -1)
        lse = torch.logsumexp(columns, dim=-1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        out = torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(h // v.shape[1], dim=1))
        empty = ~keep.any(-1).expand(h, sq)
        if self.style == "fa2":
            lse = lse.masked_fill(empty, float("inf"))
        elif sink is not None:
            lse = torch.where(empty, sink[:, None].expand(h, sq), lse)
        return out, lse

    def _one_backward(self, q, k, v, o, do, lse, call: KernelCall, slopes):
        """FlashAttention's backward: P from the given (global) lse, D = rowsum(dO * O) from the given out."""
        h, hk = q.shape[1], k.shape[1]
        s, _ = self._scores(q, k, call, slopes)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0, posinf=math.inf)
        vh = v.repeat_interleave(h // hk, dim=1)
        kh = k.repeat_interleave(h // hk, dim=1)
        d = (do * o).sum(-1).t()                                   # [h, sq]
        ds = p * (torch.einsum("qhd,khd->hqk", do, vh) - d[..., None])
        dq = torch.einsum("hqk,khd->qhd", ds, kh) * call.scale
        group = lambda x: x.view(x.shape[0], hk, h // hk, x.shape[-1]).sum(2)  # noqa: E731
        dk = group(torch.einsum("hqk,qhd->khd", ds, q) * call.scale)
        dv = group(torch.einsum("hqk,qhd->khd", p, do))
        dsink = None if call.sink is None else -(torch.exp(call.sink.to(F64)[:, None] - lse) * d).sum(-1)
        return dq, dk, dv, dsink

    def _sequences(self, q, k, varlen: Varlen | None):
        if varlen is None:
            return [(b, b, b) for b in range(q.shape[0])]
        cq, ck = varlen.cu_seqlens_q.tolist(), varlen.cu_seqlens_kv.tolist()
        return [(b, slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]

    def _slopes(self, call: KernelCall, b: int):
        slopes = call.alibi_slopes
        return None if slopes is None else (slopes[b] if slopes.dim() == 2 else slopes).to(F64)

    def _kernel_fwd(self, q, k, v, varlen, call, out):
        result = torch.full((*q.shape[:-1], v.shape[-1]), float("nan"), dtype=q.dtype)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]) if varlen is None else (q.shape[1], q.shape[0]),
                         float("nan"))
        for b, sq, sk in self._sequences(q, k, varlen):
            o, seq_lse = self._one(q[sq].to(F64), k[sk].to(F64), v[sk].to(F64), call, self._slopes(call, b))
            result[sq] = o.to(q.dtype)
            if varlen is None:
                lse[b] = seq_lse.float()
            else:
                lse[:, sq] = seq_lse.float()
        if out is not None:
            out.copy_(result)
            result = out
        return result, lse, "state"

    def _kernel_bwd(self, dout, q, k, v, out, lse, kernel_state, varlen, call):
        assert kernel_state == "state"
        self.seen_lse.append(lse)
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))  # rows past the sequences stay unwritten
        dsink = torch.zeros(q.shape[-2], dtype=F64) if call.sink is not None else None
        for b, sq, sk in self._sequences(q, k, varlen):
            rows = lse[b] if varlen is None else lse[:, sq]
            g = self._one_backward(q[sq].to(F64), k[sk].to(F64), v[sk].to(F64), out[sq].to(F64), dout[sq].to(F64),
                                   rows.to(F64), call, self._slopes(call, b))
            dq[sq], dk[sk], dv[sk] = (x.to(q.dtype) for x in g[:3])
            if dsink is not None:
                dsink += g[3]
        return dq, dk, dv, (dsink.float() if dsink is not None else None)

def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def make_case(fmt="bshd", mask="no_mask", sq=12, skv=12, b=3, h=4, hk=4, d=8, dv=8, window=None, alibi=None,
              softmax="vanilla", lens_q=None, lens_kv=None, tail=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)  # noqa: E731
    aux = AttnAux(max_seqlen_q=sq, max_seqlen_kv=skv)
    if fmt == "thd":
        lens_q = lens_q or [sq] * b
        lens_kv = lens_kv or (lens_q if lens_q != [sq] * b else [skv] * b)
        q, k, v = rand(sum(lens_q) + tail, h, d), rand(sum(lens_kv) + tail, hk, d), rand(sum(lens_kv) + tail, hk, dv)
        aux.cu_seqlens_q, aux.cu_seqlens_kv = _cu(lens_q), _cu(lens_kv)
    else:
        shape_q, shape_kv = ((b, sq), (b, skv)) if fmt == "bshd" else ((sq, b), (skv, b))
        q, k, v = rand(*shape_q, h, d), rand(*shape_kv, hk, d), rand(*shape_kv, hk, dv)
        if lens_q is not None:
            aux.cu_seqlens_q, aux.cu_seqlens_kv = _cu(lens_q), _cu(lens_kv or lens_q)
    if alibi:
        aux.alibi_slopes = torch.rand(*((h,) if alibi == "h" else (b, h)), generator=g, dtype=torch.float32) + 0.1
    if softmax == "learnable":
        aux.softmax_offset = torch.randn(h, generator=g, dtype=torch.float32).requires_grad_()
    cfg = AttnConfig(qkv_format=fmt, attn_mask_type=mask, window_size=normalize_window(window, mask),
                     softmax_scale=1 / math.sqrt(d), bias_type="alibi" if alibi else "no_bias", softmax_type=softmax)
    for t in (q, k, v):
        t.requires_grad_()
    return q, k, v, aux, cfg


def reference(q, k, v, aux, cfg):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    offset = aux.softmax_offset.detach().double().requires_grad_() if aux.softmax_offset is not None else None
    out, lse = reference_attention(
        *leaves, qkv_format=cfg.qkv_format, attn_mask_type=cfg.attn_mask_type, window_size=cfg.window_size,
        cu_seqlens_q=aux.cu_seqlens_q, cu_seqlens_kv=aux.cu_seqlens_kv, bias_type=cfg.bias_type,
        alibi_slopes=aux.alibi_slopes, softmax_type=cfg.softmax_type, softmax_offset=offset,
        softmax_scale=cfg.softmax_scale)
    return out, lse, leaves, offset


CASES = {
    "bshd": dict(),
    "sbhd causal": dict(fmt="sbhd", mask="causal"),
    "bshd gqa bottom-right sq<skv": dict(mask="causal_bottom_right", sq=7, skv=13, hk=2),
    "bshd bottom-right sq>skv (empty rows)": dict(mask="causal_bottom_right", sq=13, skv=7, hk=1),
    "sbhd window sq>skv (empty rows)": dict(fmt="sbhd", window=(2, 0), mask="causal_bottom_right", sq=13, skv=7),
    "bshd window both sides": dict(window=(3, 2), sq=10, skv=14),
    "bshd d_qk != d_v": dict(d=8, dv=16),
    "bshd alibi [h]": dict(alibi="h", mask="causal_bottom_right", sq=9, skv=12),
    "sbhd alibi [b, h]": dict(fmt="sbhd", alibi="bh"),
    "bshd padding": dict(mask="padding", lens_q=[12, 5, 9], lens_kv=[3, 12, 9]),
    "sbhd padding_causal": dict(fmt="sbhd", mask="padding_causal", lens_q=[12, 5, 0]),
    "bshd padding_causal_bottom_right": dict(mask="padding_causal_bottom_right", sq=8, skv=12,
                                             lens_q=[8, 5, 7], lens_kv=[2, 12, 9]),
    "thd padding": dict(fmt="thd", mask="padding", lens_q=[5, 1, 8], lens_kv=[7, 3, 2], tail=3),
    "thd padding_causal": dict(fmt="thd", mask="padding_causal", lens_q=[5, 1, 8], tail=2),
    "thd bottom-right window": dict(fmt="thd", mask="padding_causal_bottom_right", window=(1, 0),
                                    lens_q=[6, 2, 8], lens_kv=[3, 5, 8]),
    "bshd off-by-one": dict(softmax="off-by-one", mask="causal_bottom_right", sq=9, skv=5),
    "bshd learnable": dict(softmax="learnable", mask="causal_bottom_right", sq=9, skv=5),
    "thd learnable": dict(fmt="thd", mask="padding_causal_bottom_right", softmax="learnable",
                          lens_q=[6, 2, 8], lens_kv=[3, 5, 8], tail=2),
    "bshd padding learnable": dict(mask="padding_causal_bottom_right", softmax="learnable",
                                   lens_q=[12, 5, 9], lens_kv=[3, 12, 9]),
}


# FA2 has no sinks: those cases run with flash-attn-4's conventions only.
PAIRS = [(style, name) for name in CASES for style in ("fa2", "fa4")
         if style == "fa4" or CASES[name].get("softmax", "vanilla") == "vanilla"]


@pytest.mark.parametrize("style, name", PAIRS)
def test_plumbing_matches_the_reference(style, name):
    q, k, v, aux, cfg = make_case(**CASES[name])
    engine = StandInKernel(style)
    out = assert_matches_reference(engine, q, k, v, aux, cfg)
    assert out.is_contiguous()
    if style == "fa4" and cfg.softmax_type != "vanilla":  # the kernel gets its own convention back: no -inf rows
        assert not torch.isneginf(engine.seen_lse[-1]).any()


def assert_matches_reference(engine, q, k, v, aux, cfg) -> torch.Tensor:
    """The engine's out, lse (-inf exactly where the reference's is) and gradients against the float64 reference."""
    out, lse, _ = engine(q, k, v, aux, cfg)
    ref_out, ref_lse, leaves, offset = reference(q, k, v, aux, cfg)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows without keys must have lse -inf"
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-6, atol=1e-6)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    (ref_out * dout).sum().backward()
    for mine, theirs in zip((q, k, v), leaves):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-6)  # P comes from a float32 lse
    if cfg.softmax_type == "learnable":
        torch.testing.assert_close(aux.softmax_offset.grad.double(), offset.grad, rtol=1e-5, atol=1e-6)
    return out


def test_backward_accepts_a_global_out_and_lse():
    """Context parallelism: forward on two key blocks, merge by lse, backward of each block with the merged pair."""
    q, k, v, aux, cfg = make_case(sq=10, skv=16)
    engine = StandInKernel("fa2")
    halves = [(k[:, :8], v[:, :8]), (k[:, 8:], v[:, 8:])]
    parts = [engine.forward(q.detach(), kh.detach(), vh.detach(), aux, cfg) for kh, vh in halves]
    lse = torch.logaddexp(parts[0].lse, parts[1].lse)
    out = sum(p.out * torch.exp(p.lse - lse).transpose(1, 2)[..., None] for p in parts)
    dout = torch.randn_like(out)
    dq = sum(engine.backward(dout, q.detach(), kh.detach(), vh.detach(), out, lse, p.state, aux, cfg).dq
             for (kh, vh), p in zip(halves, parts))
    ref_out, _, leaves, _ = reference(q, k, v, aux, cfg)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)  # the merge goes through float32 lse
    (ref_out * dout).sum().backward()
    torch.testing.assert_close(dq, leaves[0].grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("changes, words", [
    (dict(mask="causal", sq=8, skv=12), ["top-left", "8", "12", "causal_bottom_right"]),
    (dict(fmt="thd", mask="padding_causal", lens_q=[4, 4], lens_kv=[4, 5]), ["cu_seqlens", "bottom_right"]),
    (dict(mask="padding_causal", lens_q=[4, 4, 4], lens_kv=[4, 5, 4]), ["cu_seqlens_q and cu_seqlens_kv"]),
])
def test_top_left_masks_with_unequal_lengths_are_refused(changes, words):
    q, k, v, aux, cfg = make_case(**changes)
    with pytest.raises(ValueError) as info:
        StandInKernel("fa4")(q, k, v, aux, cfg)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_bad_inputs_name_the_argument():
    q, k, v, aux, cfg = make_case(fmt="thd", mask="padding", lens_q=[3, 4])
    aux.cu_seqlens_q_padded = _cu([4, 4])
    with pytest.raises(ValueError, match="cu_seqlens_q_padded"):
        StandInKernel("fa4")(q, k, v, aux, cfg)
    q, k, v, aux, cfg = make_case(alibi="h")
    aux.alibi_slopes = None
    with pytest.raises(ValueError, match="alibi_slopes"):
        StandInKernel("fa2")(q, k, v, aux, cfg)
    q, k, v, aux, cfg = make_case(softmax="learnable")
    aux.softmax_offset = torch.zeros(3)
    with pytest.raises(ValueError, match="softmax_offset"):
        StandInKernel("fa4")(q, k, v, aux, cfg)
    q, k, v, aux, _ = make_case()
    for cfg, word in ((AttnConfig(attn_mask_type="arbitrary"), "arbitrary"), (AttnConfig(dropout_p=0.1), "dropout_p"),
                      (AttnConfig(bias_type="post_scale_bias"), "post_scale_bias"),
                      (AttnConfig(return_max_logit=True), "return_max_logit")):
        with pytest.raises(ValueError, match=word):
            StandInKernel("fa4")(q, k, v, aux, cfg)
    q, k, v, aux, cfg = make_case(mask="padding")
    with pytest.raises(ValueError, match="cu_seqlens"):
        StandInKernel("fa4")(q, k, v, aux, cfg)


def test_padding_mask_without_cu_seqlens_is_read_from_a_right_padded_mask():
    q, k, v, aux, cfg = make_case(mask="padding", lens_q=[12, 5, 9])
    lengths = aux.cu_seqlens_q.diff()
    aux.cu_seqlens_q = aux.cu_seqlens_kv = None
    aux.attention_mask = (torch.arange(12)[None, :] >= lengths[:, None]).view(3, 1, 1, 12)
    out, _, _ = StandInKernel("fa2")(q, k, v, aux, cfg)
    ref_aux = AttnAux(cu_seqlens_q=_cu(lengths.tolist()), cu_seqlens_kv=_cu(lengths.tolist()))
    torch.testing.assert_close(out, reference(q, k, v, ref_aux, cfg)[0], rtol=1e-10, atol=1e-10)
    aux.attention_mask = aux.attention_mask.flip(-1)  # left padding cannot be described by cu_seqlens
    with pytest.raises(ValueError, match="right-padded"):
        StandInKernel("fa2")(q, k, v, aux, cfg)


def test_bind_supported_follows_each_release_and_never_drops_a_feature():
    def old(q, dropout_p, softmax_scale, causal, window_size, return_softmax):  # flash-attn 2.3 style
        return window_size

    def new(q, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
            return_softmax):
        return window_size_left, window_size_right

    values = dict(q=1, dropout_p=0.0, softmax_scale=1.0, causal=False, softcap=0.0, alibi_slopes=None,
                  return_softmax=False)
    assert bind_supported(old, {**values, "window_size": (4, 0)}) == {
        "q": 1, "dropout_p": 0.0, "softmax_scale": 1.0, "causal": False, "window_size": (4, 0), "return_softmax": False}
    assert new(**bind_supported(new, {**values, "window_size_left": 4, "window_size_right": 0})) == (4, 0)
    with pytest.raises(RuntimeError, match="alibi_slopes"):
        bind_supported(old, {**values, "alibi_slopes": torch.ones(2), "window_size": (-1, -1)})
    assert bind_supported(old, {"causal": True, "is_causal": True}, {"is_causal": ("is_causal", "causal")}) == \
        {"causal": True}


def test_engines_load_lazily_and_report_why_they_cannot():
    import attn_dispatch.backends.flash_attn_2  # noqa: F401 - importing the modules needs no engine package
    import attn_dispatch.backends.flash_attn_3  # noqa: F401
    import attn_dispatch.backends.flash_attn_4  # noqa: F401

    for provider in ("flash_attn_4:cute", "flash_attn_3:interface", "flash_attn_2:package"):
        try:
            import importlib.util
            present = importlib.util.find_spec({"flash_attn_4:cute": "flash_attn.cute",
                                                "flash_attn_3:interface": "flash_attn_interface",
                                                "flash_attn_2:package": "flash_attn_2_cuda"}[provider]) is not None
        except (ImportError, ValueError):
            present = False
        if present:
            continue
        with pytest.raises(EngineUnavailableError):
            get_engine(provider)
    if not torch.cuda.is_available():
        with pytest.raises(EngineUnavailableError, match="CUDA"):
            get_engine("flash_attn_2:torch")


class _FakeFa4Interface:
    """Stands in for flash_attn.cute.interface: an sm90 device whose kernels must never be reached here."""

    @staticmethod
    def _get_device_arch():
        return 90

    def _flash_attn_fwd(self, *args, **kwargs):  # pragma: no cover - reaching it is the failure
        raise AssertionError("a refused call reached the kernel")

    _flash_attn_bwd = _flash_attn_fwd


def _fa4_on_sm90():
    from attn_dispatch.backends.flash_attn_4 import FlashAttn4Engine

    engine = FlashAttn4Engine.__new__(FlashAttn4Engine)  # no flash_attn.cute on the CPU machine
    engine._iface, engine.jit_events = _FakeFa4Interface(), []
    return engine


@pytest.mark.parametrize("d, dv, hk, words", [
    (64, 128, 4, ["(64, 128)", "248832", "232448", "head_dim_v=64"]),
    (128, 64, 2, ["GQA backward requires head_dim == head_dim_v"]),
])
def test_flash_attn_4_refuses_an_sm90_backward_that_cannot_launch_before_its_forward(d, dv, hk, words):
    q, k, v, aux, cfg = make_case(d=d, dv=dv, hk=hk)
    for t in (q, k, v):
        t.requires_grad_()
    with pytest.raises(ValueError) as info:
        _fa4_on_sm90()(q, k, v, aux, cfg)
    assert all(w in str(info.value) for w in words), str(info.value)
    with pytest.raises(ValueError, match="sm90"):  # the functional backward (context parallelism) refuses too
        _fa4_on_sm90().backward(q.detach(), q.detach(), k.detach(), v.detach(), q.detach()[..., :dv],
                                torch.zeros(3, 4, 12), None, aux, cfg)
    with pytest.raises(AssertionError, match="reached the kernel"):  # inference goes through to the kernel
        _fa4_on_sm90()(q.detach(), k.detach(), v.detach(), aux, cfg)


def test_flash_attn_4_refuses_an_sm90_forward_whose_output_tile_overruns_shared_memory():
    q, k, v, aux, cfg = make_case(d=64, dv=256)
    with pytest.raises(ValueError, match="sQ's storage"):
        _fa4_on_sm90()(q, k, v, aux, cfg)


def test_torch_fa2_refuses_alibi_with_the_reason():
    from attn_dispatch.backends.flash_attn_2 import TorchFlashEngine

    engine = TorchFlashEngine.__new__(TorchFlashEngine)  # __init__ needs CUDA; _resolve does not
    for train in (False, True):
        q, k, v, aux, cfg = make_case(alibi="h")
        q.requires_grad_(train)
        with pytest.raises(ValueError, match="does not support alibi"):
            engine(q, k, v, aux, cfg)


class _SoftcapFa4Interface(_FakeFa4Interface):
    """flash-attn-4's two entry points on bshd tensors, computed densely in float64 with logit soft-capping after
    the scale (interface.py: create_softcap_scoremod[_bwd]); records the softcap each call was given."""

    def __init__(self):
        self.fwd_softcap, self.bwd_softcap = [], []

    @staticmethod
    def _attend(q, k, v, scale, softcap):
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        lse = torch.logsumexp(s, dim=-1)
        return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v), lse

    def _flash_attn_fwd(self, q, k, v, softmax_scale, softcap, out, **kwargs):
        self.fwd_softcap.append(softcap)
        o, lse = self._attend(q, k, v, softmax_scale, softcap or 0.0)
        out.copy_(o)
        return out, lse, None, None, None

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, scale, causal, softcap, **kwargs):
        self.bwd_softcap.append(softcap)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            o, _ = self._attend(*leaves, scale, softcap)
            return torch.autograd.grad(o, leaves, dout)


@pytest.mark.parametrize("softcap", [0.0, 0.7])
def test_flash_attn_4_passes_softcap_to_forward_and_backward(softcap):
    from attn_dispatch.backends.flash_attn_4 import FlashAttn4Engine
    from attn_dispatch.backends.unfused import UnfusedEngine

    engine = FlashAttn4Engine.__new__(FlashAttn4Engine)
    engine._iface, engine.jit_events = _SoftcapFa4Interface(), []
    q, k, v, aux, cfg = make_case(d=32, dv=32)
    cfg = dataclasses.replace(cfg, softcap=softcap)
    dout = torch.randn(q.shape[:-1] + (32,), generator=torch.Generator().manual_seed(5), dtype=F64)
    out, _, _ = engine(q, k, v, aux, cfg)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want, _, _ = UnfusedEngine()(q, k, v, aux, cfg)  # soft-capping as the unfused engine (checked vs eager) has it
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert engine._iface.fwd_softcap == [softcap or None] and engine._iface.bwd_softcap == [softcap]
    if softcap:  # the cap is real: without it the result differs
        uncapped = UnfusedEngine()(q, k, v, aux, dataclasses.replace(cfg, softcap=0.0))[0]
        assert (out - uncapped).abs().max() > 1e-3


def test_flash_engines_without_softcap_refuse_it_before_the_kernel():
    from attn_dispatch.backends.flash_attn_2 import TorchFlashEngine

    engine = TorchFlashEngine.__new__(TorchFlashEngine)
    q, k, v, aux, cfg = make_case()
    with pytest.raises(ValueError, match="softcap=0.5 is not supported by flash_attn_2:torch"):
        engine(q, k, v, aux, dataclasses.replace(cfg, softcap=0.5))
