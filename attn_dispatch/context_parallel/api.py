"""attention(): context-parallel attention over torch.distributed, for any engine that returns the lse.

Checks run in two rounds: local ones (arguments, shapes, supported features) and, unless
ATTN_DISPATCH_CP_CHECKS=0, one collective round in which the ranks compare their calls. A problem on any
rank raises the same ValueError on every rank, before any K/V moves, so no rank waits forever.
"""
from __future__ import annotations

import dataclasses
import struct
from types import SimpleNamespace
from typing import Any

import torch

from ..backends.base import AttnAux, AttnConfig, Engine
from ._comm import GroupInfo, agree, checks_enabled, group_info
from ._layout import HEAD_DIM, NDIM, SEQ_DIM
from .a2a import A2AP2PAttention, HeadSplit
from .all_gather import AllGatherAttention
from .fp8_a2a import FP8A2AAttention
from .head_groups import A2AAttention, resolve_head_groups, seq_order
from .merge import sink_logits
from .p2p import P2PAttention, RingPlan
from .sharding import RankOrder, local_cu_seqlens
from .engines import SelectedPerBlock
from ..constraints.context_parallel import fp8_failures
from ..constraints.cp_bands import key_exchange
from .support import COMM_TYPES, is_windowed, unsupported_features
from .window_exchange import WindowExchangeAttention
from .window_ring import WindowP2PAttention, WindowRingPlan
from .copy_engine import ring_for
from .copy_engine_a2a import copy_engine_exchange

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FORMATS = ("bshd", "sbhd", "thd")
_SOFTMAX = ("vanilla", "off-by-one", "learnable")
_MASKS = ("no_mask", "causal", "padding", "padding_causal")


def attention(engine: Engine | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux,
              cfg: AttnConfig, *, cp_group, cp_global_ranks=None, cp_stream=None,
              cp_comm_type: str = "p2p", cp_a2a_head_groups: int | None = None) -> torch.Tensor:
    """This rank's attention output (cfg.qkv_format, heads not flattened) for its shard of the sequence.

    engine: the Engine every per-block call runs on, or None: each block's engine is then chosen by
    selection.select on that block's own AttentionParams (SelectedPerBlock), as a single-GPU call would be.
    A sliding window (cfg.window_size) needs the load-balanced layout, like a causal mask.

    q, k, v: local shards, in the load-balanced layout when the mask is causal (see sharding.shard). For thd,
    aux.cu_seqlens_q/kv describe the WHOLE sequences (Transformer Engine's convention); each rank holds
    cu_seqlens / cp_size tokens of each. Differentiable w.r.t. q, k, v and aux.softmax_offset; the sink's
    gradient on each rank covers that rank's rows (or heads, for a2a): summing over the cp group gives the
    full gradient, as for any weight whose gradients the data-parallel reduction sums.

    cp_a2a_head_groups (cp_comm_type='a2a' only): split each rank's heads into this many groups and overlap one
    group's all-to-alls with another's attention (head_groups.py). None: the environment variable
    ATTN_DISPATCH_CP_A2A_HEAD_GROUPS, else the default of head_groups.resolve_head_groups (1, no pipelining, until
    the schedule is timed on GPUs). Must divide num_heads / cp_size and num_gqa_groups / cp_size.
    """
    training = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    fp8 = aux.extra.get("fp8")
    if engine is None:
        engine = SelectedPerBlock(is_training=training, fp8_recipe=None if fp8 is None else fp8.state.recipe.kind)
    try:
        infos = _groups(cp_group, cp_global_ranks, cp_comm_type)
    except ValueError as exc:  # still tell the ranks of any usable group, which would otherwise wait
        _tell_usable_groups(cp_group, exc)
        raise
    error, groups = None, 1
    try:
        _check_local(engine, q, k, v, aux, cfg, cp_comm_type, infos)
        groups = _head_groups(cp_a2a_head_groups, q, k, aux, cfg, cp_comm_type, infos)
    except ValueError as exc:
        if not checks_enabled():
            raise
        error = str(exc)
    if checks_enabled():
        signature = _signature(q, k, v, aux, cfg, cp_comm_type, groups)
        for info in infos:
            agree(info, signature, _describe, error)
    impl = _build(engine, q, k, aux, cfg, cp_comm_type, infos, cp_stream, training, groups)
    learnable = cfg.softmax_type == "learnable"
    return _ContextParallel.apply(impl, cfg.softmax_type, _num_heads(q, cfg), q, k, v,
                                  aux.softmax_offset if learnable else None)


