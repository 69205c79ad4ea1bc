"""Check factories shared by the FlashAttention tables (flash_attn_2 package and torch, flash_attn_3, flash_attn_4).

Facts every FlashAttention release shares (flash-attn >= 2.1, FA3, flash-attn-4): the diagonal of a causal mask
or a sliding window is aligned bottom-right when seqlen_q != seqlen_kv; there is no mask or bias tensor input;
the engines return the softmax log-sum-exp, so context parallelism can merge partial results.
"""
from __future__ import annotations

from typing import Callable


from ..env import EnvFlags
from ..params import TOP_LEFT_MASKS, AttentionParams
from ..platform import parse_version, Platform
from .base import Check, Failure, Table, fail

FA_CHANGELOG = "flash-attn README.md, 'Changelog' (Dao-AILab/flash-attention)"
TE_UTILS = "Transformer Engine pytorch/attention/dot_product_attention/utils.py get_attention_backend"
CP = "attn_dispatch.context_parallel (merges per-block out/lse; the engines return lse and take a global lse)"
MASKS = ("no_mask", "padding", "causal", "causal_bottom_right", "padding_causal", "padding_causal_bottom_right")
# GPUs with ~100 KB of shared memory per SM, where FA2's head_dim > 192 backward kernels do not fit with dropout.
CONSUMER_SM = (86, 87, 89, 120, 121)

Predicate = Callable[[AttentionParams, EnvFlags], bool]


def deterministic_backward(p: AttentionParams, env: EnvFlags) -> bool:
    """A deterministic backward is needed: training with deterministic=True or NVTE_ALLOW_NONDETERMINISTIC_ALGO=0."""
    return p.is_training and (p.deterministic or not env.allow_nondeterministic)


def why_deterministic(p: AttentionParams) -> str:
    return "deterministic=True" if p.deterministic else "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"


def top_left_alignment(table: Table, *, source: str) -> Check:
    """Transformer Engine's 'causal'/'padding_causal' are top-left; FlashAttention is bottom-right (since 2.1)."""
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.attn_mask_type not in TOP_LEFT_MASKS:
            return None
        fix = f"use attn_mask_type={p.attn_mask_type + '_bottom_right'!r} if a bottom-right diagonal is meant"
        if p.max_seqlen_q != p.max_seqlen_kv:
            return fail(f"attn_mask_type={p.attn_mask_type!r} aligns the diagonal top-left, but {table.id} aligns it "
                        f"bottom-right; the two agree only when max_seqlen_q == max_seqlen_kv (got {p.max_seqlen_q} "
                        f"and {p.max_seqlen_kv})", fix)
        if p.seqlens_differ:
            return fail(f"attn_mask_type={p.attn_mask_type!r} aligns the diagonal top-left, but {table.id} aligns it "
                        "bottom-right per sequence; the two agree only where each sequence has as many query as key "
                        "tokens, and here cu_seqlens_q and cu_seqlens_kv give some sequence different lengths "
                        "(e.g. a padded causal batch whose padded query rows still attend, as torch's SDPA has them)",
                        fix + ", or equal query and key lengths per sequence")
        return None
    return Check(f"{table.family}.causal_alignment",
                 "top-left causal masks need equal query and key lengths: max_seqlen_q == max_seqlen_kv, and per "
                 "sequence with padding/thd; bottom-right masks and windows any lengths", "mask", source, fn)


def no_padding_between_sequences(table: Table) -> Check:
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.qkv_format == "thd" and p.pad_between_seqs:
            return fail(f"{table.id} takes thd sequences packed back to back; pad_between_seqs=True is not "
                        "supported", "pack the sequences without gaps, or use cudnn_fused")
        return None
    return Check(f"{table.family}.pad_between_seqs", "thd without padding between sequences", "format",
                 TE_UTILS + " (pad_between_seqs disables FlashAttention)", fn)


def gqa(table: Table) -> Check:
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.num_heads % p.num_gqa_groups:
            return fail(f"num_heads={p.num_heads} is not a multiple of num_gqa_groups={p.num_gqa_groups}")
        return None
    return Check(f"{table.family}.gqa", "MHA, GQA, MQA: num_heads % num_gqa_groups == 0", "gqa",
                 "flash_api.cpp: num_heads % num_heads_k == 0", fn)


def version_for(table: Table, name: str, key: str, minimum: str, *, feature: str, applies: Predicate,
                source: str, topic: str) -> Check:
    """A feature that arrived in a given release of the engine package (the package check reports its absence)."""
    distribution = key

    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        version = plat.package_version(key)
        if version is None or not applies(p, env) or version >= parse_version(minimum):
            return None
        return fail(f"{feature} needs {distribution} >= {minimum}; {plat.package(key).version} is installed",
                    f"pip install -U '{distribution}>={minimum}'")
    return Check(f"{table.family}.{name}", f"{feature}: {distribution} >= {minimum}", topic, source, fn)


def check(table: Table, name: str, requires: str, topic: str, source: str,
          fn: Callable[[AttentionParams, Platform, EnvFlags], Failure | None]) -> Check:
    """A table-local check, declared in one expression."""
    return Check(f"{table.family}.{name}", requires, topic, source, fn)
