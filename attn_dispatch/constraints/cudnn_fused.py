"""cuDNN fused attention: what cuDNN's F16 arbitrary-seqlen SDPA runs, per architecture and cuDNN version.

Two providers share the cuDNN rules and differ in what they can express:
- `frontend`: cudnn-frontend graphs (`cudnn.pygraph` sdpa / sdpa_backward), our CudnnFrontendEngine. Every
  feature of the F16 arbitrary-seqlen sub-backend: padding, thd, causal in both alignments, sliding windows,
  post-scale bias with dBias, ALiBi, dropout, GQA, d_qk != d_v, softmax sinks, deterministic backward.
- `torch`: torch's own cuDNN SDPA op (aten._scaled_dot_product_cudnn_attention), for machines without
  cudnn-frontend: dense bshd/sbhd, top-left causal or none, a bias without gradient, dropout.

The cuDNN rules mirror Transformer Engine's selector clause by clause (facts.md section 1; TE commit 015d346,
transformer_engine/common/fused_attn/fused_attn.cpp `nvte_get_fused_attn_backend`, "flag_arb"), so a
what-if platform (`Platform.parse("sm80,cudnn=8.9.7")`) gets the answer TE would give. cuDNN versions are
compared as cudnnGetVersion() integers, as TE does (8907 = 8.9.7, 91002 = 9.10.2).

Where our probe (`attn-dispatch probe`) saw a configuration TE excludes run and match the float64 reference,
forward and backward, the rule is relaxed for the observed stack only (`probed`: sm90, cuDNN >= 9.19.0 and
cudnn-frontend >= 1.32.0 or torch >= 2.11, per provider); older stacks keep TE's rule.

The helpers and rules the FP8 table (constraints/cudnn_fused_fp8.py) reads too live in constraints/cudnn_common.py;
this module composes the family's tables, the FP8 one included.
"""
from __future__ import annotations

import functools
from typing import Callable

from packaging.version import Version

from ..env import EnvFlags
from ..params import AttentionParams, has_padding
from ..platform import Platform, parse_version
from . import common, kv_decode
from .base import Check, Failure, Table, fail
from .cudnn_common import (FE_VALIDATE, PROBE_H100, PROBED_TEXT, TE_CPP, cudnn_int, cudnn_text, deterministic_demanded,
                           effective_bias, effective_mask, graph_seqlens, probed, rejected_in_this_process,
                           rule_backward_single_token, rule_determinism, rule_head_dim_limit, rule_hopper_mla_bwd_bug,
                           rule_mask_type, rule_qkv_format, rule_thd_ragged_stats, version_of)
from .cudnn_common import rejection_signature as rejection_signature  # re-exported: tests read it from here
from .cudnn_fused_fp8 import FP8_TABLE

TE_PY = common.TE_SELECTION
TE_KV = common.TE_KV_FILTER
TE_M512 = "Transformer Engine fused_attn.cpp nvte_get_fused_attn_backend (F16_max512_seqlen)"
FE_DOCS = "cudnn-frontend docs/operations/Attention.md (support matrix, cuDNN 9.18.1)"
FE_TESTS = "cudnn-frontend test/python/test_mhas.py (version skips)"
TORCH_SDP = "pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (can_use_cudnn_attention)"
FE_SURFACE = "cudnn-frontend include/cudnn_frontend/node/sdpa_support_surface.h (C++ validate, in 1.32's binding)"
OURS = "attn_dispatch.backends.cudnn_fused (our engine)"

SUB_ARBITRARY = "F16_arbitrary_seqlen"
SUB_MAX512 = "F16_max512_seqlen"

Rule = Callable[[AttentionParams, Platform, EnvFlags], "Failure | None"]


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _has_window(p: AttentionParams) -> bool:
    """A window beyond what the mask alone gives: TE's test is window != (-1, -1) and != (-1, 0)."""
    return p.window_size not in ((-1, -1), (-1, 0))


def diagonal_band(mask: str, window: tuple[int, int], sq: int, skv: int,
                  padding: bool) -> tuple[str | None, int | None, int | None]:
    """(alignment, left_bound, right_bound) of cuDNN's diagonal band, exactly as the frontend engine declares it.

    Transformer Engine's alignment: 'causal'/'padding_causal' top-left, every other mask and window bottom-right
    (per sequence when lengths are known); equal, unpadded lengths make the two the same, so top-left is used.
    Window (left, right) -> left_bound = left + 1 (cuDNN counts the diagonal), right_bound = right; causal => 0."""
    left, right = window
    if "causal" in mask:
        right = 0
    if left < 0 and right < 0:
        return None, None, None
    top_left = mask in ("causal", "padding_causal") or (sq == skv and not padding)
    return ("top_left" if top_left else "bottom_right", left + 1 if left >= 0 else None,
            right if right >= 0 else None)


def graph_band(p: AttentionParams) -> tuple[str | None, int | None, int | None]:
    sq, skv = graph_seqlens(p)
    return diagonal_band(p.attn_mask_type, tuple(p.window_size), sq, skv, has_padding(effective_mask(p)))


