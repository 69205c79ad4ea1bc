"""Plumbing shared by the FlashAttention engines (FA2 package, FA2 in torch, FA3, flash-attn-4).

Every FlashAttention kernel takes q/k/v as bshd ([b, s, h, d], last dim contiguous, other strides free) or
as packed varlen tensors ([t, h, d] plus int32 cumulative sequence lengths), aligns causal masks and sliding
windows to the bottom-right corner, and returns the log-sum-exp next to the output. This module maps the
engine interface (backends/base.py) onto that:

- sbhd tensors are passed as transposed views (no copy); outputs come back in the call's memory order.
- thd calls go straight to the varlen kernels with the caller's cu_seqlens.
- bshd/sbhd calls with a padding mask are packed to varlen (a gather copy of q, k, v in forward and of
  dout/out in backward; the results are scattered back into zero-filled tensors, lse into -inf).
- Transformer Engine's top-left masks ('causal', 'padding_causal') are only run when the query and key lengths
  agree (per sequence for varlen), where both alignments coincide; otherwise ValueError. Every other mask type,
  sliding windows included, is bottom-right aligned, as the kernels are.
- A row that sees no key has lse -inf and output 0: FA2's +inf and flash-attn-4's sink-valued lse are
  normalised, and turned back into the kernel's own convention before its backward.
- thd rows past the last sequence (cu_seqlens[-1]) come back as 0 (lse -inf), gradients too.
- Those clean-ups cost a few small kernels (and ~25-50 us of host time each) per call: where validation read the
  lengths on the host (AttnAux.packed), the ones it shows to be no-ops are skipped, and a tail is cleared by
  slicing at the known end. Device tensors derived from cu_seqlens are cached on the tensor (tensor_cache).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..params import TOP_LEFT_MASKS, has_padding
from ..tensor_cache import cached_device_tensor, cached_on, capturing, same_values
from .base import AttnAux, AttnConfig, BwdResult, Engine, FwdResult, PackedFacts

UNBOUNDED = -1


@dataclass(frozen=True)
class Varlen:
    """The packed (varlen) description of a call, as FlashAttention's varlen entry points take it."""

    cu_seqlens_q: torch.Tensor   # int32 [n+1]
    cu_seqlens_kv: torch.Tensor  # int32 [n+1]
    max_seqlen_q: int
    max_seqlen_kv: int


@dataclass(frozen=True)
class KernelCall:
    """One call's settings in FlashAttention's own terms."""

    scale: float
    window: tuple[int, int]  # (left, right), -1 unbounded, bottom-right aligned
    dropout_p: float
    alibi_slopes: torch.Tensor | None
    sink: torch.Tensor | None  # per-head sink logit (natural-log units), float32 [h]
    sink_learnable: bool
    deterministic: bool
    softcap: float = 0.0  # logit soft-capping after the scale; 0 is off (only engines with supports_softcap)

    @property
    def causal(self) -> bool:
        return self.window == (UNBOUNDED, 0)


