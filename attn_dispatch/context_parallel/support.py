"""What OUR context-parallel implementation supports, per comm type, as data for the constraint tables.

Two questions decide whether an engine can serve a context-parallel call:
1. does this implementation support the call's features for the comm type (`unsupported_features`,
   `params_failures`), and
2. can the engine run every per-block call the implementation will make (`engine_block_params`): those are
   plain calls (cp_size=1, softmax 'vanilla', no bias/dropout), so the engine's own table answers them.
   Engines must also return the lse and take a merged out/lse in backward (backends/base.py says all do).
Transformer Engine's rules differ (facts.md, "Context parallelism"): it has no learnable sinks under p2p or
all_gather, and no unfused CP at all. This module states what attn-dispatch does.
"""
from __future__ import annotations

from dataclasses import dataclass

SOURCE = "attn_dispatch.context_parallel (our implementation; see support.py)"
COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
_BSHD_MASKS = ("no_mask", "causal")
_THD_MASKS = ("padding", "padding_causal", "no_mask", "causal")  # thd masks are per sequence either way


@dataclass(frozen=True)
class CommTypeSupport:
    comm_type: str
    formats: tuple[str, ...]
    masks: dict[str, tuple[str, ...]]  # per format
    bias_types: tuple[str, ...] = ("no_bias",)
    sliding_window: bool = False
    dropout: bool = False
    softmax_types: tuple[str, ...] = SOFTMAX_TYPES
    return_max_logit: bool = False
    cross_attention: str = "no_mask only (local q and kv lengths may differ)"
    heads_divisible_by_group: bool = False
    groups: int = 1
    engine_block_masks: tuple[str, ...] = ()  # what the engine is called with
    notes: str = ""


SUPPORT: dict[str, CommTypeSupport] = {
    "p2p": CommTypeSupport(
        "p2p", ("bshd", "sbhd", "thd"), {"bshd": _BSHD_MASKS, "sbhd": _BSHD_MASKS, "thd": _THD_MASKS},
        engine_block_masks=("no_mask", "causal", "padding", "padding_causal"),
        notes="ring of batched isend/irecv; causal needs the load-balanced layout; sink merged once at the end"),
    "all_gather": CommTypeSupport(
        "all_gather", ("bshd", "sbhd"), {"bshd": _BSHD_MASKS, "sbhd": _BSHD_MASKS},
        engine_block_masks=("no_mask", "causal"),
        notes="thd is not supported (nor in Transformer Engine); causal: square causal diagonal chunks plus "
              "unmasked key prefixes, merged with the lse"),
    "a2a": CommTypeSupport(
        "a2a", ("bshd", "sbhd", "thd"), {"bshd": _BSHD_MASKS, "sbhd": _BSHD_MASKS, "thd": _THD_MASKS},
        cross_attention="no (local q and kv lengths must be equal)", heads_divisible_by_group=True,
        engine_block_masks=("no_mask", "causal", "padding", "padding_causal"),
        notes="num_heads and num_gqa_groups divisible by cp_size"),
    "a2a+p2p": CommTypeSupport(
        "a2a+p2p", ("bshd", "sbhd", "thd"), {"bshd": _BSHD_MASKS, "sbhd": _BSHD_MASKS, "thd": _THD_MASKS},
        cross_attention="no (local q and kv lengths must be equal)", heads_divisible_by_group=True, groups=2,
        engine_block_masks=("no_mask", "causal", "padding", "padding_causal"),
        notes="cp_group = [a2a_group, p2p_group]; heads divisible by the a2a group size; layout rank = "
              "p2p_rank * a2a_size + a2a_rank"),
}


def unsupported_features(comm_type: str, qkv_format: str, mask_type: str, window_size, bias_type: str,
                         dropout: float, softmax_type: str, return_max_logit: bool) -> list[str]:
    """Messages for every feature of a call that this implementation does not support under comm_type."""
    s = SUPPORT.get(comm_type)
    if s is None:
        return [f"cp_comm_type={comm_type!r} is unknown; expected one of {', '.join(COMM_TYPES)}"]
    out = []
    if qkv_format not in s.formats:
        out.append(f"qkv_format={qkv_format!r} is not supported with cp_comm_type={comm_type!r} (it takes "
                   f"{', '.join(s.formats)}); use cp_comm_type='p2p' or 'a2a' for thd")
        return out
    masks = s.masks[qkv_format]
    if mask_type not in masks:
        out.append(f"attn_mask_type={mask_type!r} is not supported under context parallelism with {qkv_format} "
                   f"(supported: {', '.join(masks)}); padding, bottom-right, arbitrary masks and bias tensors need "
                   "the whole key range on one rank")
    plain = (-1, 0) if "causal" in mask_type else (-1, -1)
    if window_size is not None and tuple(window_size) not in (plain, (-1, -1)):
        out.append(f"window_size={tuple(window_size)!r}: sliding windows are not supported under context parallelism")
    if bias_type not in s.bias_types:
        out.append(f"core_attention_bias_type={bias_type!r} is not supported under context parallelism "
                   f"(supported: {', '.join(s.bias_types)})")
    if dropout and dropout > 0:
        out.append(f"attention_dropout={dropout} is not supported under context parallelism; set it to 0 or "
                   "run in eval mode")
    if softmax_type not in s.softmax_types:
        out.append(f"softmax_type={softmax_type!r} is not supported under context parallelism")
    if return_max_logit:
        out.append("return_max_logit=True is not supported under context parallelism")
    return out