SIGNATURE_LEN = 23  # _signature's length, the same for every format
_FP8_RECIPES = ("delayed", "current")


def fail_collectively(error: Exception, *, cp_group, cp_global_ranks=None, cp_comm_type: str = "p2p") -> None:
    """Raise `error` here and, through the same collective check attention() runs, a ValueError quoting it on
    every other rank of cp_group (which is inside attention() or this function). For callers that validate
    before attention(), so that an error on one rank cannot leave the others waiting."""
    if checks_enabled():
        try:
            infos = _groups(cp_group, cp_global_ranks, cp_comm_type)
        except ValueError:
            raise error from None  # no usable group: nobody can be waiting on it
        message = f"{type(error).__name__}: {error}"
        try:
            for info in infos:
                agree(info, [0] * SIGNATURE_LEN, _describe, message)
        except ValueError:
            pass  # the collective message, which the other ranks raise; here the original is clearer
    try:
        raise error
    finally:  # else this frame, in error's traceback, holds error: a cycle keeping the call's tensors and groups
        del error


class _ContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, impl, softmax_type, num_heads, q, k, v, softmax_offset):  # noqa: D401
        sink = sink_logits(softmax_type, softmax_offset, num_heads, q.device, q.dtype)
        out, saved, meta = impl.forward(q, k, v, sink)
        ctx.impl, ctx.meta = impl, meta
        ctx.offset_dtype = None if softmax_offset is None else softmax_offset.dtype
        ctx.save_for_backward(*saved, sink)
        return out

    @staticmethod
    def backward(ctx, dout):
        *saved, sink = ctx.saved_tensors
        dq, dk, dv, dsink = ctx.impl.backward(dout, tuple(saved), ctx.meta, sink)
        doffset = dsink.to(ctx.offset_dtype) if ctx.offset_dtype is not None and dsink is not None else None
        return None, None, None, dq, dk, dv, doffset


def _num_heads(q: torch.Tensor, cfg: AttnConfig) -> int:
    return q.shape[HEAD_DIM[cfg.qkv_format]]


def _tell_usable_groups(cp_group, error: Exception) -> None:
    """A setup error (unknown comm type, wrong group list) on this rank: run the failing side of the collective
    check on every process group given that has >= 2 ranks, so that their other ranks raise too."""
    if not checks_enabled():
        return
    for group in (cp_group if isinstance(cp_group, (list, tuple)) else [cp_group]):
        try:
            info = group_info(group)
        except ValueError:
            continue
        try:
            agree(info, [0] * SIGNATURE_LEN, _describe, f"{type(error).__name__}: {error}")
        except ValueError:
            pass


def _groups(cp_group, cp_global_ranks, cp_comm_type) -> list[GroupInfo]:
    if cp_comm_type not in COMM_TYPES:
        raise ValueError(f"cp_comm_type={cp_comm_type!r} is not supported; expected one of "
                         f"{', '.join(map(repr, COMM_TYPES))}")
    if cp_comm_type == "a2a+p2p":
        if not isinstance(cp_group, (list, tuple)) or len(cp_group) != 2:
            raise ValueError(f"cp_group={cp_group!r}: cp_comm_type='a2a+p2p' needs a list of two process groups "
                             "[a2a_group, p2p_group]")
        if cp_global_ranks is not None:
            raise ValueError("cp_global_ranks must be None with cp_comm_type='a2a+p2p' (each group knows its ranks)")
        return [group_info(cp_group[0], name="cp_group[0] (a2a)"), group_info(cp_group[1], name="cp_group[1] (p2p)")]
    if isinstance(cp_group, (list, tuple)):
        raise ValueError(f"cp_group is a list of {len(cp_group)} groups, which only cp_comm_type='a2a+p2p' takes; "
                         f"cp_comm_type={cp_comm_type!r} takes one torch.distributed.ProcessGroup")
    return [group_info(cp_group, cp_global_ranks)]


