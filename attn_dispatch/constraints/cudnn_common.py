"""The cuDNN rules and helpers that both cuDNN tables read: the F16 engine's (constraints/cudnn_fused.py) and the FP8
engine's (constraints/cudnn_fused_fp8.py), whose backward under NVTE_FP8_DPA_BWD=0 is the F16 engine's. cuDNN
versions as cudnnGetVersion() integers, the stack our H100 probe observed, the mask and bias cuDNN is asked for, the
rules that bound the F16 backward, and the rejections cuDNN made at run time. Each table cites a rule's source where
it declares the check.
"""
from __future__ import annotations

import functools

from packaging.version import Version

from ..env import EnvFlags
from ..params import AttentionParams, has_padding
from ..platform import Platform, parse_version
from .base import Failure, fail

TE_CPP = "Transformer Engine fused_attn.cpp nvte_get_fused_attn_backend (F16_arbitrary_seqlen)"
FE_VALIDATE = "cudnn-frontend 1.32 cudnn/_sdpa_validate.py (_validate_common, _validate_backward)"
PROBE_H100 = "probe on H100, cuDNN 9.19.0, 2026-11-23 (benchmarks/results/probe_h100.json)"


def cudnn_int(plat: Platform) -> int | None:
    """cuDNN as cudnnGetVersion() reports it: 8.9.7 -> 8907, 9.10.2 -> 91002; None when absent."""
    return _cudnn_int_of(plat.cudnn_version)


@functools.lru_cache(maxsize=256)
def _cudnn_int_of(text: str | None) -> int | None:
    v = parse_version(text)  # parsed once per distinct string: a fresh decision runs dozens of these checks
    if v is None:
        return None
    major, minor, patch = (list(v.release) + [0, 0, 0])[:3]
    return major * 1000 + minor * 100 + patch if major < 9 else major * 10000 + minor * 100 + patch


@functools.lru_cache(maxsize=256)
def version_of(text: str | None) -> Version | None:
    return parse_version(text)


# The stack the H100 probe ran on (PROBE_H100): relaxations of TE's rules hold from these versions on.
PROBED_SM = 90
PROBED_CUDNN = 91900
PROBED_PACKAGES = {"frontend": ("cudnn-frontend", Version("1.32.0")), "torch": ("torch", Version("2.11"))}
PROBED_TEXT = {"frontend": "sm90, cuDNN >= 9.19.0, cudnn-frontend >= 1.32.0",
               "torch": "sm90, cuDNN >= 9.19.0, torch >= 2.11"}


def probed(plat: Platform, provider: str) -> bool:
    """True on the stack the H100 probe observed for this provider (or a newer one of the same architecture)."""
    c = cudnn_int(plat)
    if plat.device_type != "cuda" or plat.sm != PROBED_SM or c is None or c < PROBED_CUDNN:
        return False
    package, minimum = PROBED_PACKAGES[provider]
    found = version_of(plat.torch_version if package == "torch" else plat.package(package).version)
    return found is not None and found.release >= minimum.release


def version_text(number: int) -> str:
    if number >= 90000:
        return f"{number // 10000}.{number // 100 % 100}.{number % 100}"
    return f"{number // 1000}.{number // 100 % 10}.{number % 100}"


def cudnn_text(plat: Platform) -> str:
    return plat.cudnn_version or "none"


def effective_mask(p: AttentionParams) -> str:
    """The mask cuDNN is asked for. thd always carries sequence lengths, so its mask is the padding variant;
    a bottom-right causal mask on equal, unpadded lengths is the top-left one (TE's fused_attn_arbitrary_seqlen
    impl does the same rewrite)."""
    mask = p.attn_mask_type
    if p.qkv_format == "thd" and not has_padding(mask) and mask != "arbitrary":
        mask = "padding" if mask == "no_mask" else "padding_" + mask
    if mask == "causal_bottom_right" and p.max_seqlen_q == p.max_seqlen_kv:
        mask = "causal"
    return mask


def effective_bias(p: AttentionParams) -> tuple[str, str | None]:
    """(bias type, bias shape) cuDNN is asked for. TE (get_attention_backend) turns ALiBi with [b, h] slopes or
    with sq != skv into a post-scale bias ('bhss' / '1hss'); so does our engine."""
    if p.bias_type == "alibi" and (p.alibi_slopes_shape == "bh" or p.max_seqlen_q != p.max_seqlen_kv):
        return "post_scale_bias", "bhss" if p.alibi_slopes_shape == "bh" else "1hss"
    return p.bias_type, p.bias_shape


