"""From a validated call to a Plan: AttentionParams (the question), the selected engine, AttnConfig (static engine
config) and AttnAux (per-call tensors). validation.py checks the arguments, sequences.py derives the sequence
facts; plans.py keeps the plans a module made.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import selection
from .backends import ENGINE_CLASSES, EngineUnavailableError, get_engine
from .backends.base import AttnAux, AttnConfig, Engine
from .call_args import CallArgs
from .decision import Decision
from .env import PRIVATE_TORCH
from .freshness import current_stamp
from .params import AttentionParams, SeqLengths
from .sequences import SeqInfo, packed_facts
from .validation import ModuleSpec, check_attention_mask, check_bias, check_qkv


@dataclass
class Plan:
    """Everything fixed for one call signature."""

    params: AttentionParams
    decision: Decision
    engine: Engine
    cfg: AttnConfig
    stamp: tuple = ()  # freshness.current_stamp() when made: the plan stands while the current stamp equals it


# Plans one call signature keeps for thd/padding calls (one per sequence count and longest-sequence pair seen);
# beyond it the least recently used is dropped, so that a stream of packed batches cannot grow them without bound.
MAX_DYNAMIC_PLANS = 64


@dataclass
class Entry:
    """What one raw call signature resolved to. Sequence facts that depend on tensor contents (thd, padding
    masks) are 'dynamic': re-derived per call, with one Plan per SeqInfo.plan_key (every sequence fact that
    AttentionParams holds: the number of sequences, the longest on each side, gaps, differing lengths)."""

    fmt: str
    mask_type: str
    window: tuple[int, int]
    dynamic: bool
    seq: "SeqInfo | None" = None
    plans: dict = field(default_factory=dict)


@dataclass
class FastHit:
    """A validated plan for calls passing only q, k, v; aux is shared by those calls (None: built per call)."""

    plan: Plan
    aux: AttnAux | None
    max_q: int
    max_kv: int
    guard: Callable[..., bool] | None = None  # tensor_guard of the q, k, v that were validated
    call: Callable[..., Any] | None = None  # the engine's bind_fast for them: (q, k, v) -> out, under the guard
    # For the SDPA function: (guard, call) on its [b, h, s, d] tensors (bind_fast(layout="bhsd")), bound on the
    # plan's second use; None: not yet asked; False: the engine binds none.
    bhsd: Any = None


def tensor_guard(*tensors: torch.Tensor, free_dims: tuple | None = None) -> Callable[..., bool] | None:
    """A check that later tensors match these in dtype, device, shape, strides and requires_grad, done in C++
    by one call (the tensor guard torch.compile uses; ~0.8 us for q, k, v where reading those attributes from
    Python costs ~2 us). free_dims: per tensor, a dim whose size is left free (and the strides of the dims before
    it, which follow from it in a row-major layout), or None: exact. None where this torch lays it out
    otherwise (or leaves no dim free): callers then compare Python keys."""
    if _TensorGuards is None or (free_dims is not None and not _FREE_DIMS[0]):
        return None
    sizes, strides = [list(t.shape) for t in tensors], [list(t.stride()) for t in tensors]
    for i, dim in enumerate(free_dims or ()):
        if dim is not None:
            sizes[i][dim] = None
            strides[i][:dim] = [None] * dim
    try:
        return _TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides).check
    except Exception:  # noqa: BLE001 - a private API: any surprise means "not available"
        return None


def _load_tensor_guards() -> Any:
    """torch._C._dynamo.guards.TensorGuards if it behaves as expected here (checked once on tiny tensors), and
    whether it leaves a dim free as tensor_guard asks (_FREE_DIMS)."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        a, b = torch.zeros(2, 3), torch.zeros(3, 2)
        guard = TensorGuards(a, b, dynamic_dims_sizes=[[2, 3], [3, 2]], dynamic_dims_strides=[[3, 1], [2, 1]])
        ok = (guard.check(torch.ones(2, 3), torch.ones(3, 2)) and not guard.check(torch.ones(3, 2), b)
              and not guard.check(a, b.double()) and not guard.check(a.t().contiguous().t(), b)
              and not guard.check(a.requires_grad_(), b) and not guard.check("a", b))
    except Exception:  # noqa: BLE001
        return None
    if not ok:
        return None
    try:  # a [2, n, 4] with n free: any n, the rest exact
        c = torch.zeros(2, 3, 4)
        free = TensorGuards(c, dynamic_dims_sizes=[[2, None, 4]], dynamic_dims_strides=[[None, 4, 1]])
        _FREE_DIMS[0] = (free.check(torch.ones(2, 5, 4)) and free.check(torch.ones(2, 9, 4)[:, :5])
                         and not free.check(torch.ones(2, 5, 3)) and not free.check(torch.ones(3, 5, 4))
                         and not free.check(torch.ones(2, 5, 4).double())
                         and not free.check(torch.ones(2, 4, 5).transpose(1, 2)))
    except Exception:  # noqa: BLE001
        _FREE_DIMS[0] = False
    return TensorGuards


