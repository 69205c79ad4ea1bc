"""cuDNN's per-tensor FP8 SDPA (Transformer Engine's fused-attention sub-backend 2, "FP8") through cudnn-frontend's
`sdpa_fp8` / `sdpa_fp8_backward` graphs: the provider `cudnn_fused:fp8`, which runs FP8 calls only (a module
called inside `attn_dispatch.fp8_autocast` with a recipe whose `fp8_dpa=True`).

The rules mirror Transformer Engine's FP8 clause of `nvte_get_fused_attn_backend` (fused_attn.cpp) and the FP8
filters of `get_attention_backend` (pytorch/attention/dot_product_attention/utils.py), narrowed where our probe
of cuDNN 9.19 on an H100 (benchmarks/results/fp8/probe_h100.json) saw cuDNN itself refuse, and where
attn-dispatch's graphs do not carry a feature.

With NVTE_FP8_DPA_BWD=0 (Transformer Engine's meaning) a training call runs the FP8 forward and the bf16 cuDNN fused
backward: the FP8 backward's own limits (d = 128 on Hopper, no thd, its determinism clause) give way to the bf16
engine's backward rules, which this table takes from constraints/cudnn_common.py.
"""
from __future__ import annotations

import functools

from ..env import EnvFlags
from ..params import AttentionParams
from ..platform import Platform
from . import common
from .base import Check, Failure, Table, fail
from .context_parallel import FP8_SOURCE as CP_FP8_SOURCE, TE_CP_FP8_THD, fp8_failures
from .cudnn_common import (FE_VALIDATE, TE_CPP, cudnn_int, cudnn_text, deterministic_demanded, rejected_in_this_process,
                           rule_backward_single_token, rule_determinism, rule_head_dim_limit, rule_hopper_mla_bwd_bug,
                           rule_mask_type, rule_qkv_format, rule_thd_ragged_stats, version_text)

TE_FP8 = "Transformer Engine fused_attn.cpp nvte_get_fused_attn_backend (FP8 clause)"
TE_FP8_PY = common.TE_SELECTION + " (FP8 filters)"
PROBE = "probe on H100, cuDNN 9.19.0, cudnn-frontend 1.32.0, 2026-11-24 (benchmarks/results/fp8/probe_h100.json)"
OURS = "attn_dispatch.backends.cudnn_fused_fp8 (our engine)"
FE_THD = ("cudnn-frontend 1.32 include/cudnn_frontend/node/sdpa_support_surface.h (the FP8 forward has no ragged "
          "clause: ragged offsets need a padding mask, as for bf16) and sdpa_fp8_bwd.h ('sdpa fp8 backward with THD "
          "is not supported on Hopper architecture'); probe on H100, cuDNN 9.19.0, 2026-11-24 "
          "(benchmarks/results/fp8/check_fp8_cp_thd_h100.json): the ragged FP8 forward ran on 6 cases within the "
          "dense calls' error, the ragged backward graph was refused on every case")
TE_BWD_FLAG = ("Transformer Engine pytorch/attention/dot_product_attention/backends.py FusedAttnFunc (is_bwd_fp8 = "
               "fp8 and int(os.getenv('NVTE_FP8_DPA_BWD', '1')); when 0, forward saves the f16 q, k, v, O and backward "
               "runs fused_attention_backend F16_arbitrary_seqlen on them with the FP8 forward's softmax stats)")
FP8_MASKS = ("no_mask", "causal", "padding", "padding_causal")


def fp8_backward(p: AttentionParams, env: EnvFlags) -> bool:
    """Whether this call's backward runs in FP8 (training with NVTE_FP8_DPA_BWD unset or 1)."""
    return p.is_training and env.fp8_dpa_bwd


def backward_text(env: EnvFlags) -> str:
    """Which backward an FP8 training call runs, in words (the Decision's verdict detail and notes)."""
    if env.fp8_dpa_bwd:
        return "cuDNN FP8 (NVTE_FP8_DPA_BWD=1)"
    return "bf16 cuDNN fused on the saved high-precision tensors (NVTE_FP8_DPA_BWD=0)"