# --------------------------------------------------------------------------------------------
# cuDNN rules (shared by both providers). Each returns a Failure or None.
# --------------------------------------------------------------------------------------------
def rule_cudnn_runtime(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c = cudnn_int(plat)
    if c is None:
        return fail("no cuDNN runtime on this platform", "install cuDNN >= 9 (pip install nvidia-cudnn-cu12)")
    if c < 8900:
        return fail(f"cuDNN {cudnn_text(plat)} has no F16 arbitrary-seqlen fused attention (needs >= 8.9.0)",
                    "upgrade cuDNN to >= 9.0")
    return None


def rule_known_bad_version(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c = cudnn_int(plat)
    if c in (91000, 91001):
        return fail(f"cuDNN {cudnn_text(plat)} has known bugs in F16 SDPA (TE excludes 9.10.0 and 9.10.1)",
                    "upgrade cuDNN to >= 9.10.2")
    return None


def rule_arch_version(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c, sm = cudnn_int(plat), plat.sm
    if c is None or plat.device_type != "cuda" or sm < 80:
        return None  # reported by the runtime / compute-capability checks
    ok = (c < 8903 and sm in (80, 90)) or (c >= 8903 and sm < 100) or (c >= 90700)
    if ok:
        return None
    if sm >= 100:
        return fail(f"sm{sm} (Blackwell) needs cuDNN >= 9.7.0 for fused attention; found {cudnn_text(plat)}",
                    "upgrade cuDNN to >= 9.7.0")
    return fail(f"sm{sm} needs cuDNN >= 8.9.3 for fused attention (before that only sm80 and sm90); "
                f"found {cudnn_text(plat)}", "upgrade cuDNN to >= 8.9.3")


def rule_seqlen_multiple_of_64(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c = cudnn_int(plat)
    if c is None or c >= 90000:
        return None
    bad = [(name, n) for name, n in (("max_seqlen_q", p.max_seqlen_q), ("max_seqlen_kv", p.max_seqlen_kv))
           if n % 64]
    if not bad:
        return None
    what = "; ".join(f"{name}={n} is not a multiple of 64 (remainder {n % 64})" for name, n in bad)
    targets = {name: _round_up(n, 64) for name, n in bad}
    pad = (f"pad to {next(iter(targets.values()))}" if len(set(targets.values())) == 1
           else "pad " + ", ".join(f"{name} to {n}" for name, n in targets.items()))
    return fail(f"cuDNN {cudnn_text(plat)} (< 9.0) needs sequence lengths that are multiples of 64: {what}",
                f"cuDNN >= 9.0 lifts this; or {pad}")


def rule_gqa(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c = cudnn_int(plat)
    if c is not None and c < 8907 and p.num_heads != p.num_gqa_groups:
        return fail(f"GQA/MQA (num_heads={p.num_heads}, num_gqa_groups={p.num_gqa_groups}) needs cuDNN >= 8.9.7; "
                    f"found {cudnn_text(plat)}", "upgrade cuDNN to >= 8.9.7, or repeat the kv heads")
    return None


def rule_head_dim_multiple_of_8(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    bad = [f"{name}={d}" for name, d in (("head_dim_qk", p.head_dim_qk), ("head_dim_v", p.head_dim_v)) if d % 8]
    if bad:
        return fail(f"cuDNN fused attention needs head dims that are multiples of 8: {', '.join(bad)}",
                    "pad the head dims to a multiple of 8")
    return None


def rule_head_dim_qk_ne_v(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c = cudnn_int(plat)
    if c is not None and c < 8906 and p.head_dim_qk != p.head_dim_v:
        return fail(f"head_dim_qk={p.head_dim_qk} != head_dim_v={p.head_dim_v} needs cuDNN >= 8.9.6; "
                    f"found {cudnn_text(plat)}", "upgrade cuDNN to >= 8.9.6")
    return None


def rule_bias_type(p: AttentionParams, plat: Platform, env: EnvFlags, *, provider: str) -> Failure | None:
    c, sm = cudnn_int(plat), plat.sm
    if c is None:
        return None
    bias, _ = effective_bias(p)
    if bias == "no_bias":
        return None
    if bias == "pre_scale_bias":
        return fail("pre_scale_bias (bias added before scaling) is not supported by cuDNN's fused kernels",
                    "fold the scale into the bias and use post_scale_bias")
    if c < 8906:
        return fail(f"{bias} needs cuDNN >= 8.9.6; found {cudnn_text(plat)}", "upgrade cuDNN to >= 9.0")
    if bias == "alibi":
        problems = []
        if sm < 90:
            problems.append(f"Hopper or newer (this is sm{sm})")
        # Without a causal mask our engine passes ALiBi as a [1, h, sq, skv] post-scale bias tensor (cuDNN's
        # built-in ALiBi is causal only); the probe saw that run on the probed stack.
        unmasked_ok = effective_mask(p) == "no_mask" and provider == "frontend" and probed(plat, provider)
        if effective_mask(p) not in ("causal", "causal_bottom_right") and not unmasked_ok:
            problems.append(f"a causal mask without padding (got {p.attn_mask_type!r}; no_mask is verified on "
                            f"{PROBED_TEXT['frontend']} through cudnn_fused:frontend)")
        if problems:
            return fail("cuDNN's built-in ALiBi needs " + " and ".join(problems),
                        "use a causal mask on sm90+, or pass the ALiBi bias as a post_scale_bias tensor")
        return None
    # post_scale_bias
    if sm >= 90 or c >= 90000:
        return None
    return fail(f"post_scale_bias on sm{sm} needs cuDNN >= 9.0 (8.9.x: Hopper only); found {cudnn_text(plat)}",
                "upgrade cuDNN to >= 9.0")


def rule_bias_with_padding(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c = cudnn_int(plat)
    if c is None or c < 8906:
        return None
    if effective_bias(p)[0] == "post_scale_bias" and effective_mask(p) in ("padding", "padding_causal"):
        what = "ALiBi (converted to a bias tensor)" if p.bias_type == "alibi" else "post_scale_bias"
        return fail(f"{what} together with attn_mask_type={effective_mask(p)!r} is excluded by Transformer Engine's "
                    "selector for cuDNN fused attention",
                    "drop the padding mask (use bshd without padding), or the bias")
    return None


def rule_bias_grad_shape(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.bias_type == "post_scale_bias" and p.bias_requires_grad and p.is_training and p.bias_shape != "1hss":
        return fail(f"cuDNN computes the bias gradient only for a [1, h, sq, skv] bias; got bias_shape="
                    f"{p.bias_shape!r} with requires_grad", "use a [1, h, sq, skv] bias, or detach it")
    return None


def rule_sliding_window(p: AttentionParams, plat: Platform, env: EnvFlags, *, provider: str) -> Failure | None:
    c = cudnn_int(plat)
    if c is None or not _has_window(p):
        return None
    left, right = p.window_size
    mask, sq, skv = effective_mask(p), p.max_seqlen_q, p.max_seqlen_kv
    bias, dropout = effective_bias(p)[0], p.dropout > 0 and p.is_training
    if c < 90200:
        return fail(f"sliding window {p.window_size} needs cuDNN >= 9.2.0; found {cudnn_text(plat)}",
                    "upgrade cuDNN to >= 9.2")
    common_problems = []
    if sq > skv:
        common_problems.append(f"max_seqlen_q={sq} <= max_seqlen_kv={skv}")
    if bias != "no_bias":
        common_problems.append(f"no bias (got {bias})")
    if dropout:
        common_problems.append("no dropout")
    if c == 91400 and skv > 1024 and left != -1 and mask not in ("causal", "causal_bottom_right"):
        return fail("cuDNN 9.14.0 has a known bug with sliding windows when max_seqlen_kv > 1024 and the mask is not "
                    "causal", "upgrade cuDNN to >= 9.14.1")
    # 9.2: (left, 0) windows with no/causal masks on bshd/sbhd
    if right == 0 and mask in ("no_mask", "causal", "causal_bottom_right") and p.qkv_format != "thd":
        if mask == "causal_bottom_right" and sq != skv and c < 90600:
            common_problems.append("equal sequence lengths for a bottom-right window before cuDNN 9.6")
    elif mask == "no_mask" and left >= 0 and provider == "frontend" and probed(plat, provider):
        pass  # the engine declares a diagonal band (left + 1, right); the probe ran it (PROBE_H100)
    elif c < 90600:
        return fail(f"window {p.window_size} with attn_mask_type={p.attn_mask_type!r} needs cuDNN >= 9.6.0 "
                    f"(9.2 takes only (left, 0) windows with no/causal masks on bshd/sbhd); found {cudnn_text(plat)}",
                    "upgrade cuDNN to >= 9.6")
    elif mask not in ("causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right"):
        return fail(f"a window {p.window_size} with right != 0 needs attn_mask_type in causal_bottom_right, padding, "
                    f"padding_causal or padding_causal_bottom_right; got {p.attn_mask_type!r} (no_mask with a left "
                    f"bound is verified on {PROBED_TEXT['frontend']} through cudnn_fused:frontend)",
                    "use attn_mask_type='padding' (full lengths) for a two-sided window")
    elif plat.sm >= 100 and c <= 90700 and "bottom_right" in mask and sq != skv:
        common_problems.append("equal sequence lengths for bottom-right windows on Blackwell before cuDNN 9.7.1")
    if common_problems:
        return fail(f"sliding window {p.window_size} needs: " + "; ".join(common_problems))
    return None


def rule_sm120_training_head_dim(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if plat.sm >= 120 and p.is_training and (p.head_dim_qk > 128 or p.head_dim_qk % 8):
        return fail(f"on sm{plat.sm}, training with head_dim_qk={p.head_dim_qk} (> 128) is disabled by Transformer "
                    "Engine for cuDNN fused attention", "use head_dim_qk <= 128")
    return None


def rule_softmax_type(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c = cudnn_int(plat)
    if p.softmax_type == "vanilla" or c is None:
        return None
    if c < 91301:
        return fail(f"softmax_type={p.softmax_type!r} (a softmax sink) needs cuDNN >= 9.13.1; "
                    f"found {cudnn_text(plat)}",
                    "upgrade cuDNN to >= 9.13.1")
    if p.qkv_format == "thd":
        return fail(f"softmax_type={p.softmax_type!r} with thd is disabled by Transformer Engine for fused attention",
                    "use bshd/sbhd")
    # Under context parallelism our per-block calls are vanilla and the sink enters the final merge once
    # (attn_dispatch.context_parallel), so Transformer Engine's "sinks under CP need a2a" does not apply.
    return None


def band_problems(p: AttentionParams, plat: Platform) -> list[str]:
    """What cuDNN's validation says about the diagonal band the engine declares (graph_band), with a bias,
    ALiBi, dropout, ragged/padded inputs. cuDNN calls a bottom-right band with a right bound 'bottom right causal'
    (has_causal_mask_bottom_right), whatever the mask type that produced it."""
    c = cudnn_int(plat)
    if c is None:
        return []
    align, left, right = graph_band(p)
    if align is None:
        return []
    sq, skv = graph_seqlens(p)
    padding = has_padding(effective_mask(p))
    bias, dropout = effective_bias(p)[0], p.dropout > 0 and p.is_training
    what = "ALiBi" if bias == "alibi" else ("ALiBi (as a bias tensor)" if p.bias_type == "alibi" else bias)
    br_causal = align == "bottom_right" and right is not None
    out = []
    if br_causal:
        if bias != "no_bias":
            out.append(f"no bias with a bottom-right band (got {what})")
        if dropout:
            out.append(f"no dropout with a bottom-right band (got dropout={p.dropout})")
        if not padding and sq > skv:
            out.append(f"max_seqlen_q={sq} <= max_seqlen_kv={skv} for a bottom-right band")
        if c < 90600 and (sq % 64 or skv % 64):
            out.append(f"s_q={sq} and s_kv={skv} multiples of 64 for a bottom-right band before cuDNN 9.6")
    if left is not None:
        if not padding and sq > skv:
            out.append(f"max_seqlen_q={sq} <= max_seqlen_kv={skv} for a sliding window")
        if c < 91002 and (right is None or bias != "no_bias" or dropout):
            out.append("a right bound, no bias and no dropout with a sliding window before cuDNN 9.10.2")
        if c < 90600 and br_causal and sq != skv:
            out.append("s_q == s_kv for a bottom-right sliding window before cuDNN 9.6")
        if c <= 90900 and plat.sm == 90 and br_causal and sq == skv:
            out.append("not a bottom-right sliding window with s_q == s_kv on sm90 before cuDNN 9.10")
    if sq == 1 and right is not None and c <= 90900:
        out.append("no causal/window band with s_q = 1 before cuDNN 9.10")
    return out


def rule_diagonal_band(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    problems = band_problems(p, plat)
    if not problems:
        return None
    align, left, right = graph_band(p)
    return fail(f"cuDNN rejects this mask band ({align}, left_bound={left}, right_bound={right}, from "
                f"attn_mask_type={p.attn_mask_type!r}, window={tuple(p.window_size)}): needs " + "; ".join(problems),
                "use a top-left causal mask (or equal lengths), drop the bias/dropout, or another backend")


def rule_decode_sink(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.softmax_type != "vanilla" and graph_seqlens(p)[0] == 1:
        return fail(f"softmax_type={p.softmax_type!r} with max_seqlen_q=1: cuDNN's kernels reject a sink token in "
                    "decode mode ('decode only mode, i.e. s_q == 1, not supported with sink_token')",
                    "use another backend for single-query decoding with a sink")
    return None


# --------------------------------------------------------------------------------------------
# The max512 sub-backend (only reachable by pinning it with NVTE_FUSED_ATTN_BACKEND=0)
# --------------------------------------------------------------------------------------------
def max512_problems(p: AttentionParams, plat: Platform) -> list[str]:
    """Why TE's F16_max512_seqlen sub-backend cannot run this call (empty list: it can)."""
    c, sm, out = cudnn_int(plat), plat.sm, []
    if c is None or c < 8901:
        out.append(f"cuDNN >= 8.9.1 (found {cudnn_text(plat)})")
    if sm not in (80, 90):
        out.append(f"sm80 or sm90 exactly (this is sm{sm})")
    for name, n in (("max_seqlen_q", p.max_seqlen_q), ("max_seqlen_kv", p.max_seqlen_kv)):
        if n > 512 or n % 64:
            out.append(f"{name} <= 512 and a multiple of 64 (got {n})")
    if p.head_dim_qk != 64 or p.head_dim_v != 64:
        out.append(f"head dims of exactly 64 (got {p.head_dim_qk}/{p.head_dim_v})")
    if p.num_heads != p.num_gqa_groups:
        out.append("no GQA/MQA")
    bias, shape = effective_bias(p)
    if bias not in ("no_bias", "post_scale_bias"):
        out.append(f"no bias or post_scale_bias (got {bias})")
    elif bias == "post_scale_bias" and shape != "1hss":
        out.append(f"a [1, h, sq, skv] bias (got {shape})")
    mask = p.attn_mask_type
    if mask not in ("no_mask", "causal", "padding", "padding_causal") or (
            mask == "padding_causal" and p.max_seqlen_q != p.max_seqlen_kv):
        out.append(f"no_mask, causal, padding, or padding_causal with equal lengths (got {mask})")
    if p.qkv_format != "bshd":
        out.append(f"bshd (got {p.qkv_format}; sbhd only as packed SB3HD/SBHD_SB2HD, which separate tensors are not)")
    if _has_window(p):
        out.append(f"no sliding window (got {p.window_size})")
    if p.softmax_type != "vanilla":
        out.append(f"vanilla softmax (got {p.softmax_type})")
    if p.return_max_logit:
        out.append("return_max_logit=False")
    return out


def rule_sub_backend_pin(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    pin = env.fused_attn_backend
    if pin is None or pin == "1":
        return None
    if pin == "2":
        return fail("NVTE_FUSED_ATTN_BACKEND=2 pins the FP8 sub-backend (cudnn_fused:fp8), which runs FP8 calls "
                    "only", "unset NVTE_FUSED_ATTN_BACKEND or set it to 1; for FP8, run under fp8_autocast")
    problems = max512_problems(p, plat)
    if problems:
        return fail("NVTE_FUSED_ATTN_BACKEND=0 pins F16_max512_seqlen, which needs: " + "; ".join(problems),
                    "unset NVTE_FUSED_ATTN_BACKEND or set it to 1 (F16_arbitrary_seqlen)")
    return None


def sub_backend_detail(p: AttentionParams, plat: Platform, env: EnvFlags) -> dict:
    """TE's pick: arbitrary-seqlen unless max512 is pinned (TE consults the pin only when both seqlens <= 512)."""
    return {"sub_backend": SUB_MAX512 if env.fused_attn_backend == "0" else SUB_ARBITRARY}


# --------------------------------------------------------------------------------------------
# Assembling the tables
# --------------------------------------------------------------------------------------------
def _add(table: Table, name: str, requires: str, topic: str, source: str, fn: Rule, *,
         per_provider: bool = False) -> None:
    """per_provider: fn takes provider= (its relaxation depends on the provider's probed stack)."""
    check = functools.partial(fn, provider=table.provider) if per_provider else fn
    table.add(Check(f"{table.family}.{name}", requires, topic, source, check))


def _cudnn_rules(table: Table) -> None:
    _add(table, "cudnn_runtime", "a cuDNN runtime >= 8.9.0", "package", TE_CPP + " (post-filter cudnn < 8900)",
         rule_cudnn_runtime)
    _add(table, "cudnn_known_bad", "cuDNN not 9.10.0 / 9.10.1", "package", TE_CPP + " ('known bugs with SDPA F16')",
         rule_known_bad_version)
    _add(table, "arch_version", "sm80/sm90 (8.9.0+), sm80-sm9x (8.9.3+), Blackwell (9.7.0+)", "platform",
         TE_CPP + " (architecture clause)", rule_arch_version)
    table.add(common.dtypes(table, ("float16", "bfloat16"), source=TE_CPP + "; " + FE_DOCS))
    table.add(common.no_fp8(table, source=OURS + " (FP8 calls run on cudnn_fused:fp8, TE's sub-backend 2)"))
    _add(table, "seqlen_multiple_of_64", "cuDNN < 9.0: max_seqlen_q/kv multiples of 64", "seqlen",
         TE_CPP + " ('cudnn < 90000 requires max_seqlen % 64 == 0')", rule_seqlen_multiple_of_64)
    _add(table, "gqa", "GQA/MQA: cuDNN >= 8.9.7", "heads", TE_CPP + "; " + FE_TESTS, rule_gqa)
    _add(table, "head_dim_multiple_of_8", "head dims multiples of 8", "head_dim", TE_CPP + "; " + FE_DOCS,
         rule_head_dim_multiple_of_8)
    _add(table, "head_dim_qk_ne_v", "head_dim_qk != head_dim_v: cuDNN >= 8.9.6", "head_dim", FE_TESTS,
         rule_head_dim_qk_ne_v)
    _add(table, "head_dim_limit", "<= 128; <= 256 on sm90 (fwd 9.1+, bwd 9.5+); larger: fwd only (9.10.2+)",
         "head_dim", TE_CPP + " (head-dim clause); " + FE_DOCS, rule_head_dim_limit)
    _add(table, "head_dim_hopper_mla_bwd", "not (sm90 bwd, cuDNN >= 9.11, 128 <= d <= 256, d_qk != d_v); "
         "(128, 256) and (256, 128) allowed on sm90 with cuDNN >= 9.19 (probe)", "head_dim",
         TE_CPP + " ('9.11+ bug ... Hopper + bprop + MLA'); " + PROBE_H100, rule_hopper_mla_bwd_bug,
         per_provider=True)
    _add(table, "sm120_training_head_dim", "sm120 training: head_dim_qk <= 128", "head_dim", TE_PY,
         rule_sm120_training_head_dim)
    _add(table, "mask_type", "masks per cuDNN version: padding 8.9.6, thd 9.1, bottom-right 9.3 (9.6 padded)",
         "mask", TE_CPP + " (mask clause)", rule_mask_type)
    _add(table, "bias_type", "post_scale_bias (sm90 8.9.6+, any 9.0+), ALiBi (sm90, causal; frontend: also no_mask "
         "with cuDNN >= 9.19); no pre_scale_bias", "bias",
         TE_CPP + " (bias clause); " + TE_PY + " (ALiBi -> post_scale_bias conversion); " + PROBE_H100,
         rule_bias_type, per_provider=True)
    _add(table, "bias_with_padding", "no post_scale_bias with padding/padding_causal", "bias",
         TE_CPP + " (bias + padding exclusion)", rule_bias_with_padding)
    _add(table, "bias_grad_shape", "bias gradient only for [1, h, sq, skv]", "bias",
         TE_PY + "; fused_attn_f16_arbitrary_seqlen.cu (dBias only when bias_b == 1 and bias_h == h)",
         rule_bias_grad_shape)
    _add(table, "sliding_window", "windows: (left, 0) from 9.2, two-sided with padding/bottom-right from 9.6; "
         "frontend: (left >= 0, any right) with no_mask on sm90 with cuDNN >= 9.19 (probe)", "window",
         TE_CPP + " (sliding-window clause); " + PROBE_H100, rule_sliding_window, per_provider=True)
    _add(table, "qkv_format", "thd: sm90+, cuDNN 9.1 (GQA 9.6)", "format", TE_CPP + " (qkv format clause); " + TE_PY,
         rule_qkv_format)
    _add(table, "softmax_type", "off-by-one/learnable softmax: cuDNN >= 9.13.1, not thd", "softmax",
         TE_CPP + " (softmax clause); " + TE_PY, rule_softmax_type)
    _add(table, "determinism", "deterministic bwd: sm90 8.9.5+, sm80 9.0+, Blackwell 9.18.1+ (no dropout/bias)",
         "determinism", TE_CPP + " (Blackwell determinism); " + TE_PY + "; " + FE_TESTS, rule_determinism)
    _add(table, "diagonal_band", "bottom-right bands: no bias/ALiBi/dropout, s_q <= s_kv; windows: s_q <= s_kv",
         "mask", FE_VALIDATE + "; " + FE_SURFACE, rule_diagonal_band)
    _add(table, "backward_single_token", "training: not s_q = s_kv = 1", "seqlen",
         FE_VALIDATE + " (_validate_backward)", rule_backward_single_token)
    _add(table, "decode_sink", "softmax sinks: s_q > 1", "softmax", FE_SURFACE + " (backend path)", rule_decode_sink)
    table.add(_kv_cache_check(table))
    table.add(common.no_return_max_logit(table, source=OURS + " (cuDNN's score_max output is not wired up)"))
    table.add(common.cp_comm_types(table, ("p2p", "all_gather", "a2a", "a2a+p2p"),
                                   source=OURS + " returns the log-sum-exp that context parallelism merges"))


def _kv_cache_check(table: Table) -> Check:
    if table.provider == "frontend":
        return common.kv_cache(
            table, contiguous=True, paged=True,
            source=TE_KV + " (FusedAttention: non-paged and paged, bshd/sbhd/thd); " + OURS + ": a padded bshd "
                   "graph on the cache rows in place, or on the page pool as cuDNN's paged containers [pages, h_kv, "
                   "page_size, d] (strides: no copy) with page tables [b, 1, pages, 1] (cudnn-frontend sdpa "
                   "paged_attention_k_table/v_table/max_seq_len_kv; test/python/sdpa/fp16.py)")
    return common.kv_cache(
        table, contiguous=False, paged=False,
        why_not="aten::_scaled_dot_product_cudnn_attention takes no per-sequence lengths, so it cannot leave a "
                "cache row's unused tail out", source="torch aten::_scaled_dot_product_cudnn_attention schema")


# --- provider 1: cudnn-frontend graphs ---------------------------------------------------------
FRONTEND_TABLE = Table("cudnn_fused", "frontend",
                       "cuDNN F16 arbitrary-seqlen SDPA through cudnn-frontend graphs (cached per shape)",
                       detail=sub_backend_detail)
FRONTEND_TABLE.add(
    common.env_enabled(FRONTEND_TABLE),
    common.on_cuda(FRONTEND_TABLE, min_sm=80, source=TE_CPP + "; " + FE_DOCS + " ('requires SM80 or newer')"),
    common.package(FRONTEND_TABLE, "cudnn-frontend", minimum="1.10.0", tested_max="1.32.0",
                   source="cudnn-frontend release notes (1.10: diagonal band masks in sdpa)"),
    common.loads(FRONTEND_TABLE),
)
_cudnn_rules(FRONTEND_TABLE)
_add(FRONTEND_TABLE, "sub_backend_pin", "NVTE_FUSED_ATTN_BACKEND pins a sub-backend that can run the call",
     "environment", TE_M512 + "; env override 'NVTE_FUSED_ATTN_BACKEND'", rule_sub_backend_pin)
_add(FRONTEND_TABLE, "thd_ragged_stats", "thd: cuDNN >= 9.6 (ragged softmax stats)", "format",
     OURS + " (lse for thd is cuDNN's ragged stats tensor, cuDNN 9.6+)", rule_thd_ragged_stats)


@FRONTEND_TABLE.check("kv_cache_paged", requires="a paged KV cache: cuDNN >= 9.5.0; head dims <= 128 up to cuDNN 9.9",
                      topic="inference", source=FE_SURFACE + " (validate_sdpa_support_surface: 'For cuDNN version "
                      "below 9.5.0, paged caches are not supported'; 'Paged attention only supported with d_qk and "
                      "d_v <= 128 for backend version 9.9 or below'); paged_cache_load.h 'requires cuDNN v9.5.0'")
def _kv_cache_paged(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c = cudnn_int(plat)
    if not p.kv_cache_paged or c is None:
        return None
    if c < 90500:
        return fail(f"cuDNN's paged attention needs cuDNN >= 9.5.0; found {cudnn_text(plat)}",
                    "upgrade cuDNN, or use a contiguous cache (InferenceParams(is_paged=False))")
    if c < 91000 and max(p.head_dim_qk, p.head_dim_v) > 128:
        return fail(f"cuDNN {cudnn_text(plat)} runs paged attention with head dims <= 128 only (got "
                    f"{p.head_dim_qk}, {p.head_dim_v})", "upgrade cuDNN to >= 9.10, or use a contiguous cache")
    return None


@FRONTEND_TABLE.check("alibi_padding", requires="ALiBi without padding masks", topic="bias",
                      source=OURS + " (ALiBi as a bias tensor needs one alignment for the whole batch)")
def _alibi_padding(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.bias_type == "alibi" and has_padding(effective_mask(p)):
        return fail(f"ALiBi with attn_mask_type={p.attn_mask_type!r} (per-sequence alignment) is not implemented by "
                    "the cuDNN engine", "use a mask without padding, or the unfused backend")
    return None


@FRONTEND_TABLE.check("frontend_sink", requires="softmax sinks: cudnn-frontend >= 1.14.1", topic="softmax",
                      source="cudnn-frontend 1.14.1 release notes (sink token for SDPA)")
def _frontend_sink(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.softmax_type == "vanilla":
        return None
    fe = version_of(plat.package("cudnn-frontend").version)
    if fe is not None and fe < parse_version("1.14.1"):
        return fail(f"softmax_type={p.softmax_type!r} needs cudnn-frontend >= 1.14.1 (sink_token); found {fe}",
                    "pip install -U 'nvidia-cudnn-frontend>=1.14.1'")
    return None


@FRONTEND_TABLE.check("cudnn_rejected", requires="cuDNN's own support check accepted this configuration",
                      topic="platform", source="observed at run time (cudnn-frontend check_support / build_plans)")
def _cudnn_rejected(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    return rejected_in_this_process(p, plat, env, ("fwd", "bwd"), "configuration",
                                    "choose another backend (it is excluded for this signature from now on)")


@FRONTEND_TABLE.note
def _dropout_bug_note(p: AttentionParams, plat: Platform) -> str | None:
    c = cudnn_int(plat)
    if p.dropout and p.is_training and c is not None and 91100 < c < 91400:
        return (f"torch refuses dropout with cuDNN {cudnn_text(plat)} (9.11.x-9.13.x) in its own cuDNN SDPA; "
                "the frontend graphs are not restricted by Transformer Engine")
    return None


# --- provider 2: torch's built-in cuDNN SDPA ---------------------------------------------------
_TORCH_MIN = Version("2.5")

TORCH_TABLE = Table("cudnn_fused", "torch",
                    "cuDNN SDPA through torch's aten._scaled_dot_product_cudnn_attention (no extra package)",
                    detail=lambda p, plat, env: {"sub_backend": SUB_ARBITRARY})
TORCH_TABLE.add(
    common.env_enabled(TORCH_TABLE),
    common.on_cuda(TORCH_TABLE, min_sm=80, max_sm=121, source=TORCH_SDP + " ('[sm80, sm121]')"),
)
_cudnn_rules(TORCH_TABLE)


@TORCH_TABLE.check("torch_softmax", requires="vanilla softmax", topic="softmax",
                   source="aten._scaled_dot_product_cudnn_attention schema (no sink argument)")
def _torch_softmax(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.softmax_type != "vanilla":
        return fail(f"softmax_type={p.softmax_type!r} cannot be expressed with torch's cuDNN op (no sink argument)",
                    "use the cudnn_fused:frontend provider")
    return None


@TORCH_TABLE.check("torch_format", requires="qkv_format in bshd, sbhd", topic="format",
                   source=OURS + " (the op takes dense [b, h, s, d] tensors, no sequence lengths)")
def _torch_format(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.qkv_format == "thd":
        return fail("qkv_format='thd' cannot be expressed with torch's cuDNN op (dense tensors only)",
                    "use the cudnn_fused:frontend provider, or bshd with padding")
    return None


@TORCH_TABLE.check("torch_cudnn_sdpa", requires="torch built with cuDNN SDPA (cuDNN >= 9), torch >= 2.5",
                   topic="package", source=TORCH_SDP + " ('cuDNN version too old to use cuDNN Attention (< v9.0.0)')")
def _torch_cudnn_sdpa(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if not plat.torch_cudnn_sdpa:
        return fail(f"torch {plat.torch_version} on this platform has no cuDNN SDPA "
                    "(needs a CUDA build with cuDNN >= 9)",
                    "install a CUDA build of torch >= 2.5, or nvidia-cudnn-frontend for the frontend provider")
    torch_version = version_of(plat.torch_version)
    if torch_version is None or torch_version < _TORCH_MIN:
        return fail(f"torch {plat.torch_version} predates the attn_bias argument of "
                    "_scaled_dot_product_cudnn_attention (torch >= 2.5)", "pip install -U 'torch>=2.5'")
    return None


@TORCH_TABLE.check("torch_mask", requires="no_mask or causal (top-left); causal_bottom_right only when sq == skv",
                   topic="mask", source="aten._scaled_dot_product_cudnn_attention(is_causal) schema")
def _torch_mask(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    mask = effective_mask(p)
    if mask not in ("no_mask", "causal"):
        return fail(f"attn_mask_type={p.attn_mask_type!r} cannot be expressed with torch's cuDNN op (only is_causal, "
                    "top-left; no sequence lengths)", "use the cudnn_fused:frontend provider (nvidia-cudnn-frontend)")
    if _has_window(p):
        return fail(f"sliding window {p.window_size} cannot be expressed with torch's cuDNN op",
                    "use the cudnn_fused:frontend provider")
    return None


@TORCH_TABLE.check("torch_bias", requires="no bias, or a post_scale_bias without gradient", topic="bias",
                   source="aten._scaled_dot_product_cudnn_attention_backward returns no bias gradient")
def _torch_bias(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.bias_type == "alibi":
        return fail("ALiBi is not wired to torch's cuDNN op", "use the cudnn_fused:frontend provider")
    if p.bias_type == "post_scale_bias" and p.bias_requires_grad and p.is_training:
        return fail("torch's cuDNN op returns no bias gradient; the bias requires grad",
                    "detach the bias, or use the cudnn_fused:frontend provider")
    return None


@TORCH_TABLE.check("torch_deterministic", requires="no deterministic backward demanded", topic="determinism",
                   source=TORCH_SDP + " (check_cudnn_deterministic: 'cuDNN SDPA is not deterministic'); "
                   "aten._scaled_dot_product_cudnn_attention_backward schema (no deterministic flag)")
def _torch_deterministic(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    # The op runs under deterministic=True (the H100 probe saw it match the reference), but matching is not
    # bitwise repeatability, which nothing here can promise: so the rule stays on every version.
    if p.is_training and deterministic_demanded(p, env):
        why = "deterministic=True" if p.deterministic else "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"
        return fail(f"{why}: torch's cuDNN backward cannot be asked for cuDNN's deterministic algorithm (the op takes "
                    "no such flag), and torch itself refuses cuDNN SDPA in deterministic mode ('cuDNN SDPA is not "
                    "deterministic'); a run that matches the reference does not show bitwise repeatability",
                    "use the cudnn_fused:frontend provider (it requests cuDNN's deterministic backward)")
    return None


@TORCH_TABLE.check("torch_dropout", requires="dropout: not with cuDNN 9.11.1-9.13.x", topic="dropout",
                   source=TORCH_SDP + " (dropout rejected for 91100 < cuDNN < 91400)")
def _torch_dropout(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c = cudnn_int(plat)
    if p.dropout and p.is_training and c is not None and 91100 < c < 91400:
        return fail(f"torch disables cuDNN SDPA with dropout on cuDNN {cudnn_text(plat)}", "upgrade cuDNN to >= 9.14")
    return None


@TORCH_TABLE.check("torch_shape_limits", requires="batch and heads <= 65535; max_seqlen_kv > 1 (= 1 allowed "
                   "with max_seqlen_q > 1 on sm90, cuDNN >= 9.19, torch >= 2.11: probe)", topic="seqlen",
                   source=TORCH_SDP + " (check_cudnn_tensor_shapes); " + PROBE_H100)
def _torch_shape_limits(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    problems = [f"{n}={v} > 65535" for n, v in (("batch_size", p.batch_size), ("num_heads", p.num_heads)) if v > 65535]
    fix = None
    # The probe ran s_q = 512, s_kv = 1 through the op (which skips sdp_utils' check) and it matched the reference.
    if p.max_seqlen_kv == 1 and not (p.max_seqlen_q > 1 and probed(plat, "torch")):
        problems.append("max_seqlen_kv=1 ('cudnn SDPA does not support key/value sequence length 1'; verified "
                        f"with max_seqlen_q > 1 on {PROBED_TEXT['torch']})")
        fix = f"upgrade to {PROBED_TEXT['torch']}, or use the cudnn_fused:frontend provider"
    return fail("torch's cuDNN SDPA limits: " + "; ".join(problems), fix) if problems else None


@TORCH_TABLE.check("torch_sub_backend_pin", requires="NVTE_FUSED_ATTN_BACKEND unset or 1", topic="environment",
                   source=TE_M512)
def _torch_pin(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if env.fused_attn_backend not in (None, "1"):
        return fail(f"NVTE_FUSED_ATTN_BACKEND={env.fused_attn_backend} pins "
                    f"{env.fused_sub_backend_name}; torch's cuDNN op runs only {SUB_ARBITRARY}",
                    "unset NVTE_FUSED_ATTN_BACKEND or set it to 1")
    return None


@FRONTEND_TABLE.note
def _kv_decode(p: AttentionParams, plat: Platform) -> str | None:
    return kv_decode.note(FRONTEND_TABLE.id, p, plat, "cudnn-frontend 1.32 cudnn/sdpa/fwd/kernels (decode kernels "
                          "for sm100 and newer only); measured by benchmarks/bench_kv_decode.py")


TABLES = [FRONTEND_TABLE, TORCH_TABLE, FP8_TABLE]