_FREE_DIMS = [False]  # whether TensorGuards leaves a dim free here (_load_tensor_guards)
_TensorGuards = _load_tensor_guards() if PRIVATE_TORCH else None


# A one-query inference step over more than this many keys (a decode step over a growing cache) is decided for its
# key length rounded up to a multiple of it, so that each new token does not cost a new decision (~0.7 ms of host
# time per step on a 2-core CPU: selection's checks and the profile's prediction). Every check that reads the key
# length passes or fails alike there for one query row (bounds at multiples of 128, windows idle only if idle at
# the call's own length), except cuDNN < 9's multiple-of-64 rule, which the graph build then enforces.
DECODE_KV_STEP = 128


def decided_kv_length(fmt: str, max_q: int, max_kv: int, training: bool) -> int:
    """The key length a call is decided for: max_kv, or for a one-query inference step (bshd/sbhd) over more than
    DECODE_KV_STEP keys, max_kv rounded up to a multiple of DECODE_KV_STEP."""
    if training or max_q != 1 or fmt == "thd" or max_kv <= DECODE_KV_STEP:
        return max_kv
    return -(-max_kv // DECODE_KV_STEP) * DECODE_KV_STEP


def decode_bucket_cut(fmt: str, q, k, v, args: CallArgs, training: bool) -> tuple[int, int] | None:
    """(the keys' dim, the first key length of its bucket) for a one-query inference step decided per DECODE_KV_STEP
    keys; None for any other call. Every call of a bucket cut there (CallArgs.plan_key's kv_cut) has the same key
    exactly when the calls differ only in the key length, which every key-length dim holds (the keys', the values',
    a mask's or bias's last), so they validate alike and are decided alike (decided_kv_length): the cut call's plan
    key names the one plan they share. A dim that disagrees with the keys' length is left to the full path, which
    says what is wrong."""
    if training or fmt == "thd" or args.max_seqlen_kv is not None:
        return None
    dim = 1 if fmt == "bshd" else 0
    try:
        sq, skv = q.shape[dim], k.shape[dim]
        if sq != 1 or skv <= DECODE_KV_STEP or v.shape[dim] != skv:
            return None
    except (AttributeError, IndexError):  # not tensors of the format's rank: the full path says so
        return None
    for x in (args.attention_mask, args.core_attention_bias):
        if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[-1] not in (1, skv)):
            return None
    return dim, decided_kv_length(fmt, sq, skv, training) - DECODE_KV_STEP + 1


def decode_bucket_lengths(fmt: str, q, k, v, args: CallArgs, training: bool) -> tuple[int, int]:
    """(first, last) key length of the calls that share this call's plan, the call being the same but for its key
    length: a one-query inference step's key-length bucket (decode_bucket_cut), the call's own length otherwise."""
    cut = decode_bucket_cut(fmt, q, k, v, args, training)
    if cut is None:
        skv = k.shape[1 if fmt == "bshd" else 0]
        return skv, skv
    return cut[1], cut[1] + DECODE_KV_STEP - 1


def build_params(spec: ModuleSpec, fmt: str, mask_type: str, window: tuple[int, int], q, k, v, seq: SeqInfo,
                 args: CallArgs, training: bool) -> AttentionParams:
    """Validates the static facts of a call and describes it."""
    bias_type, bias, alibi_slopes = args.core_attention_bias_type, args.core_attention_bias, args.alibi_slopes
    attention_mask = args.attention_mask
    check_qkv(spec, fmt, q, k, v)
    check_attention_mask(mask_type, attention_mask, q, seq.batch, seq.max_q, seq.max_kv)
    bias_shape, alibi_shape = check_bias(bias_type, bias, alibi_slopes, q, seq.batch, seq.max_q, seq.max_kv)
    return AttentionParams(
        dtype=q.dtype, qkv_format=fmt, batch_size=seq.batch, num_heads=q.shape[-2], num_gqa_groups=k.shape[-2],
        head_dim_qk=q.shape[-1], head_dim_v=v.shape[-1], max_seqlen_q=seq.max_q,
        max_seqlen_kv=decided_kv_length(fmt, seq.max_q, seq.max_kv, training),
        attn_mask_type=mask_type, window_size=window, bias_type=bias_type, bias_shape=bias_shape,
        bias_requires_grad=bool(bias is not None and bias.requires_grad), alibi_slopes_shape=alibi_shape,
        dropout=spec.attention_dropout if training else 0.0, softmax_type=spec.softmax_type,
        return_max_logit=spec.return_max_logit, is_training=training, deterministic=spec.deterministic,
        cp_size=1, cp_comm_type=spec.cp_comm_type, pad_between_seqs=seq.pad_between_seqs,
        seqlens_differ=seq.lengths_differ, packed_fill=seq.fill, packed_token_fill=seq.token_fill,
        packed_window_fill=seq.window_fill,
        device_type="cuda" if q.device.type == "cuda" else q.device.type, softcap=spec.softcap,
        mask_mod=spec.mask_mod, score_mod=spec.score_mod,
    )