def _check_local(engine, q, k, v, aux: AttnAux, cfg: AttnConfig, comm: str, infos: list[GroupInfo]) -> None:
    if not isinstance(engine, Engine):
        raise ValueError(f"engine={engine!r} must be an attn_dispatch.backends.Engine")
    fmt = cfg.qkv_format
    if fmt not in _FORMATS:
        raise ValueError(f"qkv_format={fmt!r} is not supported; expected one of {_FORMATS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != NDIM[fmt]:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} has shape {got}; qkv_format={fmt!r} takes {NDIM[fmt]}-d tensors")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device} but q is {q.dtype} on {q.device}; they must match")
    if q.dtype not in _DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported under context parallelism; use fp16, bf16, fp32 or fp64")
    problems = unsupported_features(comm, fmt, cfg.attn_mask_type, cfg.window_size, cfg.bias_type, cfg.dropout_p,
                                    cfg.softmax_type, cfg.return_max_logit)
    fp8 = aux.extra.get("fp8")
    if fp8 is not None:
        problems += [m for _, m, _ in fp8_failures(_fp8_view(fmt, comm, fp8))]
    for name, value in (("attention_mask", aux.attention_mask), ("core_attention_bias", aux.bias),
                        ("alibi_slopes", aux.alibi_slopes)):
        if value is not None:
            problems.append(f"{name} (a tensor was given) is not supported under context parallelism")
    if problems:
        raise ValueError("context parallelism (cp_comm_type=%r): %s" % (comm, "; ".join(problems)))
    sd, hd = SEQ_DIM[fmt], HEAD_DIM[fmt]
    h, hkv = q.shape[hd], k.shape[hd]
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in every dim but the last")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head dim {q.shape[-1]} != k head dim {k.shape[-1]}")
    if fmt != "thd" and q.shape[1 - sd] != k.shape[1 - sd]:
        raise ValueError(f"batch size of q ({q.shape[1 - sd]}) != batch size of k ({k.shape[1 - sd]})")
    if h % hkv:
        raise ValueError(f"num_heads={h} is not divisible by num_gqa_groups={hkv}")
    causal = "causal" in cfg.attn_mask_type
    windowed = is_windowed(cfg.attn_mask_type, cfg.window_size)
    if comm in ("a2a", "a2a+p2p"):
        size = infos[0].size
        if h % size or hkv % size:
            raise ValueError(f"cp_comm_type={comm!r} splits heads across the {size} ranks of the a2a group: "
                             f"num_heads={h} and num_gqa_groups={hkv} must both be divisible by {size}; "
                             "use cp_comm_type='p2p' or 'all_gather', or a smaller a2a group")
    if fmt == "thd":
        _check_thd(q, k, aux, causal, _cp_size(infos))
        return
    sq, skv = q.shape[sd], k.shape[sd]
    if causal and sq != skv:
        raise ValueError(f"attn_mask_type={cfg.attn_mask_type!r} under context parallelism needs self-attention: "
                         f"local q has {sq} tokens, local k has {skv}")
    if windowed and sq != skv:
        raise ValueError(f"window_size={tuple(cfg.window_size)} under context parallelism needs self-attention: "
                         f"local q has {sq} tokens, local k has {skv}")
    if (causal or windowed) and sq % 2:
        raise ValueError(f"local sequence length {sq} is odd; with a causal mask or a window each rank holds two "
                         "equal chunks "
                         f"(the sequence cut in 2*cp_size chunks): pad the sequence to a multiple of "
                         f"{2 * _cp_size(infos)}")
    if comm in ("a2a", "a2a+p2p") and sq != skv:
        raise ValueError(f"cp_comm_type={comm!r} needs equal local q and kv lengths; got {sq} and {skv}")