def deterministic_demanded(p: AttentionParams, env: EnvFlags) -> bool:
    return p.deterministic or not env.allow_nondeterministic


def graph_bucket(n: int) -> int:
    """The S extent of a thd graph for a longest sequence of n tokens: the next power of two (>= 64), so a varying
    batch reuses a handful of graphs (cuDNN bounds the work by the sequence-length tensors, not by this)."""
    return max(64, 1 << max(0, n - 1).bit_length())


def graph_seqlens(p: AttentionParams) -> tuple[int, int]:
    """(s_q, s_kv) of the graph the frontend engine declares: the tensors' extents (bshd/sbhd), bucketed (thd)."""
    if p.qkv_format == "thd":
        return graph_bucket(p.max_seqlen_q), graph_bucket(p.max_seqlen_kv)
    return p.max_seqlen_q, p.max_seqlen_kv


def head_dim_limit_problem(p: AttentionParams, plat: Platform) -> tuple[str, str] | None:
    """None when one of TE's head-dim alternatives holds; else (why, fix)."""
    c, sm = cudnn_int(plat), plat.sm
    if c is None:
        return None
    dqk, dv, train = p.head_dim_qk, p.head_dim_v, p.is_training
    if dqk <= 128 and dv <= 128:
        return None
    if dqk <= 256 and dv <= 256 and sm == 90 and ((not train and c >= 90100) or (train and c >= 90500)):
        return None
    if not train and sm >= 100 and c >= 90900 and p.max_seqlen_q > 1:
        return None  # "9.9: any head_dim + Blackwell + fprop + non_paged + sq > 1"
    if not train and c >= 91002 and (p.max_seqlen_q > 1 or not p.is_causal):
        return None  # "9.10.2: any head_dim + any arch + fprop"
    if train and dqk == 192 and dv == 128 and sm >= 100 and c >= 91100:
        return None  # "9.11: d_qk = 192, d_v = 128 + Blackwell + bprop"
    dims = f"head_dim_qk={dqk}, head_dim_v={dv}"
    where = f"sm{sm}, cuDNN {cudnn_text(plat)}"
    if dqk <= 256 and dv <= 256:
        if train:
            return (f"{dims}: head dims above 128 in training need Hopper (sm90) with cuDNN >= 9.5.0 "
                    f"(or d_qk=192, d_v=128 on Blackwell with cuDNN >= 9.11); this is {where}",
                    "use head dims <= 128, or run on sm90 with cuDNN >= 9.5")
        return (f"{dims}: head dims above 128 in inference need sm90 with cuDNN >= 9.1.0, or cuDNN >= 9.10.2 "
                f"on any arch; this is {where}", "upgrade cuDNN to >= 9.10.2")
    if train:
        return (f"{dims}: head dims above 256 are forward-only (cuDNN >= 9.10.2); no backward; this is {where}",
                "use head dims <= 256 for training")
    return (f"{dims}: head dims above 256 need cuDNN >= 9.10.2 (9.9.0 on Blackwell); this is {where}",
            "upgrade cuDNN to >= 9.10.2")