def _fp8_call(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if not p.fp8:
        return fail("cudnn_fused:fp8 runs FP8 attention only, and this call is not FP8",
                    "call the module inside attn_dispatch.fp8_autocast(recipe=DelayedScaling(fp8_dpa=True))")
    if p.dtype not in ("float16", "bfloat16"):
        return fail(f"dtype={p.dtype!r}: FP8 attention quantizes float16/bfloat16 q, k, v (the module's inputs)",
                    "pass bf16 or fp16 tensors; the module casts them to FP8")
    return None


def _arch(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if plat.sm == 120:
        return fail("FP8 attention is not supported on sm120 (Transformer Engine disables both FlashAttention and "
                    "FusedAttention for FP8 there)", "run attention in bf16 (recipe fp8_dpa=False)")
    return None


def _cudnn_version(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c = cudnn_int(plat)
    if c is None:
        return fail("no cuDNN runtime was found", "install cuDNN >= 9.7 (nvidia-cudnn-cu12/cu13)")
    if c == 91000:
        return fail("cuDNN 9.10.0 has known bugs in its FP8 SDPA (Transformer Engine excludes it)",
                    "upgrade cuDNN to >= 9.10.1")
    if c >= 90700:
        return None
    if c < 90201:
        return fail(f"FP8 SDPA needs cuDNN >= 9.2.1; found {cudnn_text(plat)}", "upgrade cuDNN to >= 9.7")
    # 9.2.1 - 9.6: d = 128, seqlens multiples of 128, no_mask/causal only
    problems = []
    if (p.head_dim_qk, p.head_dim_v) != (128, 128):
        problems.append(f"head dims 128 (got {p.head_dim_qk}/{p.head_dim_v})")
    if p.max_seqlen_q % 128 or p.max_seqlen_kv % 128:
        problems.append(f"max_seqlen_q/kv multiples of 128 (got {p.max_seqlen_q}/{p.max_seqlen_kv})")
    if p.attn_mask_type not in ("no_mask", "causal"):
        problems.append(f"no_mask or causal (got {p.attn_mask_type!r})")
    if problems:
        return fail(f"cuDNN {cudnn_text(plat)} (< 9.7) runs FP8 SDPA only with " + "; ".join(problems),
                    "upgrade cuDNN to >= 9.7 (any length, padding masks, other head dims)")
    return None


def _head_dims(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    dqk, dv = p.head_dim_qk, p.head_dim_v
    if dqk % 16 or dv % 16:
        return fail(f"head dims {dqk}/{dv}: FP8 SDPA needs multiples of 16", "pad the head dim to a multiple of 16")
    if plat.sm >= 100:
        if dqk > 128 or dv > 128:
            return fail(f"head dims {dqk}/{dv}: FP8 SDPA on Blackwell takes <= 128 (cuDNN < 9.21; 9.21 adds "
                        "d_qk 192 / d_v 128, not declared here)", "use head dims <= 128, or bf16 attention")
        return None
    if fp8_backward(p, env) and (dqk, dv) != (128, 128):
        return fail(f"head dims {dqk}/{dv} in training: cuDNN's FP8 backward on Hopper takes head dim 128 only "
                    "(cuDNN 9.19: 'hidden_dim should be equal to 128')",
                    "use head_dim 128, set NVTE_FP8_DPA_BWD=0 (FP8 forward, bf16 backward), run this layer in bf16 "
                    "(fp8_dpa=False), or run inference (eval mode)")
    if dqk > 256 or dv > 256:
        return fail(f"head dims {dqk}/{dv}: FP8 SDPA forward on Hopper takes <= 256", "use head dims <= 256")
    return None


def _masks(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.attn_mask_type not in FP8_MASKS:
        bottom_right = p.attn_mask_type.endswith("bottom_right")
        return fail(f"attn_mask_type={p.attn_mask_type!r}: FP8 SDPA takes {', '.join(FP8_MASKS)}"
                    + (" (bottom-right alignment needs Blackwell and cuDNN >= 9.21; on this H100 cuDNN 9.19 "
                       "refused it)" if bottom_right else ""),
                    "use a top-left causal or padding mask, or bf16 attention")
    if p.max_seqlen_q == 1 and not p.is_training:
        return fail("max_seqlen_q=1: cuDNN 9.19 on sm90 has no FP8 engine for single-query (decode) steps",
                    "decode in bf16 (fp8_dpa=False for generation)")
    return None


def _format(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.qkv_format != "thd":
        return None
    if fp8_backward(p, env):
        if plat.sm < 100:
            return fail("qkv_format='thd' in training: cuDNN's FP8 backward takes no ragged (thd) tensors on Hopper "
                        "(cudnn-frontend 1.32 sdpa_fp8_bwd.h: 'sdpa fp8 backward with THD is not supported on Hopper "
                        "architecture')", "set NVTE_FP8_DPA_BWD=0 (FP8 forward, bf16 backward), train on bshd with a "
                        "padding mask (cu_seqlens), or run packed sequences in bf16; FP8 thd runs in inference")
        return fail("qkv_format='thd' in training on Blackwell: cudnn-frontend allows a ragged FP8 backward there, "
                    "but Transformer Engine's FP8 clause has no thd and attn-dispatch has not run it",
                    "set NVTE_FP8_DPA_BWD=0 (FP8 forward, bf16 backward), train on bshd with a padding mask "
                    "(cu_seqlens), or run packed sequences in bf16")
    return None


def _no_window(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.has_sliding_window:
        return fail(f"window_size={p.window_size}: FP8 attention takes no sliding window (Transformer Engine "
                    "disables FusedAttention for FP8 with sliding windows)", "use bf16 attention for windowed layers")
    return None


def _no_bias(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.bias_type != "no_bias":
        return fail(f"core_attention_bias_type={p.bias_type!r}: FP8 SDPA takes no bias", "use bf16 attention")
    return None


def _softmax(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    c = cudnn_int(plat) or 0
    if p.softmax_type != "vanilla" and (plat.sm < 100 or c < 92100):
        return fail(f"softmax_type={p.softmax_type!r} in FP8 needs Blackwell and cuDNN >= 9.21",
                    "use softmax_type='vanilla', or bf16 attention")
    return None


def _determinism(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if not (fp8_backward(p, env) and deterministic_demanded(p, env)):
        return None
    c = cudnn_int(plat) or 0
    if plat.sm < 90 or c < 91900:
        return fail(f"a deterministic FP8 backward needs sm90+ and cuDNN >= 9.19; found sm{plat.sm}, "
                    f"{cudnn_text(plat)}", "allow non-deterministic algorithms, or upgrade cuDNN")
    if plat.sm >= 100 and c < 91800:
        return fail("a deterministic FP8 backward on Blackwell needs cuDNN >= 9.18", "upgrade cuDNN")
    return None


def _recipe(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.fp8_recipe not in (None, "delayed", "current"):
        return fail(f"FP8 recipe {p.fp8_recipe!r} is not implemented (block scaling, MXFP8 and NVFP4 recipes are "
                    "not)", "use DelayedScaling or Float8CurrentScaling")
    return None


def _kv_cache(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.inference_kv_cache:
        return fail("FP8 attention with a KV cache is not supported (Transformer Engine disables FusedAttention "
                    "for FP8 KV caching)", "generate in bf16 (fp8_dpa=False)")
    return None


def _fp8_output_training(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.fp8_output and p.is_training:
        return fail("an FP8 output (fp8_output=True / recipe fp8_mha=True) with the module in training mode: it is "
                    "returned as attn_dispatch.fp8.Float8Output, which autograd cannot differentiate",
                    "call module.eval() for inference with FP8 outputs; train with bf16 outputs (fp8_mha=False)")
    return None


# The bf16 engine's rules that bound its backward, as its own tables declare them (constraints/cudnn_fused.py);
# the FP8 forward's own limits (masks, bias, window, head dims <= 256 on Hopper) are narrower than the bf16 forward's.
_F16_BACKWARD_RULES = (rule_head_dim_limit, functools.partial(rule_hopper_mla_bwd_bug, provider="frontend"),
                       rule_qkv_format, rule_thd_ragged_stats, rule_mask_type, rule_determinism,
                       rule_backward_single_token)


def _f16_backward(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if not p.is_training or env.fp8_dpa_bwd:
        return None
    failures = [f for f in (rule(p, plat, env) for rule in _F16_BACKWARD_RULES) if f is not None]
    if not failures:
        return None
    return fail("NVTE_FP8_DPA_BWD=0 runs the backward on the bf16 cuDNN fused engine, which cannot run it here: "
                + "; ".join(f.message for f in failures), next((f.fix for f in failures if f.fix), None))


def _f16_backward_context_parallel(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.is_training and not env.fp8_dpa_bwd and p.cp_size > 1:
        return fail(f"NVTE_FP8_DPA_BWD=0 under context parallelism (cp_size={p.cp_size}): the FP8 a2a path sends dO "
                    "and the gradients across ranks in FP8 and runs cuDNN's FP8 backward; a bf16 backward there is "
                    "not implemented", "unset NVTE_FP8_DPA_BWD (or set it to 1), or run this layer in bf16")
    return None


def _cudnn_rejected(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    # with NVTE_FP8_DPA_BWD=0 the backward graph is the bf16 engine's, recorded under its own phase name
    return rejected_in_this_process(p, plat, env, ("fp8_fwd", "fp8_bwd" if env.fp8_dpa_bwd else "bwd"),
                                    "FP8 configuration", "run this call in bf16 (it is excluded for this signature "
                                    "from now on)")


def _context_parallel(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    problems = fp8_failures(p)
    if problems:
        return fail("; ".join(message for _, message, _ in problems), next((f for _, _, f in problems if f), None))
    return None


def _sub_backend_pin(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    pin = env.fused_attn_backend
    if pin is not None and pin != "2":
        return fail(f"NVTE_FUSED_ATTN_BACKEND={pin} pins {env.fused_sub_backend_name}; this provider is the FP8 "
                    "sub-backend (2)", "unset NVTE_FUSED_ATTN_BACKEND or set it to 2")
    return None


FP8_TABLE = Table("cudnn_fused", "fp8",
                  "cuDNN per-tensor FP8 SDPA (E4M3 forward; E5M2 or E4M3 backward) through cudnn-frontend graphs",
                  detail=lambda p, plat, env: {"sub_backend": "FP8", "backward": backward_text(env)}
                  if p.is_training else {"sub_backend": "FP8"})
FP8_TABLE.add(
    common.env_enabled(FP8_TABLE),
    common.on_cuda(FP8_TABLE, min_sm=90, source=TE_FP8 + " (sm_arch_ >= 90)"),
    common.package(FP8_TABLE, "cudnn-frontend", minimum="1.10.0", tested_max="1.32.0",
                   source="cudnn-frontend python bindings (pygraph.sdpa_fp8, sdpa_fp8_backward)"),
    common.loads(FP8_TABLE),
)
_CHECKS = (
    ("fp8_call", "an FP8 call (fp8_autocast with fp8_dpa=True) on float16/bfloat16 inputs", "dtype", TE_FP8_PY,
     _fp8_call),
    ("fp8_arch", "not sm120", "platform", TE_FP8_PY + " ('FP8 is not supported for compute capability = sm120')",
     _arch),
    ("fp8_cudnn", "cuDNN >= 9.2.1 (d 128, seqlens % 128, no_mask/causal); >= 9.7 otherwise; not 9.10.0", "package",
     TE_FP8 + " ('9.2.1', '9.7', '9.10.0: known bugs with SDPA FP8')", _cudnn_version),
    ("fp8_head_dim", "multiples of 16; sm90: FP8 backward d = 128, forward <= 256; Blackwell <= 128", "head_dim",
     TE_FP8 + " ('sm90: fwd d<=256, bwd d=128 only'); " + PROBE, _head_dims),
    ("fp8_mask", f"attn_mask_type in {', '.join(FP8_MASKS)}; no single-query inference step", "mask",
     TE_FP8 + " (mask clause); " + PROBE + " (bottom-right and s_q = 1 refused)", _masks),
    ("fp8_format", "qkv_format bshd or sbhd; thd not with the FP8 backward", "format",
     TE_FP8 + " ('{bshd, sbhd}'); " + FE_THD, _format),
    ("fp8_window", "no sliding window", "window",
     TE_FP8_PY + " ('does not support sliding window attention for FP8')", _no_window),
    ("fp8_bias", "no bias", "bias", TE_FP8 + " (bias_type == NVTE_NO_BIAS)", _no_bias),
    ("fp8_softmax", "vanilla softmax (sinks: Blackwell, cuDNN >= 9.21)", "softmax",
     TE_FP8_PY + " ('softmax_type = %s in FP8 on sm < 100 with cuDNN version < 9.21')", _softmax),
    ("fp8_determinism", "deterministic FP8 backward: sm90+, cuDNN >= 9.19 (Blackwell 9.18)", "determinism",
     TE_FP8_PY + " ('determinism reasons with FP8 on arch < sm90 or cuDNN < 9.19.0')", _determinism),
    ("fp8_recipe", "DelayedScaling or Float8CurrentScaling", "dtype", OURS, _recipe),
    ("fp8_kv_cache", "no KV cache", "inference", common.TE_KV_FILTER + " ('Disabling FusedAttention for FP8 KV "
     "caching')", _kv_cache),
    ("fp8_output_training", "an FP8 output only in inference", "dtype", OURS, _fp8_output_training),
    ("fp8_context_parallel", "context parallelism: cp_comm_type='a2a' on bshd/sbhd, bf16 output", "context_parallel",
     CP_FP8_SOURCE + "; " + TE_CP_FP8_THD, _context_parallel),
    ("fp8_f16_backward", "NVTE_FP8_DPA_BWD=0 in training: the bf16 cuDNN fused backward's limits (head dims, "
     "format, masks, determinism)", "environment",
     TE_BWD_FLAG + "; " + TE_CPP + " (head-dim, format, mask and determinism clauses); " + FE_VALIDATE
     + "; " + OURS + " (the FP8 forward's graph is the inference one, with stats: d <= 256 on sm90 per " + PROBE
     + "; Transformer Engine keeps the FP8 clause's training limits whatever the flag)", _f16_backward),
    ("fp8_f16_backward_context_parallel", "NVTE_FP8_DPA_BWD=0 in training: no context parallelism", "context_parallel",
     OURS + " (the FP8 a2a path's backward is cuDNN's FP8 one)", _f16_backward_context_parallel),
    ("sub_backend_pin", "NVTE_FUSED_ATTN_BACKEND unset or 2 (FP8)", "environment",
     "Transformer Engine env override 'NVTE_FUSED_ATTN_BACKEND'", _sub_backend_pin),
    ("cudnn_rejected", "cuDNN's own support check accepted this configuration", "platform",
     "observed at run time (cudnn-frontend check_support / build_plans)", _cudnn_rejected),
)
for _name, _requires, _topic, _source, _fn in _CHECKS:
    FP8_TABLE.add(Check(f"cudnn_fused.{_name}", _requires, _topic, _source, _fn))
FP8_TABLE.add(common.no_dropout(FP8_TABLE, source=OURS + " (the FP8 graphs are built without dropout)"),
              common.no_return_max_logit(FP8_TABLE, source=TE_FP8 + " (!return_max_logit)"))

__all__ = ["FP8_TABLE", "FP8_MASKS", "backward_text", "fp8_backward", "version_text"]
