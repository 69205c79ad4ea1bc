"""DotProductAttention's context-parallel forward: validate like the module does, select an engine that can
serve the per-block calls of this CP mode, then run attention() over cp_group.

Kept here (not in module.py) so the module needs only a one-line branch; tested by
tests/test_context_parallel.py. The module's tensors are this rank's shards; for thd, cu_seqlens_* describe
the whole sequences (Transformer Engine's convention) and max_seqlen_* (if given) the whole-sequence maximum.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from .. import inputs, sequences, validation
from ..call_args import CallArgs
from . import copy_engine, copy_engine_a2a
from .api import a2a_exchanges, attention, fail_collectively, ring_hops
from .engines import SelectedPerBlock
from .sharding import cp_size_of, local_cu_seqlens


def forward(module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: CallArgs, fp8: tuple | None = None
            ) -> Any:
    """The module's output ([s, b, h*dv] / [b, s, h*dv] / [t, h*dv]) for this rank's shard. fp8: (region, output in
    FP8) of a call inside fp8_autocast (question.fp8_context)."""
    group = module.cp_group
    try:
        plan, aux = _prepare(module, q, k, v, args, fp8)
    except Exception as exc:  # noqa: BLE001 - any error here would leave the other ranks waiting in attention()
        fail_collectively(exc, cp_group=group, cp_global_ranks=module.cp_global_ranks,
                          cp_comm_type=module.cp_comm_type)
    module.last_decision = plan.decision
    out = attention(plan.engine, q, k, v, aux, plan.cfg, cp_group=group, cp_global_ranks=module.cp_global_ranks,
                    cp_stream=module.cp_stream, cp_comm_type=module.cp_comm_type)
    transport = transport_note(module, plan.params, q.device)  # as explain() words it, now the transport is known
    if transport is not None:
        module.last_decision = plan.decision.with_notes(transport)
    return out.reshape(*out.shape[:-2], -1)


@dataclasses.dataclass(frozen=True)
class Described:
    """A CP call as selection sees it: params of this rank's shard with the CP mode; the rank's sequence facts
    (for thd, from the per-rank cu_seqlens); FP8's amax group where the call runs in FP8."""

    params: Any
    seq: Any
    mask_type: str
    amax_group: Any = None