def rule_head_dim_limit(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    problem = head_dim_limit_problem(p, plat)
    return fail(*problem) if problem else None


# (d_qk, d_v) pairs inside TE's Hopper MLA-backward exclusion that the probe ran and checked (PROBE_H100).
PROBED_MLA_BWD = ((128, 256), (256, 128))


def rule_hopper_mla_bwd_bug(p: AttentionParams, plat: Platform, env: EnvFlags, *, provider: str) -> Failure | None:
    c, dqk, dv = cudnn_int(plat), p.head_dim_qk, p.head_dim_v
    if (c is not None and 91100 <= c < 91300 and p.is_training and plat.sm == 90 and 128 < dqk <= 192
            and 64 < dv <= 128 and dv != 128 and dqk != 192):
        return fail(f"cuDNN {cudnn_text(plat)} on sm90: backward with head_dim_qk={dqk} in (128, 192] and "
                    f"head_dim_v={dv} in (64, 128] needs d_qk = 192 or d_v = 128 (cuDNN 9.11-9.12)",
                    "upgrade cuDNN to >= 9.13, or use (192, 128)")
    if (c is not None and c >= 91100 and p.is_training and plat.sm == 90 and dqk >= 128 and dv >= 128
            and not (dqk == 192 and dv == 128) and dqk != dv):
        if (dqk, dv) in PROBED_MLA_BWD and probed(plat, provider):
            return None  # ran and matched the reference, forward and backward (PROBE_H100)
        probed_pairs = " and ".join(f"({a}, {b})" for a, b in PROBED_MLA_BWD)
        return fail(f"cuDNN {cudnn_text(plat)} on sm90: backward with 128 <= head dims <= 256 and "
                    f"head_dim_qk={dqk} != head_dim_v={dv} is excluded (TE: '9.11+ bug ... Hopper + bprop + MLA'); "
                    f"only {probed_pairs} are verified, on {PROBED_TEXT[provider]}",
                    "use equal head dims, or (192, 128)" + (
                        "" if (dqk, dv) not in PROBED_MLA_BWD else f", or upgrade to {PROBED_TEXT[provider]}"))
    return None


def rule_mask_type(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    """TE's mask clause per cuDNN version, on the mask cuDNN is actually asked for."""
    c = cudnn_int(plat)
    if c is None:
        return None
    mask, sq, skv, fmt = effective_mask(p), p.max_seqlen_q, p.max_seqlen_kv, p.qkv_format
    bias, dropout = effective_bias(p)[0], p.dropout > 0 and p.is_training
    if mask == "arbitrary":
        return fail("attn_mask_type='arbitrary' (a full boolean mask) has no cuDNN fused kernel",
                    "express it as padding/causal/sliding window, or use the unfused backend")
    aligned = sq % 64 == 0 and skv % 64 == 0
    if mask in ("no_mask", "causal"):
        if c < 8906 and mask != "causal":
            return fail(f"cuDNN {cudnn_text(plat)} (< 8.9.6) supports only the causal mask",
                        "upgrade cuDNN to >= 8.9.6")
        if c < 90700 and fmt == "thd":
            return fail(f"thd with {mask!r} needs cuDNN >= 9.7.0", "use a padding mask type with thd")
        return None
    if mask in ("padding", "padding_causal"):
        if c < 8906:
            return fail(f"padding masks need cuDNN >= 8.9.6; found {cudnn_text(plat)}", "upgrade cuDNN to >= 8.9.6")
        if fmt == "thd" and c < 90100:
            return fail(f"thd (ragged) with padding masks needs cuDNN >= 9.1.0; found {cudnn_text(plat)}",
                        "upgrade cuDNN to >= 9.1")
        return None
    if mask == "causal_bottom_right":
        if c >= 90700:
            return None if sq <= skv else fail(
                f"causal_bottom_right needs max_seqlen_q <= max_seqlen_kv; got {sq} > {skv}",
                "use the top-left causal mask, or swap the roles of q and kv")
        if c < 90300:
            return fail(f"causal_bottom_right needs cuDNN >= 9.3.0; found {cudnn_text(plat)}",
                        "upgrade cuDNN to >= 9.3")
        return _br_restrictions(mask, c, aligned, sq, skv, bias, dropout, plat)
    # padding_causal_bottom_right
    if c >= 90700:
        return None if sq <= skv else fail(
            f"padding_causal_bottom_right needs max_seqlen_q <= max_seqlen_kv; got {sq} > {skv}",
            "use padding_causal (top-left)")
    if c < 90600:
        return fail(f"padding_causal_bottom_right needs cuDNN >= 9.6.0; found {cudnn_text(plat)}",
                    "upgrade cuDNN to >= 9.6")
    return _br_restrictions(mask, c, aligned, sq, skv, bias, dropout, plat)


def _br_restrictions(mask: str, c: int, aligned: bool, sq: int, skv: int, bias: str, dropout: bool,
                     plat: Platform) -> Failure | None:
    problems = []
    if not aligned:
        problems.append(f"max_seqlen_q={sq} and max_seqlen_kv={skv} must be multiples of 64")
    if sq > skv:
        problems.append(f"max_seqlen_q={sq} must be <= max_seqlen_kv={skv}")
    if bias != "no_bias":
        problems.append(f"no bias (got {bias})")
    if dropout:
        problems.append("no dropout")
    if problems:
        return fail(f"{mask} on cuDNN {cudnn_text(plat)} (< 9.7) needs: " + "; ".join(problems),
                    "cuDNN >= 9.7.0 lifts all but max_seqlen_q <= max_seqlen_kv")
    return None


def rule_qkv_format(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c, sm = cudnn_int(plat), plat.sm
    if c is None or p.qkv_format != "thd":
        return None
    if sm < 90:
        return fail(f"thd (ragged) needs Hopper or newer; this is sm{sm}", "use bshd with a padding mask")
    if c < 90100:
        return fail(f"thd needs cuDNN >= 9.1.0; found {cudnn_text(plat)}", "upgrade cuDNN")
    if p.num_heads != p.num_gqa_groups and c < 90600:
        return fail(f"thd with GQA/MQA needs cuDNN >= 9.6.0; found {cudnn_text(plat)}", "upgrade cuDNN to >= 9.6")
    if sm >= 120:
        return fail("Transformer Engine disables cuDNN fused attention for thd on sm120", "use bshd with padding")
    return None


def rule_determinism(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c, sm = cudnn_int(plat), plat.sm
    if c is None or not p.is_training:
        return None
    bias, dropout = effective_bias(p)[0], p.dropout > 0
    if sm >= 100 and dropout and bias != "no_bias":
        return fail(f"on sm{sm} the backward with both dropout and a bias is not supported (TE: Blackwell bwd)",
                    "drop the bias or the dropout")
    if not deterministic_demanded(p, env):
        return None
    why = "deterministic=True" if p.deterministic else "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"
    fix = "allow non-deterministic kernels (NVTE_ALLOW_NONDETERMINISTIC_ALGO=1)"
    if sm >= 100:
        if c < 91801 or dropout or bias != "no_bias":
            return fail(f"{why}: a deterministic backward on sm{sm} needs cuDNN >= 9.18.1, no dropout and no bias "
                        f"(found cuDNN {cudnn_text(plat)}, dropout={p.dropout}, bias={bias})",
                        "upgrade cuDNN to >= 9.18.1 / drop dropout and bias, or " + fix)
        return None
    if sm >= 90:
        if c < 8905:
            return fail(f"{why}: a deterministic backward needs cuDNN >= 8.9.5", "upgrade cuDNN, or " + fix)
    elif c < 90000:
        return fail(f"{why}: a deterministic backward on sm{sm} needs cuDNN >= 9.0 (Hopper only before)",
                    "upgrade cuDNN to >= 9.0, or " + fix)
    if p.bias_requires_grad and p.bias_type == "post_scale_bias":
        return fail(f"{why}: the bias gradient has no deterministic kernel", "detach the bias, or " + fix)
    return None


def rule_backward_single_token(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.is_training and graph_seqlens(p) == (1, 1):
        return fail("cuDNN's SDPA backward rejects s_q = s_kv = 1 ('s_q = s_kv = 1 is not supported')",
                    "use another backend for single-token training, or is_training=False")
    return None


def rule_thd_ragged_stats(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c = cudnn_int(plat)
    if p.qkv_format == "thd" and c is not None and c < 90600:
        return fail(f"attn-dispatch's thd path returns the log-sum-exp through cuDNN's ragged stats, which need "
                    f"cuDNN >= 9.6.0; found {cudnn_text(plat)}", "upgrade cuDNN to >= 9.6, or use bshd with padding")
    return None


def rejected_in_this_process(p: AttentionParams, plat: Platform, env: EnvFlags, phases: tuple[str, str],
                             what: str, fix: str) -> Failure | None:
    """The failure for a call whose graph cuDNN refused earlier in this process (the live platform's runtime facts,
    recorded by the engines), by phase: phases[0] (the forward) always, phases[1] (the backward) in training."""
    rejections = plat.facts.rejections
    if not rejections:
        return None
    det = deterministic_demanded(p, env)
    for phase in phases if p.is_training else phases[:1]:
        message = rejections.get(rejection_signature(p, det, phase))
        if message:
            return fail(f"cuDNN rejected this {what} ({phase} graph) in this process: {message}", fix)
    return None


def rejection_signature(p: AttentionParams, deterministic: bool, phase: str) -> tuple:
    """What a cuDNN graph's support depends on, computable from AttentionParams and from a call alike."""
    bias, shape = effective_bias(p)
    return (p.dtype, p.qkv_format, p.num_heads, p.num_gqa_groups, p.head_dim_qk, p.head_dim_v, p.max_seqlen_q,
            p.max_seqlen_kv, effective_mask(p), tuple(p.window_size), bias, shape, p.dropout > 0, p.softmax_type,
            deterministic and phase == "bwd", phase)