def params_failures(p) -> list[tuple[str, str, str | None]]:
    """(code suffix, message, fix) for an AttentionParams with cp_size > 1; empty when our CP supports it.
    For the constraint tables: each engine table that runs under CP adds these (see the final report)."""
    if p.cp_size <= 1:
        return []
    failures = [("cp_feature", m, None) for m in unsupported_features(
        p.cp_comm_type, p.qkv_format, p.attn_mask_type, p.window_size, p.bias_type,
        p.dropout if p.is_training else 0.0, p.softmax_type, p.return_max_logit)]
    if p.alibi_slopes_shape is not None and p.bias_type != "alibi":
        failures.append(("cp_feature", "ALiBi is not supported under context parallelism", None))
    if p.fp8:
        failures.append(("cp_fp8", "FP8 attention under context parallelism is not implemented in attn-dispatch", None))
    if p.inference_kv_cache:
        failures.append(("cp_kv_cache", "context parallelism with a KV cache is not supported (nor in Transformer "
                         "Engine)", None))
    if p.pad_between_seqs:
        failures.append(("cp_padding", "thd with padding between sequences is not supported under context "
                         "parallelism", "pack the sequences without gaps"))
    if SUPPORT.get(p.cp_comm_type, SUPPORT["p2p"]).heads_divisible_by_group:
        group = p.cp_size if p.cp_comm_type == "a2a" else None
        if group and (p.num_heads % group or p.num_gqa_groups % group):
            failures.append(("cp_heads", f"cp_comm_type='a2a' splits heads across {group} ranks: num_heads="
                             f"{p.num_heads} and num_gqa_groups={p.num_gqa_groups} must be divisible by {group}",
                             "use cp_comm_type='p2p'"))
    if p.is_causal and p.max_seqlen_q != p.max_seqlen_kv:
        failures.append(("cp_causal_cross", f"a causal mask under context parallelism needs self-attention; "
                         f"max_seqlen_q={p.max_seqlen_q} != max_seqlen_kv={p.max_seqlen_kv}", None))
    return failures


def engine_block_params(p, a2a_size: int = 2) -> list:
    """The plain (cp_size=1) calls the engine will receive for this CP call, as AttentionParams.

    Convention: under CP, p.max_seqlen_q / max_seqlen_kv are the LOCAL lengths (tokens on this rank) and p is
    for one rank of p.cp_size. For a2a+p2p the a2a group size is not in AttentionParams: pass a2a_size."""
    plain = dict(cp_size=1, cp_comm_type="p2p", softmax_type="vanilla", return_max_logit=False,
                 dropout=0.0, bias_type="no_bias", bias_shape=None, alibi_slopes_shape=None)
    sq, skv, size, thd = p.max_seqlen_q, p.max_seqlen_kv, p.cp_size, p.qkv_format == "thd"
    full_mask = "padding" if thd else "no_mask"
    diag_mask = "padding_causal" if thd else "causal"

    def blk(q, kv, mask, **kw):
        return p.replace(max_seqlen_q=q, max_seqlen_kv=kv, attn_mask_type=mask,
                         window_size=(-1, 0) if "causal" in mask else (-1, -1), **plain, **kw)

    def ring(q_len, kv_len, **kw):
        if not p.is_causal:
            return [blk(q_len, kv_len, full_mask, **kw)]
        return [blk(q_len, kv_len, diag_mask, **kw), blk(q_len, kv_len // 2, full_mask, **kw),
                blk(q_len // 2, kv_len, full_mask, **kw)]

    if p.cp_comm_type == "p2p":
        return ring(sq, skv)
    if p.cp_comm_type == "all_gather":
        if not p.is_causal:
            return [blk(sq, skv * size, "no_mask")]
        half = sq // 2
        return [blk(half, half, "causal")] + [blk(half, c * half, "no_mask") for c in range(1, 2 * size)]
    if p.cp_comm_type == "a2a":
        return [blk(sq * size, skv * size, diag_mask if p.is_causal else full_mask,
                    num_heads=max(p.num_heads // size, 1), num_gqa_groups=max(p.num_gqa_groups // size, 1))]
    a2a = a2a_size
    return ring(sq * a2a, skv * a2a, num_heads=max(p.num_heads // a2a, 1),
                num_gqa_groups=max(p.num_gqa_groups // a2a, 1))


def cp_engine(params, platform=None, env=None, *, force: str | None = None) -> tuple[str | None, dict[str, list[str]]]:
    """The provider selection picks for a context-parallel call, and the reasons of the others. The tables
    carry the CP rules (constraints.common.context_parallel), so this is plain selection."""
    from ..selection import explain

    decision = explain(params, platform, env, force=force)
    rejected = {v.id: [r.message for r in v.reasons] for v in decision.verdicts if not v.eligible}
    return decision.chosen, rejected