def build_config(spec: ModuleSpec, params: AttentionParams) -> AttnConfig:
    return AttnConfig(
        qkv_format=params.qkv_format, attn_mask_type=params.attn_mask_type, window_size=params.window_size,
        softmax_scale=spec.softmax_scale, dropout_p=params.dropout, bias_type=params.bias_type,
        softmax_type=params.softmax_type, deterministic=params.deterministic,
        return_max_logit=params.return_max_logit, softcap=params.softcap,
    )


def plain_params(params: AttentionParams) -> tuple[AttentionParams, tuple[str, ...]]:
    """(the params the engines run, notes on how the call was read): a window side that masks nothing at the
    call's lengths is dropped (AttentionParams.without_idle_window), so every engine of the plain mask qualifies."""
    notes: tuple[str, ...] = ()
    if (params.max_seqlen_q == 1 and not params.is_training and params.qkv_format != "thd" and params.cp_size == 1
            and not params.inference_kv_cache and params.max_seqlen_kv % DECODE_KV_STEP == 0):
        notes = (f"a one-query step is decided per {DECODE_KV_STEP} keys: max_seqlen_kv={params.max_seqlen_kv} is the "
                 f"call's key length rounded up to a multiple of {DECODE_KV_STEP} (a growing cache is not decided "
                 "anew each token); the engine runs the call's own length",)
    plain = params.without_idle_window()
    if plain is params:
        return params, notes
    return plain, notes + (f"window_size={params.window_size} masks nothing at max_seqlen_q={params.max_seqlen_q}, "
                           f"max_seqlen_kv={params.max_seqlen_kv}: run as window_size={plain.window_size}",)


def make_plan(spec: ModuleSpec, params: AttentionParams, lengths: SeqLengths | None = None) -> Plan:
    """Select and load the engine. One that fails to load (a flash-attn wheel built for another torch, say) is
    recorded (runtime_facts, which its table then reports as the reason, and which makes decisions anew), and
    selection runs again without it; a forced one raises with that reason. lengths: a packed call's own, for a
    policy that times it (SeqInfo.lengths)."""
    params, notes = plain_params(params)
    for _ in range(len(ENGINE_CLASSES) + 1):
        stamp = current_stamp()
        decision = selection.select(params, force=spec.backend, policy=spec.policy, lengths=lengths)
        try:
            engine = get_engine(decision.chosen)
        except EngineUnavailableError:  # recorded as a runtime fact: selecting again leaves it out
            continue
        selection.warn_unfused_fallback(decision)
        return Plan(params, decision.with_notes(*notes), engine, build_config(spec, params), stamp)
    raise RuntimeError(f"no engine could be loaded for {params.describe()}")


def make_aux(seq: SeqInfo, mask_type: str, attention_mask: Any, bias: Any, alibi_slopes: Any,
             softmax_offset: torch.Tensor | None, window: tuple[int, int] | None = None) -> AttnAux:
    """window: the call's normalised window, for the thd host facts (AttnAux.packed); None leaves them unknown."""
    return AttnAux(
        cu_seqlens_q=seq.cu_q, cu_seqlens_kv=seq.cu_kv, cu_seqlens_q_padded=seq.cu_q_padded,
        cu_seqlens_kv_padded=seq.cu_kv_padded, max_seqlen_q=seq.max_q, max_seqlen_kv=seq.max_kv,
        attention_mask=attention_mask if mask_type == "arbitrary" else None, bias=bias,
        alibi_slopes=alibi_slopes, softmax_offset=softmax_offset,
        packed=None if window is None else packed_facts(seq, mask_type, window),
    )