def _check_thd(q, k, aux: AttnAux, causal: bool, cp_size: int) -> None:
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        cu = getattr(aux, name)
        if cu is None or cu.dtype != torch.int32 or cu.dim() != 1:
            raise ValueError(f"{name}={cu!r}: qkv_format='thd' needs int32 [b+1] cu_seqlens of the whole sequences")
        padded = getattr(aux, name.replace("cu_seqlens", "cu_seqlens") + "_padded")
        if padded is not None and not torch.equal(padded.cpu(), cu.cpu()):
            raise ValueError(f"{name}_padded differs from {name}: padding between sequences is not supported under "
                             "context parallelism in attn-dispatch; pack sequences without gaps")
    cu_q, cu_kv = aux.cu_seqlens_q.tolist(), aux.cu_seqlens_kv.tolist()
    if len(cu_q) != len(cu_kv):
        raise ValueError(f"cu_seqlens_q has {len(cu_q) - 1} sequences, cu_seqlens_kv {len(cu_kv) - 1}")
    if causal and cu_q != cu_kv:
        raise ValueError("a causal mask under context parallelism needs self-attention: cu_seqlens_q != cu_seqlens_kv")
    for name, cu, t in (("cu_seqlens_q", cu_q, q), ("cu_seqlens_kv", cu_kv, k)):
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        bad = [i for i, n in enumerate(lengths) if n % (2 * cp_size)]
        if cu[0] != 0 or any(n < 0 for n in lengths) or bad:
            raise ValueError(f"{name}={cu}: must start at 0, not decrease, and every sequence length must be a "
                             f"multiple of 2*cp_size={2 * cp_size} (sequence(s) {bad} are not); pad them")
        if t.shape[0] != cu[-1] // cp_size:
            raise ValueError(f"{'q' if t is q else 'k'} holds {t.shape[0]} tokens; with {name}[-1]={cu[-1]} and "
                             f"cp_size={cp_size} each rank must hold {cu[-1] // cp_size}")


def _fp8_view(fmt: str, comm: str, fp8) -> Any:
    """What fp8_failures reads of an FP8 call, for calls made without AttentionParams (this API)."""
    return SimpleNamespace(cp_size=2, fp8=True, cp_comm_type=comm, qkv_format=fmt, fp8_output=fp8.output_fp8)


def _cp_size(infos: list[GroupInfo]) -> int:
    size = 1
    for info in infos:
        size *= info.size
    return size


_DTYPE_CODES = {dt: i for i, dt in enumerate(_DTYPES)}


def _head_groups(requested, q, k, aux: AttnAux, cfg: AttnConfig, comm: str, infos: list[GroupInfo]) -> int:
    """The a2a head-group count (1 for the other comm types, which take no cp_a2a_head_groups but 1)."""
    if comm != "a2a":
        if requested not in (None, 1):
            raise ValueError(f"cp_a2a_head_groups={requested!r} applies to cp_comm_type='a2a' only; got "
                             f"cp_comm_type={comm!r} (pass None)")
        return 1
    if "fp8" in aux.extra:  # FP8 a2a exchanges FP8 data in one group (fp8_a2a.py)
        if requested not in (None, 1):
            raise ValueError(f"cp_a2a_head_groups={requested!r}: FP8 attention under cp_comm_type='a2a' runs in one "
                             "head group; pass None or 1")
        return 1
    hd = HEAD_DIM[cfg.qkv_format]
    tokens = q.numel() // (q.shape[hd] * q.shape[-1])
    return resolve_head_groups(requested, q.shape[hd], k.shape[hd], infos[0].size, tokens * q.shape[-1])


