"""The unfused engine: exact attention in plain PyTorch, every feature, any device and float dtype.

Memory: the forward pass walks blocks of query rows (scores of one block against all keys, softmax,
times V), and the backward pass recomputes each block's probabilities from the saved log-sum-exp, as
FlashAttention's backward does. Extra memory is O(block x skv), never [b, h, sq, skv]; and because the
backward needs only (out, lse), it also accepts a global out/lse merged by context parallelism.
fp16/bf16 inputs are computed in float32, float64 in float64.

Layout: every format is brought to [b, h, s, d] views (thd through a gather into padded sequences of
length max_seqlen), so one masked-softmax core serves bshd, sbhd and thd.

Soft-capping (softcap > 0, Gemma 2): scaled scores become softcap * tanh(scores / softcap) before the
post-scale bias, ALiBi and masks; backward multiplies by the derivative 1 - tanh^2.

Masks follow Transformer Engine (utils.get_full_mask, get_alibi): query i is aligned with key i + off,
off = 0 for 'causal'/'padding_causal' (top-left) and Lkv - Lq otherwise (bottom-right, per sequence
when lengths are known); key j is kept iff i + off - left <= j <= i + off + right (-1: unbounded).

Dropout: the keep mask is a hash of (seed, batch, head, row, column), so forward and backward (and any
block size) agree without storing it; `dropout_keep_mask` rebuilds it for tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..params import TOP_LEFT_MASKS
from .base import AttnAux, AttnConfig, BwdResult, Engine, FwdResult

MAX_BLOCK_ELEMS = 1 << 23  # score elements (b * h * rows * skv) per query block: 32 MiB in float32
_M32 = 0xFFFFFFFF
NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------
# Dropout: a counter-based keep mask
# --------------------------------------------------------------------------------------------
def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash, in place on an int64 tensor holding values < 2**32 (constants < 2**31, so the
    products never overflow int64 and CPU and GPU agree bit for bit)."""
    x.bitwise_xor_(x >> 16).mul_(0x7FEB352D).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15).mul_(0x6A09E667).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def draw_dropout_seed(device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """Two 32-bit words from the device's generator (the default one unless given); stays on the device,
    so no host synchronisation. Drawn inside an RNG tracker's fork() it follows that tracker's state."""
    return torch.randint(0, 1 << 32, (2,), device=device, dtype=torch.int64, generator=generator)


def _keep_block(seed: torch.Tensor, b: int, h: int, sq: int, skv: int, i0: int, i1: int,
                p: float) -> torch.Tensor:
    """Keep mask [b, h, i1 - i0, skv] for rows i0..i1 of a [b, h, sq, skv] score matrix."""
    dev = seed.device
    rows = (torch.arange(b, device=dev).view(b, 1, 1) * h + torch.arange(h, device=dev).view(1, h, 1)) * sq \
        + torch.arange(i0, i1, device=dev).view(1, 1, -1)
    row_hash = _mix32(_mix32((rows & _M32) ^ seed[0]) ^ (rows >> 32))
    col_hash = _mix32(torch.arange(skv, device=dev) ^ seed[1])
    bits = _mix32(row_hash.unsqueeze(-1) ^ col_hash)  # [b, h, rows, skv]
    return bits >= int(round(p * (1 << 32)))


def dropout_keep_mask(seed: torch.Tensor, b: int, h: int, sq: int, skv: int, p: float) -> torch.Tensor:
    """The full keep mask [b, h, sq, skv] the engine used (thd: in padded [b, h, max_seqlen_q, max_seqlen_kv])."""
    return _keep_block(seed, b, h, sq, skv, 0, sq, p)


# --------------------------------------------------------------------------------------------
# Geometry: everything the masked softmax of one block needs, in [b, h, s, d] space
# --------------------------------------------------------------------------------------------
@dataclass
class _Geometry:
    b: int
    hq: int
    hk: int
    sq: int
    skv: int
    lens_q: torch.Tensor | None    # [b, 1, 1, 1] real query rows per sequence, or None (all)
    lens_kv: torch.Tensor | None
    off: Any                       # int or [b, 1, 1, 1]: query i is aligned with key i + off
    window: tuple[int, int]
    mask: torch.Tensor | None      # bool [b|1, h|1, sq, skv], True = masked out ('arbitrary')
    bias: torch.Tensor | None      # [b|1, h|1, sq, skv]
    pre_scale_bias: bool
    slopes: torch.Tensor | None    # [b|1, h, 1, 1] ALiBi slopes
    sink: torch.Tensor | None      # [1, h, 1, 1] sink logit (off-by-one: zeros)
    needs_rel: bool                # window or ALiBi need key - query distances
    softcap: float = 0.0           # scores -> softcap * tanh(scores / softcap) before the post-scale bias

    def rows_per_block(self, budget: int) -> int:
        return max(1, min(self.sq, budget // max(1, self.b * self.hq * self.skv)))


def _geometry(q4: torch.Tensor, k4: torch.Tensor, aux: AttnAux, cfg: AttnConfig, cdtype: torch.dtype,
              lens: tuple[torch.Tensor, torch.Tensor] | None) -> _Geometry:
    b, hq, sq, _ = q4.shape
    hk, skv = k4.shape[1], k4.shape[2]
    dev = q4.device
    lens_q = lens_kv = None
    if lens is not None:
        lens_q, lens_kv = (x.view(b, 1, 1, 1) for x in lens)
    if cfg.attn_mask_type in TOP_LEFT_MASKS:
        off: Any = 0
    elif lens is not None:
        off = lens_kv - lens_q
    else:
        off = skv - sq
    window = tuple(cfg.window_size)
    if "causal" in cfg.attn_mask_type:
        window = (window[0], 0)
    slopes = None
    if cfg.bias_type == "alibi":
        s = aux.alibi_slopes.to(device=dev, dtype=cdtype)
        slopes = s.view(1, hq, 1, 1) if s.dim() == 1 else s.view(b, hq, 1, 1)
    sink = None
    if cfg.softmax_type == "off-by-one":
        sink = torch.zeros(1, hq, 1, 1, device=dev, dtype=cdtype)
    elif cfg.softmax_type == "learnable":
        sink = aux.softmax_offset.detach().to(device=dev, dtype=cdtype).view(1, hq, 1, 1)
    bias = aux.bias.detach() if cfg.bias_type in ("pre_scale_bias", "post_scale_bias") else None
    mask = aux.attention_mask if cfg.attn_mask_type == "arbitrary" else None
    return _Geometry(b, hq, hk, sq, skv, lens_q, lens_kv, off, window, mask, bias,
                     cfg.bias_type == "pre_scale_bias", slopes, sink,
                     needs_rel=slopes is not None or window != (-1, -1), softcap=cfg.softcap)


def _scores(g: _Geometry, qg: torch.Tensor, kt: torch.Tensor, i0: int, i1: int,
            scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked, scaled, biased scores [b, h, rows, skv] (masked entries -inf), and with soft-capping the tanh of
    the capped scores, which backward needs for the cap's derivative (1 - tanh^2)."""
    rows = i1 - i0
    s = torch.matmul(qg, kt).view(g.b, g.hq, rows, g.skv)
    bias = None if g.bias is None else g.bias[:, :, i0:i1].to(s.dtype)
    if bias is not None and g.pre_scale_bias:
        s = (s + bias).mul_(scale)
    else:
        s.mul_(scale)
    capped = None
    if g.softcap:
        capped = torch.tanh(s.div_(g.softcap))
        s = capped * g.softcap
    if bias is not None and not g.pre_scale_bias:
        s.add_(bias)
    dev = s.device
    keep = None
    if g.needs_rel:
        i = torch.arange(i0, i1, device=dev).view(1, 1, rows, 1)
        j = torch.arange(g.skv, device=dev).view(1, 1, 1, g.skv)
        rel = j - i - g.off  # key distance from the aligned diagonal
        if g.slopes is not None:
            s.sub_(g.slopes * rel.abs().to(s.dtype))
        left, right = g.window
        if left >= 0:
            keep = rel >= -left
        if right >= 0:
            keep = rel <= right if keep is None else keep & (rel <= right)
    if g.lens_q is not None:
        valid = (torch.arange(i0, i1, device=dev).view(1, 1, rows, 1) < g.lens_q) & \
            (torch.arange(g.skv, device=dev).view(1, 1, 1, g.skv) < g.lens_kv)
        keep = valid if keep is None else keep & valid
    if g.mask is not None:
        allowed = ~g.mask[:, :, i0:i1]
        keep = allowed if keep is None else keep & allowed
    if keep is not None:
        s.masked_fill_(~keep, NEG_INF)
    return s, capped


def _row_stats(g: _Geometry, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised probabilities (in place of s), denominators and lse; fully masked rows: p 0, lse -inf."""
    key_max = s.amax(dim=-1, keepdim=True)
    has_key = key_max > NEG_INF
    m = key_max if g.sink is None else torch.maximum(key_max, g.sink)
    m = torch.where(has_key, m, torch.zeros_like(m))
    p = s.sub_(m).exp_()
    denom = p.sum(dim=-1, keepdim=True)
    if g.sink is not None:
        denom = denom + torch.exp(g.sink - m)
    denom = torch.where(has_key, denom, torch.ones_like(denom))
    lse = torch.where(has_key, m + torch.log(denom), torch.full_like(m, NEG_INF))
    return p, denom, lse


def _lse_dtype(cdtype: torch.dtype) -> torch.dtype:
    """float32 as the engine convention says; float64 inputs keep float64 so their backward stays exact."""
    return torch.float64 if cdtype == torch.float64 else torch.float32


def _grouped(x: torch.Tensor, g: _Geometry) -> torch.Tensor:
    """[b, hq, rows, n] -> [b, hk, group * rows, n]: query heads sharing a kv head become one matmul."""
    return x.reshape(g.b, g.hk, -1, x.shape[-1])


# --------------------------------------------------------------------------------------------
# The block loops
# --------------------------------------------------------------------------------------------
def _forward_blocks(g: _Geometry, q4, k4, v4, out4, scale, dropout_p, seed, return_max_logit, budget, cdtype):
    kt = k4.to(cdtype).contiguous().transpose(-1, -2)  # [b, hk, d, skv]
    vc = v4.to(cdtype).contiguous()
    lse = torch.empty(g.b, g.hq, g.sq, device=q4.device, dtype=_lse_dtype(cdtype))
    max_logit = torch.full((g.hq,), NEG_INF, device=q4.device, dtype=torch.float32) if return_max_logit else None
    step = g.rows_per_block(budget)
    for i0 in range(0, g.sq, step):
        i1 = min(i0 + step, g.sq)
        s, _ = _scores(g, _grouped(q4[:, :, i0:i1].to(cdtype), g), kt, i0, i1, scale)
        if max_logit is not None:
            torch.maximum(max_logit, s.amax(dim=(0, 2, 3)).float(), out=max_logit)
        p, denom, lse_b = _row_stats(g, s)
        p.div_(denom)
        if dropout_p > 0.0:
            p.mul_(_keep_block(seed, g.b, g.hq, g.sq, g.skv, i0, i1, dropout_p)).div_(1.0 - dropout_p)
        o = torch.matmul(_grouped(p, g), vc)  # [b, hk, group * rows, dv]
        out4[:, :, i0:i1] = o.view(g.b, g.hq, i1 - i0, -1)
        lse[:, :, i0:i1] = lse_b.squeeze(-1)
    return lse, max_logit


def _backward_blocks(g: _Geometry, dout4, q4, k4, v4, out4, lse, dq4, scale, dropout_p, seed, budget, cdtype,
                     want_dbias: bool, want_dsink: bool):
    kc = k4.to(cdtype).contiguous()
    vt = v4.to(cdtype).contiguous().transpose(-1, -2)  # [b, hk, dv, skv]
    dk = torch.zeros(kc.shape, device=kc.device, dtype=cdtype)
    dv = torch.zeros(g.b, g.hk, g.skv, v4.shape[-1], device=kc.device, dtype=cdtype)
    dbias = torch.zeros(g.bias.shape, device=kc.device, dtype=g.bias.dtype) if want_dbias else None
    dsink = torch.zeros(g.hq, device=kc.device, dtype=torch.float32) if want_dsink else None
    bias_sum_dims = tuple(d for d in (0, 1) if g.bias is not None and g.bias.shape[d] == 1)
    step = g.rows_per_block(budget)
    for i0 in range(0, g.sq, step):
        i1 = min(i0 + step, g.sq)
        rows = i1 - i0
        qg = _grouped(q4[:, :, i0:i1].to(cdtype), g)
        do = dout4[:, :, i0:i1].to(cdtype)
        delta = (do * out4[:, :, i0:i1].to(cdtype)).sum(dim=-1, keepdim=True)  # rowsum(dO * O)
        lse_b = lse[:, :, i0:i1].unsqueeze(-1).to(cdtype)
        lse_b = torch.where(lse_b == NEG_INF, torch.zeros_like(lse_b), lse_b)  # fully masked: s is -inf, p 0
        s, capped = _scores(g, qg, kc.transpose(-1, -2), i0, i1, scale)
        p = s.sub_(lse_b).exp_()  # [b, hq, rows, skv]
        dog = _grouped(do, g)
        dp = torch.matmul(dog, vt).view(g.b, g.hq, rows, g.skv)
        if dropout_p > 0.0:
            keep = _keep_block(seed, g.b, g.hq, g.sq, g.skv, i0, i1, dropout_p)
            p_drop = p * keep / (1.0 - dropout_p)
            dp.mul_(keep).div_(1.0 - dropout_p)
        else:
            p_drop = p
        dv += torch.matmul(_grouped(p_drop, g).transpose(-1, -2), dog)
        del p_drop
        ds = p.mul_(dp.sub_(delta))  # dS = P * (dP - rowsum(dO * O))
        del dp
        if dbias is not None and not g.pre_scale_bias:  # a post-scale bias is added after the cap
            dbias[:, :, i0:i1] = ds.sum(dim=bias_sum_dims, keepdim=True) if bias_sum_dims else ds
        if capped is not None:  # d(c * tanh(x / c)) / dx = 1 - tanh^2
            ds.mul_(1.0 - capped * capped)
        if dbias is not None and g.pre_scale_bias:
            db = ds.sum(dim=bias_sum_dims, keepdim=True) if bias_sum_dims else ds
            dbias[:, :, i0:i1] = db * scale
        if dsink is not None:
            p_sink = torch.where(lse[:, :, i0:i1].unsqueeze(-1) == NEG_INF, torch.zeros_like(lse_b),
                                 torch.exp(g.sink - lse_b))
            dsink -= (p_sink * delta).sum(dim=(0, 2, 3)).float()
        dsg = _grouped(ds.mul_(scale), g)
        dq4[:, :, i0:i1] = torch.matmul(dsg, kc).view(g.b, g.hq, rows, -1)
        dk += torch.matmul(dsg.transpose(-1, -2), qg)
    return dk, dv, dbias, dsink


# --------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------
def _to_bhsd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return x.permute(0, 2, 1, 3) if fmt == "bshd" else x.permute(1, 2, 0, 3)


@dataclass
class _Packing:
    """thd <-> padded [b, s_max, h, d] for one side (q or kv)."""

    index: torch.Tensor  # [b, s_max] token index in the thd tensor; invalid slots point at row t (a zero row)
    lens: torch.Tensor   # [b] real tokens per sequence
    total: int           # t

    @staticmethod
    def build(cu: torch.Tensor, cu_padded: torch.Tensor | None, s_max: int, total: int) -> "_Packing":
        cu = cu.long()
        starts = (cu_padded.long() if cu_padded is not None else cu)[:-1]
        lens = cu[1:] - cu[:-1]
        pos = torch.arange(s_max, device=cu.device)
        index = torch.where(pos < lens[:, None], starts[:, None] + pos, torch.full_like(pos, total))
        return _Packing(index, lens, total)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[self.index]

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Padded [b, s_max, ...] -> [t, ...]; tokens outside every sequence are 0."""
        out = x.new_zeros(self.total + 1, *x.shape[2:])
        out.index_copy_(0, self.index.flatten(), x.flatten(0, 1))
        return out[:-1]

    def lse_pad(self, lse: torch.Tensor) -> torch.Tensor:
        """[h, t] -> [b, h, s_max]."""
        ext = torch.cat([lse, lse.new_full((lse.shape[0], 1), NEG_INF)], dim=1)
        return ext[:, self.index].permute(1, 0, 2)

    def lse_unpad(self, lse: torch.Tensor) -> torch.Tensor:
        """[b, h, s_max] -> [h, t] (-inf outside every sequence)."""
        h = lse.shape[1]
        out = lse.new_full((h, self.total + 1), NEG_INF)
        out.index_copy_(1, self.index.flatten(), lse.permute(1, 0, 2).reshape(h, -1))
        return out[:, :-1]


def _thd_packings(q, k, aux: AttnAux) -> tuple[_Packing, _Packing]:
    if aux.cu_seqlens_q is None or aux.cu_seqlens_kv is None:
        raise ValueError("qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv (int32 [batch + 1])")
    if aux.max_seqlen_q <= 0 or aux.max_seqlen_kv <= 0:
        raise ValueError(f"qkv_format='thd' needs max_seqlen_q/max_seqlen_kv > 0; got {aux.max_seqlen_q}, "
                         f"{aux.max_seqlen_kv}")
    pq = _Packing.build(aux.cu_seqlens_q, aux.cu_seqlens_q_padded, aux.max_seqlen_q, q.shape[0])
    pk = _Packing.build(aux.cu_seqlens_kv, aux.cu_seqlens_kv_padded, aux.max_seqlen_kv, k.shape[0])
    return pq, pk


def _dense_lens(aux: AttnAux, cfg: AttnConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """bshd/sbhd: per-sequence lengths from cu_seqlens for padding masks (real tokens first)."""
    if not cfg.attn_mask_type.startswith("padding") or aux.cu_seqlens_q is None:
        return None
    cq, ckv = aux.cu_seqlens_q.long(), aux.cu_seqlens_kv.long()
    return cq[1:] - cq[:-1], ckv[1:] - ckv[:-1]


@dataclass
class UnfusedState:
    """What forward keeps for backward besides q, k, v, out, lse."""

    dropout_seed: torch.Tensor | None
    # fp16/bf16: the output before rounding, for rowsum(dO * O); used only when backward gets that very output
    # (a context-parallel caller passes a merged global output instead, and then the given one is used).
    out_fp32: torch.Tensor | None = None
    # The rounded output's storage: holding it keeps that memory from being reused by another tensor, so that
    # "same address" below really means "the output forward returned". (A storage, unlike the tensor, does
    # not point back into the autograd graph, so this makes no reference cycle.)
    out_storage: torch.UntypedStorage | None = None
    out_ptr: int = 0

    def precise_out(self, out: torch.Tensor) -> torch.Tensor:
        if (self.out_fp32 is not None and self.out_storage is not None and out.data_ptr() == self.out_ptr
                and out.shape == self.out_fp32.shape):
            return self.out_fp32
        return out


class UnfusedEngine(Engine):
    family = "unfused"
    provider = "pytorch"

    def __init__(self, max_block_elems: int = MAX_BLOCK_ELEMS):
        self.max_block_elems = max_block_elems

    # ---- forward ----
    def forward(self, q, k, v, aux: AttnAux, cfg: AttnConfig) -> FwdResult:
        with torch.no_grad():
            cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            seed = None
            if cfg.dropout_p > 0.0:
                seed = aux.extra.get("dropout_seed")
                if seed is None:
                    seed = draw_dropout_seed(q.device, aux.dropout_generator)
            if cfg.qkv_format == "thd":
                pq, pk = _thd_packings(q, k, aux)
                q4, k4, v4 = (_to_bhsd(p.pad(x), "bshd") for p, x in ((pq, q), (pk, k), (pk, v)))
                lens = (pq.lens, pk.lens)
            else:
                q4, k4, v4 = (_to_bhsd(x, cfg.qkv_format) for x in (q, k, v))
                lens = _dense_lens(aux, cfg)
            g = _geometry(q4, k4, aux, cfg, cdtype, lens)
            half = q.dtype in (torch.float16, torch.bfloat16)
            out_dtype = cdtype if half else q.dtype  # half inputs: compute out in fp32, round once at the end
            if cfg.qkv_format == "thd":
                out_pad = q.new_empty(g.b, g.sq, g.hq, v.shape[-1], dtype=out_dtype)
                lse, max_logit = _forward_blocks(g, q4, k4, v4, _to_bhsd(out_pad, "bshd"), cfg.softmax_scale,
                                                 cfg.dropout_p, seed, cfg.return_max_logit, self.max_block_elems,
                                                 cdtype)
                out, lse = pq.unpad(out_pad), pq.lse_unpad(lse)
            else:
                out = q.new_empty(*q.shape[:-1], v.shape[-1], dtype=out_dtype)
                lse, max_logit = _forward_blocks(g, q4, k4, v4, _to_bhsd(out, cfg.qkv_format), cfg.softmax_scale,
                                                 cfg.dropout_p, seed, cfg.return_max_logit, self.max_block_elems,
                                                 cdtype)
            state = UnfusedState(seed)
            if half:
                state.out_fp32, out = out, out.to(q.dtype)
                state.out_storage, state.out_ptr = out.untyped_storage(), out.data_ptr()
        return FwdResult(out, lse, state, max_logit)

    # ---- backward ----
    def backward(self, dout, q, k, v, out, lse, state, aux: AttnAux, cfg: AttnConfig) -> BwdResult:
        with torch.no_grad():
            cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            seed = state.dropout_seed if state is not None else None
            if state is not None:
                out = state.precise_out(out)
            if cfg.dropout_p > 0.0 and seed is None:
                raise ValueError("backward with dropout_p > 0 needs the dropout seed from forward (state)")
            want_dbias = aux.bias is not None and aux.bias.requires_grad and \
                cfg.bias_type in ("pre_scale_bias", "post_scale_bias")
            want_dsink = cfg.softmax_type == "learnable" and aux.softmax_offset is not None and \
                aux.softmax_offset.requires_grad
            if cfg.qkv_format == "thd":
                pq, pk = _thd_packings(q, k, aux)
                q4, k4, v4 = (_to_bhsd(p.pad(x), "bshd") for p, x in ((pq, q), (pk, k), (pk, v)))
                dout4, out4 = (_to_bhsd(pq.pad(x), "bshd") for x in (dout, out))
                lse4 = pq.lse_pad(lse)
                lens = (pq.lens, pk.lens)
                dq_pad = q.new_empty(q4.shape[0], q4.shape[2], q4.shape[1], q.shape[-1])
                dq4 = _to_bhsd(dq_pad, "bshd")
            else:
                q4, k4, v4, dout4, out4 = (_to_bhsd(x, cfg.qkv_format) for x in (q, k, v, dout, out))
                lse4, lens = lse, _dense_lens(aux, cfg)
                dq = torch.empty_like(q)
                dq4 = _to_bhsd(dq, cfg.qkv_format)
            g = _geometry(q4, k4, aux, cfg, cdtype, lens)
            dk4, dv4, dbias, dsink = _backward_blocks(
                g, dout4, q4, k4, v4, out4, lse4, dq4, cfg.softmax_scale, cfg.dropout_p, seed,
                self.max_block_elems, cdtype, want_dbias, want_dsink)
            if cfg.qkv_format == "thd":
                dq = pq.unpad(dq_pad)
                dk = pk.unpad(dk4.permute(0, 2, 1, 3).to(k.dtype))
                dv = pk.unpad(dv4.permute(0, 2, 1, 3).to(v.dtype))
            else:
                dk = _from_bhsd(dk4, cfg.qkv_format).to(k.dtype)
                dv = _from_bhsd(dv4, cfg.qkv_format).to(v.dtype)
            if dsink is not None:
                dsink = dsink.to(aux.softmax_offset.dtype)
        return BwdResult(dq, dk, dv, dbias, dsink)


def _from_bhsd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return (x.permute(0, 2, 1, 3) if fmt == "bshd" else x.permute(2, 0, 1, 3)).contiguous()