@dataclass
class _Packing:
    """Where the real tokens of a padded bshd/sbhd batch sit, and the varlen view of them."""

    varlen: Varlen
    q_index: tuple[torch.Tensor, torch.Tensor]   # (batch index, position) of each packed query token
    kv_index: tuple[torch.Tensor, torch.Tensor]

    def gather_q(self, x_bshd: torch.Tensor) -> torch.Tensor:
        return x_bshd[self.q_index]

    def gather_kv(self, x_bshd: torch.Tensor) -> torch.Tensor:
        return x_bshd[self.kv_index]

    def gather_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """[b, h, s] -> the varlen layout [h, t]."""
        return lse[self.q_index[0], :, self.q_index[1]].t().contiguous()

    def scatter(self, packed: torch.Tensor, into_bshd: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor]) -> None:
        into_bshd[index] = packed

    def scatter_lse(self, lse_packed: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
        heads = lse_packed.shape[0]
        lse = torch.full((batch, heads, seqlen), float("-inf"), dtype=torch.float32, device=lse_packed.device)
        lse[self.q_index[0], :, self.q_index[1]] = lse_packed.t()
        return lse


@dataclass
class FlashState:
    kernel: Any = None              # what the kernel keeps for backward (e.g. the dropout rng state)
    packing: _Packing | None = None
    varlen: Varlen | None = None    # thd calls: the validated cu_seqlens, reused by backward
    call: KernelCall | None = None


def to_bshd(x: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """A bshd view of a bshd or sbhd tensor (no copy)."""
    return x.transpose(0, 1) if qkv_format == "sbhd" else x


def empty_rows_possible(window: tuple[int, int], seqlen_q: int, seqlen_kv: int) -> bool:
    """Can a dense call have a row that sees no key? (Bottom-right: row i sees keys up to i + skv - sq + right.)"""
    right = window[1]
    return right != UNBOUNDED and seqlen_kv - seqlen_q + right < 0


def _require_lengths_equal(cu_q: torch.Tensor, cu_kv: torch.Tensor, cfg: AttnConfig) -> None:
    if not same_values(cu_q, cu_kv):
        raise ValueError(
            f"attn_mask_type={cfg.attn_mask_type!r} is aligned top-left, but cu_seqlens_q and cu_seqlens_kv give "
            "different sequence lengths; FlashAttention aligns the diagonal bottom-right, which agrees only for "
            "equal query and key lengths. Use a *_bottom_right mask type, or equal lengths.")



def needs_top_left(cfg: AttnConfig) -> bool:
    """The call's diagonal is aligned top-left (Transformer Engine's 'causal'/'padding_causal'; every other mask
    type, windows included, is aligned bottom-right). FlashAttention only gives that for equal lengths."""
    return cfg.attn_mask_type in TOP_LEFT_MASKS


def empty_rows_varlen(varlen: Varlen, total_q: int, right: int) -> torch.Tensor:
    """bool [t]: packed query tokens that see no key (a sequence without keys, or rows before the window)."""
    device = varlen.cu_seqlens_q.device
    cu_q, cu_kv = varlen.cu_seqlens_q.long(), varlen.cu_seqlens_kv.long()
    tokens = torch.arange(total_q, device=device)
    seq = torch.searchsorted(cu_q[1:], tokens, right=True).clamp_(max=cu_q.numel() - 2)
    len_q, len_kv = cu_q[seq + 1] - cu_q[seq], cu_kv[seq + 1] - cu_kv[seq]
    empty = len_kv == 0
    if right != UNBOUNDED:
        empty |= (tokens - cu_q[seq]) + len_kv - len_q + right < 0
    return empty


def host_facts(aux: AttnAux, q: torch.Tensor) -> PackedFacts | None:
    """aux.packed, except while a CUDA graph is captured: its replays may see other cu_seqlens contents, so the
    clean-ups then run on the device (a replay costs no host time anyway)."""
    return None if aux.packed is None or capturing(q) else aux.packed


def _no_neg_inf_rows(facts: PackedFacts | None, total_q: int) -> bool:
    """The host facts show that this module's own thd forward gave no row lse -inf (no row without keys, no tail)."""
    return facts is not None and not facts.keyless_rows and facts.end_q >= total_q


def fill_rows_from_(x: torch.Tensor, end: int | None, cu: torch.Tensor, value: float, dim: int = 0) -> None:
    """Fill the rows (along dim) of a thd tensor from its last sequence's end on (the kernels leave them unwritten):
    sliced at end where the host knows it (one kernel, none without a tail), else compared with cu[-1] on the
    device."""
    if end is None:
        tail = torch.arange(x.shape[dim], device=x.device) >= cu[-1]
        x.masked_fill_(tail.view(-1, *([1] * (x.dim() - 1 - dim))), value)
    elif end < x.shape[dim]:
        x.narrow(dim, end, x.shape[dim] - end).fill_(value)


def _int32_cu(cu: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor of cumulative sequence lengths; got dtype {cu.dtype}, "
                         f"shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device}; it must be on {device} with q, k, v")
    if cu.dtype == torch.int32 and cu.is_contiguous():
        return cu
    return cached_device_tensor((cu,), ("int32_contiguous",), lambda: cu.to(torch.int32).contiguous())


def _max_seqlen(cu: torch.Tensor, given: int) -> int:
    if given > 0:
        return given
    return cached_on((cu,), ("max_seqlen",), lambda: int((cu[1:] - cu[:-1]).max()))


def thd_varlen(q: torch.Tensor, aux: AttnAux, cfg: AttnConfig) -> Varlen:
    if aux.cu_seqlens_q is None:
        raise ValueError("qkv_format='thd' needs aux.cu_seqlens_q (int32 [b+1]); got None")
    cu_q = _int32_cu(aux.cu_seqlens_q, "cu_seqlens_q", q.device)
    cu_kv = cu_q if aux.cu_seqlens_kv is None else _int32_cu(aux.cu_seqlens_kv, "cu_seqlens_kv", q.device)
    for padded, real, name in ((aux.cu_seqlens_q_padded, cu_q, "cu_seqlens_q_padded"),
                               (aux.cu_seqlens_kv_padded, cu_kv, "cu_seqlens_kv_padded")):
        if padded is not None and not same_values(padded, real):
            raise ValueError(f"{name} differs from the real cu_seqlens: padding between sequences in a thd tensor "
                             "is not supported by the FlashAttention engines (Transformer Engine rule); pack the "
                             "sequences back to back, or use cudnn_fused")
    if needs_top_left(cfg):
        _require_lengths_equal(cu_q, cu_kv, cfg)
    return Varlen(cu_q, cu_kv, _max_seqlen(cu_q, aux.max_seqlen_q), _max_seqlen(cu_kv, aux.max_seqlen_kv))


def _positions(cu: torch.Tensor, batch: int, seqlen: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = (cu[1:] - cu[:-1]).to(torch.int64)
    host = lengths.cpu()  # one sync: the packed size decides the allocation
    if host.numel() != batch:
        raise ValueError(f"{name} has {host.numel() + 1} entries; a batch of {batch} needs {batch + 1}")
    if int(host.min()) < 0 or int(host.max()) > seqlen:
        raise ValueError(f"{name} gives sequence lengths {host.tolist()}; each must be in [0, {seqlen}]")
    total = int(host.sum())
    batch_index = torch.repeat_interleave(torch.arange(batch, device=cu.device), lengths, output_size=total)
    starts = cu[:-1].to(torch.int64)
    position = torch.arange(total, device=cu.device) - starts[batch_index]
    return batch_index, position


def _lengths_from_mask(mask: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    if mask.dtype != torch.bool or tuple(mask.shape) != (batch, 1, 1, seqlen):
        raise ValueError(f"a padding mask without cu_seqlens must be a bool [b, 1, 1, s] = {[batch, 1, 1, seqlen]} "
                         f"tensor (True = padded); got dtype {mask.dtype}, shape {list(mask.shape)}. "
                         "Pass aux.cu_seqlens_q / cu_seqlens_kv instead.")
    valid = ~mask.reshape(batch, seqlen)
    lengths = valid.sum(-1)
    prefix = torch.arange(seqlen, device=mask.device)[None, :] < lengths[:, None]
    if not torch.equal(valid, prefix):
        raise ValueError("the padding mask is not right-padded (valid tokens first): the FlashAttention engines "
                         "take padded batches as cu_seqlens; pass aux.cu_seqlens_q / cu_seqlens_kv")
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def pack_padded(q_b: torch.Tensor, k_b: torch.Tensor, aux: AttnAux, cfg: AttnConfig) -> _Packing:
    """bshd views + a padding mask -> where the real tokens are, assuming each sequence starts at position 0."""
    batch, seqlen_q, seqlen_kv = q_b.shape[0], q_b.shape[1], k_b.shape[1]
    cu_q, cu_kv = aux.cu_seqlens_q, aux.cu_seqlens_kv
    if cu_q is None:
        if aux.attention_mask is None or seqlen_q != seqlen_kv:
            raise ValueError(f"attn_mask_type={cfg.attn_mask_type!r} on {cfg.qkv_format} needs aux.cu_seqlens_q and "
                             "aux.cu_seqlens_kv (int32 [b+1], real tokens per sequence); got None")
        cu_q = _lengths_from_mask(aux.attention_mask, batch, seqlen_q)
    if cu_kv is None:
        if seqlen_q != seqlen_kv:
            raise ValueError("aux.cu_seqlens_kv is None but max_seqlen_q != max_seqlen_kv; pass both")
        cu_kv = cu_q
    cu_q = _int32_cu(cu_q, "cu_seqlens_q", q_b.device)
    cu_kv = cu_q if cu_kv is cu_q else _int32_cu(cu_kv, "cu_seqlens_kv", q_b.device)
    if needs_top_left(cfg):
        _require_lengths_equal(cu_q, cu_kv, cfg)
    q_index = _positions(cu_q, batch, seqlen_q, "cu_seqlens_q")
    kv_index = q_index if cu_kv is cu_q and seqlen_q == seqlen_kv else _positions(cu_kv, batch, seqlen_kv,
                                                                                  "cu_seqlens_kv")
    return _Packing(Varlen(cu_q, cu_kv, seqlen_q, seqlen_kv), q_index, kv_index)


class FlashEngineBase(Engine):
    """Engine.forward/backward for the FlashAttention kernels; subclasses provide _kernel_fwd/_kernel_bwd.

    _kernel_fwd(q, k, v, varlen, call, out) -> (out, lse, kernel_state): q, k, v bshd views (varlen None) or
    packed [t, h, d] (varlen given); `out` is a preallocated bshd view to write into, for kernels that take one.
    _kernel_bwd(dout, q, k, v, out, lse, kernel_state, varlen, call) -> (dq, dk, dv, dsink).
    """

    formats: tuple[str, ...] = ("bshd", "sbhd", "thd")
    supports_dropout = False
    supports_alibi = False
    no_alibi_why = ""                  # why a provider without ALiBi has none (appended to the refusal)
    supports_sink = False
    supports_softcap = False           # the kernels take logit soft-capping (flash-attn-4)
    same_head_dims = False             # q, k, v must share one head dim (FA2)
    takes_out_buffer = False           # the kernel writes into a caller-provided output
    empty_rows_lse_positive_inf = False  # FA2 writes +inf as an empty row's lse

    # --- validation: bad input is a ValueError naming the argument, its value and what is allowed ---------
    def _resolve(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig) -> KernelCall:
        name = f"{self.family}:{self.provider}"
        if cfg.qkv_format not in self.formats:
            raise ValueError(f"qkv_format={cfg.qkv_format!r} is not supported by {name}; use {', '.join(self.formats)}")
        if cfg.attn_mask_type == "arbitrary":
            raise ValueError(f"attn_mask_type='arbitrary' is not supported by {name}: FlashAttention takes no mask "
                             "tensor; use causal/padding mask types or the unfused engine")
        if cfg.return_max_logit:
            raise ValueError(f"return_max_logit=True is not supported by {name}")
        if cfg.bias_type not in ("no_bias", "alibi") or (cfg.bias_type == "alibi" and not self.supports_alibi):
            allowed = "no_bias or alibi" if self.supports_alibi else "no_bias"
            why = f" ({self.no_alibi_why})" if cfg.bias_type == "alibi" and self.no_alibi_why else ""
            raise ValueError(f"core_attention_bias_type={cfg.bias_type!r} is not supported by {name}; use "
                             f"{allowed}{why}")
        if cfg.dropout_p > 0 and not self.supports_dropout:
            raise ValueError(f"dropout_p={cfg.dropout_p} is not supported by {name}: it has no dropout")
        if cfg.softmax_type != "vanilla" and not self.supports_sink:
            raise ValueError(f"softmax_type={cfg.softmax_type!r} is not supported by {name}; use 'vanilla'")
        if cfg.softcap and not self.supports_softcap:
            raise ValueError(f"softcap={cfg.softcap:g} is not supported by {name}; use softcap=0, or flash_attn_4 / "
                             "the unfused engine")
        if cfg.dropout_p > 0 and aux.dropout_generator is not None:
            default = torch.cuda.default_generators[q.device.index or 0] if q.is_cuda else None
            if aux.dropout_generator is not default:
                raise ValueError(f"{name} draws dropout from torch's default CUDA generator; a custom "
                                 "dropout_generator is not supported")
        if q.dtype != k.dtype or q.dtype != v.dtype:
            raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
        if self.same_head_dims and q.shape[-1] != v.shape[-1]:
            raise ValueError(f"head_dim_qk={q.shape[-1]} != head_dim_v={v.shape[-1]}: {name} takes one head dim "
                             "for q, k and v")
        if cfg.qkv_format != "thd" and not has_padding(cfg.attn_mask_type) and needs_top_left(cfg):
            sq, skv = (q.shape[0], k.shape[0]) if cfg.qkv_format == "sbhd" else (q.shape[1], k.shape[1])
            if sq != skv:
                raise ValueError(
                    f"attn_mask_type={cfg.attn_mask_type!r} is aligned top-left, but FlashAttention aligns the "
                    f"diagonal bottom-right; they agree only when seqlen_q == seqlen_kv (got {sq} and {skv}). "
                    "Use causal_bottom_right.")
        return KernelCall(scale=float(cfg.softmax_scale), window=tuple(cfg.window_size), dropout_p=float(cfg.dropout_p),
                          alibi_slopes=self._alibi(q, aux, cfg), sink=self._sink(q, aux, cfg),
                          sink_learnable=cfg.softmax_type == "learnable", deterministic=bool(cfg.deterministic),
                          softcap=float(cfg.softcap))

    def _alibi(self, q: torch.Tensor, aux: AttnAux, cfg: AttnConfig) -> torch.Tensor | None:
        if cfg.bias_type != "alibi":
            return None
        slopes = aux.alibi_slopes
        heads = q.shape[-2]
        if slopes is None:
            raise ValueError("core_attention_bias_type='alibi' needs aux.alibi_slopes (float32 [h] or [b, h]); "
                             "got None")
        if slopes.dim() not in (1, 2) or slopes.shape[-1] != heads:
            raise ValueError(f"alibi_slopes has shape {list(slopes.shape)}; it must be [h] or [b, h] with h={heads}")
        return slopes.to(device=q.device, dtype=torch.float32).contiguous()

    def _sink(self, q: torch.Tensor, aux: AttnAux, cfg: AttnConfig) -> torch.Tensor | None:
        heads = q.shape[-2]
        if cfg.softmax_type == "vanilla":
            return None
        if cfg.softmax_type == "off-by-one":  # exp(S_i) / (1 + sum exp(S)): a sink logit of 0 in every head
            zeros = self.__dict__.setdefault("_zero_sinks", {})  # made once per (heads, device): no kernel per call
            sink = zeros.get((heads, q.device))
            if sink is None:
                sink = zeros[(heads, q.device)] = torch.zeros(heads, dtype=torch.float32, device=q.device)
            return sink
        offset = aux.softmax_offset
        if offset is None:
            raise ValueError("softmax_type='learnable' needs aux.softmax_offset (float32 [h], the sink logit); "
                             "got None")
        if offset.dim() != 1 or offset.shape[0] != heads:
            raise ValueError(f"softmax_offset has shape {list(offset.shape)}; it must be [h] with h={heads}")
        return offset.detach().to(device=q.device, dtype=torch.float32).contiguous()

    # --- the engine interface -------------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig) -> FwdResult:
        call = self._resolve(q, k, v, aux, cfg)
        fmt = cfg.qkv_format
        if fmt == "thd":
            varlen = thd_varlen(q, aux, cfg)
            out, lse, kstate = self._kernel_fwd(q, k, v, varlen, call, None)
            facts = host_facts(aux, q)
            if facts is None or facts.keyless_rows:
                lse = self._fix_lse(lse, call, varlen=varlen)
            end = None if facts is None else facts.end_q
            fill_rows_from_(out, end, varlen.cu_seqlens_q, 0.0)
            fill_rows_from_(lse, end, varlen.cu_seqlens_q, float("-inf"), dim=1)
            return FwdResult(out, lse, FlashState(kstate, None, varlen, call))
        q_b, k_b, v_b = (to_bshd(t, fmt) for t in (q, k, v))
        if has_padding(cfg.attn_mask_type):
            packing = pack_padded(q_b, k_b, aux, cfg)
            out_p, lse_p, kstate = self._kernel_fwd(packing.gather_q(q_b), packing.gather_kv(k_b),
                                                    packing.gather_kv(v_b), packing.varlen, call, None)
            out = q.new_zeros(*q.shape[:-1], v.shape[-1])
            packing.scatter(out_p, to_bshd(out, fmt), packing.q_index)
            lse = packing.scatter_lse(self._fix_lse(lse_p, call, varlen=packing.varlen), q_b.shape[0], q_b.shape[1])
            return FwdResult(out, lse, FlashState(kstate, packing, None, call))
        buffer = q.new_empty(*q.shape[:-1], v.shape[-1]) if self.takes_out_buffer else None
        out_b, lse, kstate = self._kernel_fwd(q_b, k_b, v_b, None, call,
                                              to_bshd(buffer, fmt) if buffer is not None else None)
        out = to_bshd(out_b, fmt)
        if not out.is_contiguous():
            out = out.contiguous()
        lse = self._fix_lse(lse, call, dense=(q_b.shape[1], k_b.shape[1]))
        return FwdResult(out, lse, FlashState(kstate, None, None, call))

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, state: Any, aux: AttnAux, cfg: AttnConfig) -> BwdResult:
        state = state if isinstance(state, FlashState) else FlashState()
        call = state.call or self._resolve(q, k, v, aux, cfg)
        fmt = cfg.qkv_format
        if fmt == "thd":
            varlen = state.varlen or thd_varlen(q, aux, cfg)
            facts = host_facts(aux, q)
            lse_in = lse if _no_neg_inf_rows(facts, q.shape[0]) else self._kernel_lse(lse, call)
            dq, dk, dv, dsink = self._kernel_bwd(dout, q, k, v, out, lse_in, state.kernel, varlen, call)
            end_q, end_kv = (None, None) if facts is None else (facts.end_q, facts.end_kv)
            fill_rows_from_(dq, end_q, varlen.cu_seqlens_q, 0.0)
            for grad in (dk, dv):
                fill_rows_from_(grad, end_kv, varlen.cu_seqlens_kv, 0.0)
            return BwdResult(dq, dk, dv, None, self._dsink(dsink, call))
        q_b, k_b, v_b, o_b, do_b = (to_bshd(t, fmt) for t in (q, k, v, out, dout))
        if has_padding(cfg.attn_mask_type):
            packing = state.packing or pack_padded(q_b, k_b, aux, cfg)
            dq_p, dk_p, dv_p, dsink = self._kernel_bwd(
                packing.gather_q(do_b), packing.gather_q(q_b), packing.gather_kv(k_b), packing.gather_kv(v_b),
                packing.gather_q(o_b), self._kernel_lse(packing.gather_lse(lse), call), state.kernel,
                packing.varlen, call)
            grads = []
            for packed, like, index in ((dq_p, q, packing.q_index), (dk_p, k, packing.kv_index),
                                        (dv_p, v, packing.kv_index)):
                full = torch.zeros_like(like)
                packing.scatter(packed, to_bshd(full, fmt), index)
                grads.append(full)
            return BwdResult(*grads, None, self._dsink(dsink, call))
        dq, dk, dv, dsink = self._kernel_bwd(do_b, q_b, k_b, v_b, o_b, self._kernel_lse(lse, call), state.kernel,
                                             None, call)
        return BwdResult(to_bshd(dq, fmt), to_bshd(dk, fmt), to_bshd(dv, fmt), None, self._dsink(dsink, call))

    # --- the lse convention: -inf for a row that sees no key ----------------------------------------------
    def _fix_lse(self, lse: torch.Tensor, call: KernelCall, *, varlen: Varlen | None = None,
                 dense: tuple[int, int] | None = None) -> torch.Tensor:
        right = call.window[1]
        if self.empty_rows_lse_positive_inf:
            if varlen is not None or empty_rows_possible(call.window, dense[0], dense[1]):
                lse = lse.masked_fill(lse == float("inf"), float("-inf"))
        elif call.sink is not None:  # flash-attn-4 reports the sink as the lse of an empty row
            if varlen is not None:
                lse = lse.masked_fill(empty_rows_varlen(varlen, lse.shape[-1], right)[None, :], float("-inf"))
            elif empty_rows_possible(call.window, dense[0], dense[1]):
                empty = min(dense[0], dense[0] - dense[1] - right)  # rows before the first visible key
                lse = lse.clone()
                lse[..., :empty] = float("-inf")
        return lse

    def _kernel_lse(self, lse: torch.Tensor, call: KernelCall) -> torch.Tensor:
        """Back to the kernel's own convention before backward (a sink row keeps lse = sink, not -inf)."""
        if call.sink is None or self.empty_rows_lse_positive_inf:
            return lse
        sink = call.sink.view(-1, 1) if lse.dim() == 2 else call.sink.view(1, -1, 1)
        return torch.where(torch.isneginf(lse), sink.expand_as(lse), lse)

    @staticmethod
    def _dsink(dsink: torch.Tensor | None, call: KernelCall) -> torch.Tensor | None:
        return dsink if dsink is not None and call.sink_learnable else None

    def _kernel_fwd(self, q, k, v, varlen: Varlen | None, call: KernelCall, out: torch.Tensor | None):
        raise NotImplementedError

    def _kernel_bwd(self, dout, q, k, v, out, lse, kernel_state, varlen: Varlen | None, call: KernelCall):
        raise NotImplementedError


def parameters_of(fn: Any) -> set[str] | None:
    """Parameter names of a (possibly torch.library.custom_op-wrapped) Python function; None if unknown."""
    import inspect

    target = getattr(fn, "_init_fn", fn)
    try:
        return set(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None


def _neutral(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return False
    return value is None or value is False or value == 0 or value == (UNBOUNDED, UNBOUNDED)


def bind_supported(fn: Any, values: dict[str, Any],
                   aliases: dict[str, tuple[str, ...]] | None = None) -> dict[str, Any]:
    """Keyword arguments for `fn` from `values`, across releases whose internal signatures differ.

    A value is passed under the first of its aliases that `fn` accepts; a value the function has no parameter
    for is dropped if it is neutral (None, False, 0, an unbounded window), and raises otherwise, so that a
    feature is never silently lost.
    """
    params = parameters_of(fn)
    if params is None:
        return dict(values)
    target = getattr(fn, "_init_fn", fn)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        names = (aliases or {}).get(key, (key,))
        name = next((n for n in names if n in params), None)
        if name is not None:
            kwargs[name] = value
        elif not _neutral(value):
            raise RuntimeError(f"{getattr(target, '__qualname__', fn)} has no parameter {key!r} (tried {names}); "
                               f"this release cannot run a call that needs {key}={value!r}")
    return kwargs