def _signature(q, k, v, aux: AttnAux, cfg: AttnConfig, comm: str, groups: int) -> list[int]:
    fmt = cfg.qkv_format
    code = lambda value, options: options.index(value) if value in options else -1  # noqa: E731
    scale_bits = int.from_bytes(struct.pack("<d", float(cfg.softmax_scale)), "little", signed=True)
    sig = [code(fmt, _FORMATS), code(comm, COMM_TYPES), code(cfg.attn_mask_type, _MASKS),
           code(cfg.softmax_type, _SOFTMAX), _DTYPE_CODES.get(q.dtype, -1), scale_bits, *map(int, cfg.window_size)]
    sig += [*q.shape, *k.shape, v.shape[-1]] + [0] * (4 - q.dim()) * 2
    if fmt == "thd" and aux.cu_seqlens_q is not None and aux.cu_seqlens_kv is not None:
        cu_q, cu_kv = aux.cu_seqlens_q.tolist(), aux.cu_seqlens_kv.tolist()
        sig += [len(cu_q), sum(cu_q), len(cu_kv), sum(cu_kv)]
    else:
        sig += [0, 0, 0, 0]
    fp8 = aux.extra.get("fp8")
    sig.append(0 if fp8 is None else 1 + _FP8_RECIPES.index(fp8.state.recipe.kind))
    sig.append(groups)
    assert len(sig) == SIGNATURE_LEN
    return sig


def _describe(sig: list[int]) -> str:
    names = lambda options, i: options[i] if 0 <= i < len(options) else "?"  # noqa: E731
    fmt = names(_FORMATS, sig[0])
    n = NDIM.get(fmt, 4)
    q_shape, k_shape = sig[8:8 + n], sig[8 + n:8 + 2 * n]
    scale = struct.unpack("<d", int(sig[5]).to_bytes(8, "little", signed=True))[0]
    sd = SEQ_DIM.get(fmt, 1)
    text = (f"{fmt} q{tuple(q_shape)} k{tuple(k_shape)} (local sq={q_shape[sd]}, skv={k_shape[sd]}) "
            f"{names(COMM_TYPES, sig[1])} {names(_MASKS, sig[2])} {names(_SOFTMAX, sig[3])} "
            f"{names([str(d) for d in _DTYPES], sig[4])} softmax_scale={scale:.6g} window_size=({sig[6]}, {sig[7]})")
    if fmt == "thd":
        text += f" cu_seqlens: {sig[-6] - 1} seqs, checksum {sig[-5]}"
    text += " not FP8" if sig[-2] == 0 else f" FP8 ({names(_FP8_RECIPES, sig[-2] - 1)} scaling)"
    return text + f" a2a head groups={sig[-1]}"


def ring_hops(comm: str, fmt: str, attn_mask_type: str, window_size, local_len: int, fp8: bool) -> bool:
    """Whether _build runs the call over a ring (p2p.py, window_ring.py; the ring of a2a+p2p), whose hops
    copy_engine.ring_for carries, rather than collectives or a window's key exchange. local_len: this rank's
    tokens (bshd/sbhd)."""
    return comm in ("p2p", "a2a+p2p") and not _exchanges_keys(comm, fmt, attn_mask_type, window_size, local_len, fp8)


def a2a_exchanges(comm: str, fmt: str, attn_mask_type: str, window_size, local_len: int, fp8: bool) -> bool:
    """Whether _build runs the call as head_groups.A2AAttention, whose exchanges copy_engine_a2a may carry (FP8 a2a
    and a window's key exchange use collectives)."""
    return comm == "a2a" and not fp8 and not _exchanges_keys(comm, fmt, attn_mask_type, window_size, local_len, fp8)