def describe(module, q, k, v, args: CallArgs, fp8: tuple | None = None) -> Described:
    """Validate a CP call as the module would and describe it (forward plans from this, explain answers it)."""
    cp_size = cp_size_of(module.cp_group)
    amax_group = _fp8_amax_group(fp8[0], module.cp_group, module.cp_comm_type) if fp8 is not None else None
    fmt, mask_type, window = validation.resolve_call(module, args)
    if args.checkpoint_core_attention:
        raise ValueError("checkpoint_core_attention=True is not supported under context parallelism; the ring "
                         "already recomputes nothing it does not need (pass False)")
    # The module's checks see this rank's tensors: for thd, the per-rank cu_seqlens (global / cp_size).
    local = args
    if fmt == "thd":
        local = args.replace(
            **{name: _local_cu(name, getattr(args, name), cp_size)
               for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")},
            max_seqlen_q=None if args.max_seqlen_q is None else max(1, args.max_seqlen_q // cp_size),
            max_seqlen_kv=None if args.max_seqlen_kv is None else max(1, args.max_seqlen_kv // cp_size))
    seq = sequences.sequence_info(fmt, mask_type, q, k, local, window)
    params = inputs.build_params(module._spec_now(), fmt, mask_type, window, q, k, v, seq, local, module.training)
    a2a_size = dist.get_world_size(module.cp_group[0]) if module.cp_comm_type == "a2a+p2p" else None
    params = params.replace(cp_size=cp_size, cp_comm_type=module.cp_comm_type, cp_a2a_size=a2a_size)
    if fp8 is not None:
        region, output_fp8 = fp8
        params = params.replace(fp8=True, fp8_recipe=region.recipe.kind, fp8_output=output_fp8)
    return Described(params, seq, mask_type, amax_group)


def transport_note(module, params, device: torch.device) -> str | None:
    """How this call's ring hops (copy_engine.ring_for) or a2a exchanges (copy_engine_a2a) travel, or None where the
    call runs neither."""
    if a2a_exchanges(params.cp_comm_type, params.qkv_format, params.attn_mask_type, tuple(params.window_size),
                     params.max_seqlen_q, params.fp8):
        group = module.cp_group
        return copy_engine_a2a.describe_exchange(str(dist.get_backend(group)), group, device)
    if not ring_hops(params.cp_comm_type, params.qkv_format, params.attn_mask_type, tuple(params.window_size),
                     params.max_seqlen_q, params.fp8):
        return None
    group = module.cp_group[1] if params.cp_comm_type == "a2a+p2p" else module.cp_group
    return copy_engine.describe_transport(str(dist.get_backend(group)), group, device)


def _prepare(module, q, k, v, args: CallArgs, fp8: tuple | None = None):
    call = describe(module, q, k, v, args, fp8)
    params, seq = call.params, call.seq
    plans = module._plans
    plan = plans.by_params(plans.context_parallel, params,
                           lambda: _plan(module._spec_now(), params, module.cp_group))
    aux = inputs.make_aux(seq, call.mask_type, args.attention_mask, args.core_attention_bias, args.alibi_slopes,
                          module.softmax_offset)
    if params.qkv_format == "thd":  # attention() takes the whole-sequence cu_seqlens
        cp_size = params.cp_size
        aux = dataclasses.replace(aux, cu_seqlens_q=args.cu_seqlens_q, cu_seqlens_kv=args.cu_seqlens_kv,
                                  cu_seqlens_q_padded=args.cu_seqlens_q_padded,
                                  cu_seqlens_kv_padded=args.cu_seqlens_kv_padded,
                                  max_seqlen_q=seq.max_q * cp_size, max_seqlen_kv=seq.max_kv * cp_size)
    if fp8 is not None:  # made only once the call is planned: a refused call leaves the module without a state
        fp8_call = module._fp8_call(fp8, q.device)
        aux.extra["fp8"] = dataclasses.replace(fp8_call, group=call.amax_group, exchange_group=module.cp_group)
    return plan, aux


def _fp8_amax_group(region, cp_group, comm: str):
    """The group an FP8 call's amaxes are reduced over under context parallelism: fp8_autocast's fp8_group (as in
    Transformer Engine, which expects it to span the TP and CP ranks), else the CP group itself. The CP ranks
    exchange FP8 data, so they must agree on every scale: a group that misses one of them, or a recipe that
    does not reduce, is refused."""
    recipe = region.recipe
    if not recipe.reduce_amax:
        raise ValueError("fp8 recipe reduce_amax=False under context parallelism: the CP ranks exchange FP8 data and "
                         "must share their scales (Transformer Engine: 'Amax reduction across TP+CP group is "
                         "necessary when using context parallelism with FP8'); use reduce_amax=True")
    if region.group is None or comm != "a2a":
        return cp_group
    cp_ranks = set(dist.get_process_group_ranks(cp_group))
    fp8_ranks = set(dist.get_process_group_ranks(region.group))
    if not cp_ranks <= fp8_ranks:
        raise ValueError(f"fp8_autocast(fp8_group=...) holds ranks {sorted(fp8_ranks)}, which miss cp_group's ranks "
                         f"{sorted(cp_ranks - fp8_ranks)}: the CP ranks exchange FP8 data and must reduce their amaxes "
                         "together; pass an fp8_group that contains the CP group (TP x CP, as in Transformer Engine), "
                         "or none (the CP group is used)")
    return region.group


def _plan(spec, params, cp_group) -> inputs.Plan:
    """Selection on the CP call explains it (every table's '<family>.cp_support' check, and selection's
    composition over the per-block calls); each block then runs on the engine selection picks for that block's
    own params (SelectedPerBlock), with the module's forced backend if any."""
    plan = inputs.make_plan(spec, params)
    return dataclasses.replace(plan, engine=SelectedPerBlock(force=spec.backend, is_training=params.is_training,
                                                             fp8_recipe=params.fp8_recipe))


def _local_cu(name: str, cu, cp_size: int):
    if cu is None:
        return None
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32:
        raise ValueError(f"{name} must be an int32 tensor of whole-sequence offsets [b+1]; got {cu!r}")
    lengths = (cu[1:] - cu[:-1]).tolist()
    bad = [i for i, n in enumerate(lengths) if n % (2 * cp_size)]
    if bad:
        raise ValueError(f"{name}={cu.tolist()}: under context parallelism every sequence length must be a multiple "
                         f"of 2*cp_size={2 * cp_size}; sequence(s) {bad} are not (pad them)")
    return local_cu_seqlens(cu, cp_size)