def _exchanges_keys(comm: str, fmt: str, attn_mask_type: str, window_size, local_len: int, fp8: bool) -> bool:
    """Whether a windowed call fetches just its window's keys (window_exchange.py) instead of its comm's schedule."""
    return is_windowed(attn_mask_type, window_size) and key_exchange(comm, fmt, local_len // 2, window_size, fp8)


def _build(engine, q, k, aux: AttnAux, cfg: AttnConfig, comm: str, infos: list[GroupInfo], stream, training: bool,
           groups: int):
    fmt = cfg.qkv_format
    causal = "causal" in cfg.attn_mask_type
    if fmt == "thd":  # the engine sees thd as padding masks, one sequence at a time
        cfg = dataclasses.replace(cfg, attn_mask_type="padding_causal" if causal else "padding")
    sd = SEQ_DIM[fmt]
    windowed = is_windowed(cfg.attn_mask_type, cfg.window_size)
    if _exchanges_keys(comm, fmt, cfg.attn_mask_type, cfg.window_size, q.shape[sd], "fp8" in aux.extra):
        return WindowExchangeAttention(engine, cfg, aux, fmt, infos[0], q.shape[sd])
    if windowed and comm == "p2p":
        return WindowP2PAttention(engine, WindowRingPlan(cfg, aux, fmt, q.shape[sd], infos[0]), infos[0],
                                  ring_for(infos[0], stream, q.device), training)
    if comm == "p2p":
        return P2PAttention(engine, _ring_plan(cfg, aux, fmt, causal, q.shape[sd], k.shape[sd], 1, infos[0].size),
                            infos[0], ring_for(infos[0], stream, q.device), training)
    if comm == "all_gather":
        return AllGatherAttention(engine, cfg, aux, fmt, infos[0], causal, q.shape[sd], k.shape[sd], q.device)
    a2a = infos[0]
    if comm == "a2a":
        whole = dataclasses.replace(aux, max_seqlen_q=q.shape[sd] * a2a.size, max_seqlen_kv=k.shape[sd] * a2a.size,
                                    softmax_offset=None)
        if fmt == "thd":
            whole = _thd_aux(aux, divisor=1)
        if "fp8" in aux.extra:
            order = _rank_order(fmt, a2a.size, aux, causal or windowed, q.device, outer=1)
            return FP8A2AAttention(engine, cfg, whole, HeadSplit(fmt, a2a, order), training)
        lengths = None
        if fmt == "thd":
            cu = aux.cu_seqlens_q.tolist()
            lengths = tuple(b - a for a, b in zip(cu, cu[1:]))
        order = seq_order(fmt, a2a.size, q.shape[sd], causal or windowed, lengths)
        exchange, _ = copy_engine_exchange(a2a, q.device, groups)
        return A2AAttention(engine, cfg, whole, fmt, a2a, order, groups, exchange)
    order = _rank_order(fmt, a2a.size, aux, causal or windowed, q.device, outer=infos[1].size)
    split = HeadSplit(fmt, a2a, order)
    p2p = infos[1]
    if windowed:
        plan = WindowRingPlan(cfg, aux, fmt, q.shape[sd] * a2a.size, p2p)
        return A2AP2PAttention(split, WindowP2PAttention(engine, plan, p2p, ring_for(p2p, stream, q.device), training))
    plan = _ring_plan(cfg, aux, fmt, causal, q.shape[sd] * a2a.size, k.shape[sd] * a2a.size, a2a.size, p2p.size)
    return A2AP2PAttention(split, P2PAttention(engine, plan, p2p, ring_for(p2p, stream, q.device), training))


def _rank_order(fmt, size, aux: AttnAux, positional: bool, device, outer: int) -> RankOrder | None:
    """The all-to-all delivers the group's shards in rank order; bshd/sbhd with no mask and no window can stay
    that way, causal masks, windows and thd (sequences must be contiguous for cu_seqlens) need natural order."""
    if fmt == "thd":
        cu = aux.cu_seqlens_q.tolist()
        return RankOrder(fmt, size, device, [(b - a) // outer for a, b in zip(cu, cu[1:])])
    return RankOrder(fmt, size, device) if positional else None


def _thd_aux(aux: AttnAux, divisor: int) -> AttnAux:
    cu_q = local_cu_seqlens(aux.cu_seqlens_q, divisor)
    cu_kv = local_cu_seqlens(aux.cu_seqlens_kv, divisor)
    max_len = lambda cu: int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0  # noqa: E731
    return AttnAux(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_kv,
                   max_seqlen_q=max_len(cu_q), max_seqlen_kv=max_len(cu_kv), extra=aux.extra)


def _ring_plan(cfg, aux: AttnAux, fmt, causal, sq, skv, gathered: int, ring_size: int) -> RingPlan:
    """gathered: how many ranks' shards one ring member holds (a2a size for a2a+p2p, else 1)."""
    if fmt != "thd":
        return RingPlan(cfg, aux, fmt, causal, sq, skv)
    local = _thd_aux(aux, ring_size)
    return RingPlan(cfg, aux, fmt, causal, sq, skv, local.cu_seqlens_q, local.cu_seqlens_kv,
                    local.max_seqlen_q, local.max_seqlen_kv)
