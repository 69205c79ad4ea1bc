"""Memory-efficient attention, provider 'torch': the CUTLASS kernels torch vendors from xformers, which
F.scaled_dot_product_attention runs for a call with an attn_mask (aten::_efficient_attention_forward/_backward).

It reads an additive bias of any broadcastable shape in the kernel (so a bool mask becomes 0 / -inf once), takes a
causal diagonal either way round and packed sequences (cu_seqlens), has dropout, and no head-dim bound: the call
F.scaled_dot_product_attention makes with a mask, without building anything per mask structure.
"""
from __future__ import annotations

from ..env import EnvFlags
from ..params import AttentionParams
from ..platform import Platform, parse_version
from . import common
from .base import Failure, Table, fail
from .flash_common import check

SDP_UTILS = "pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp"
ATTENTION_CU = "pytorch aten/src/ATen/native/transformers/cuda/attention.cu (_efficient_attention_forward)"
ATTENTION_BWD = "pytorch aten/src/ATen/native/transformers/cuda/attention_backward.cu (_efficient_attention_backward)"
MIN_TORCH = "2.5"

TABLE = Table("mem_efficient", "torch",
              "torch's memory-efficient SDPA kernels (xformers' CUTLASS): an additive mask or bias read in the "
              "kernel, dropout, any head dim; what F.scaled_dot_product_attention runs for a masked call")
T = TABLE


def _torch_version(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if plat.torch < parse_version(MIN_TORCH):
        return fail(f"torch {plat.torch_version} is older than the aten::_efficient_attention_forward/_backward "
                    f"schema mem_efficient:torch calls (torch {MIN_TORCH})", f"pip install -U 'torch>={MIN_TORCH}'")
    return None


def _dtypes(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    allowed = ("float16", "bfloat16", "float32") if plat.sm >= 80 else ("float16", "float32")
    if p.dtype not in allowed:
        where = f"sm{plat.sm}" if plat.sm else "a device without a CUDA compute capability"
        return fail(f"dtype {p.dtype} is not supported by mem_efficient:torch on {where}; it takes "
                    f"{', '.join(allowed)}", "cast q, k, v to " + " or ".join(allowed[:2]))
    return None


def alignment(p: AttentionParams, plat: Platform) -> int:
    """sdp_utils minimum_gemm_alignment: 128 bits with tensor cores (sm80+, or half types on sm70+), else 4 (sm80+)
    or 1 elements."""
    half = p.dtype in ("float16", "bfloat16")
    if plat.sm >= 80:
        return 8 if half else 4
    return 8 if half and plat.sm >= 70 else 1


def _head_dims(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    align = alignment(p, plat)
    odd = [f"{name}={d}" for name, d in (("head_dim_qk", p.head_dim_qk), ("head_dim_v", p.head_dim_v)) if d % align]
    if odd:
        return fail(f"{', '.join(odd)}: mem_efficient:torch needs head dims that are multiples of {align} for "
                    f"{p.dtype} on sm{plat.sm} ('Mem efficient attention requires last dimension of inputs to be "
                    f"divisible by {align}')", f"pad the head dims to a multiple of {align}")
    return None


def _thd(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.qkv_format != "thd":
        return None
    if not p.inference_kv_cache:
        return fail("qkv_format='thd' outside a KV-cache step: the engine runs SDPA's memory-efficient op on "
                    "[b, h, s, d] tensors and does not pad a packed batch for it",
                    "use flash_attn_2, cudnn_fused or flex_attention for packed sequences, or bshd with a padding "
                    "mask")
    if p.pad_between_seqs:
        return fail("qkv_format='thd' with padding between sequences: the kernel's cu_seqlens are the offsets of "
                    "sequences packed back to back", "pack the sequences without gaps, or use flex_attention")
    if p.has_bias_tensor or p.bias_type == "alibi":
        return fail(f"core_attention_bias_type={p.bias_type!r} with qkv_format='thd': a bias for packed sequences "
                    "would be [1, h, t, t]; attn-dispatch does not build it", "use flex_attention or bshd")
    return None


def _window(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.has_sliding_window:
        return fail(f"window_size={p.window_size}: attn-dispatch does not pass sliding windows to mem_efficient:torch",
                    "use flex_attention, the FlashAttention or cuDNN engines")
    return None


def _bias_grad_under_causal(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.bias_requires_grad and p.is_training and p.attn_mask_type in ("causal", "padding_causal"):
        return fail(f"a bias that requires grad with attn_mask_type={p.attn_mask_type!r}: the causal kernel's bias "
                    "gradient is not zero where the mask removes a score (measured on the H100: relative error 0.42 "
                    "against float32)", "use flex_attention or cudnn_fused (bias gradients), or detach the bias")
    return None


def _determinism(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    return None  # the engine runs its backward under torch's deterministic flag then (num_splits_key = 1)


T.add(
    check(T, "torch_version", f"torch >= {MIN_TORCH}", "package",
          "aten::_efficient_attention_forward/_backward in native_functions.yaml (cu_seqlens, max_seqlen_q/k, "
          "custom_mask_type, scale); the engine checks the argument names when it loads", _torch_version),
    common.loads(T),
    common.on_cuda(T, min_sm=50, max_sm=121, source=SDP_UTILS + " check_mem_efficient_hardware_support: [sm50, sm121]"),
    check(T, "dtype", "float16, bfloat16, float32 (no bfloat16 below sm80)", "dtype",
          SDP_UTILS + " can_use_mem_efficient_attention (greater_than_or_equal_sm80_mem_efficient_dtypes)", _dtypes),
    common.no_fp8(T, source=SDP_UTILS + " (fp16, bf16, fp32 only)"),
    check(T, "head_dim", "head dims multiples of 8 (half types) or 4 (float32) on sm80+; no upper bound; head_dim_v "
          "may differ", "head_dim", SDP_UTILS + " check_head_dim_size_mem_efficient, minimum_gemm_alignment",
          _head_dims),
    common.formats(T, ("bshd", "sbhd", "thd"),
                   source=ATTENTION_CU + ": [b, s, h, d] with any strides but the last; packed sequences through "
                          "cu_seqlens_q/k"),
    check(T, "thd", "thd: KV-cache steps only (packed back to back, no bias or ALiBi)", "format",
          "the engine's forward takes bshd/sbhd (backends/mem_efficient.py); a KV-cache step runs on the padded "
          "cache; " + ATTENTION_CU + " (the bias is [b, h, sq, skv])", _thd),
    common.masks(T, ("no_mask", "padding", "causal", "causal_bottom_right", "padding_causal",
                     "padding_causal_bottom_right", "arbitrary"),
                 source=ATTENTION_CU + " custom_mask_type (0 none, 1 causal top-left, 2 causal bottom-right); "
                        "padding and 'arbitrary' masks become an additive bias (0 / -inf), as SDPA's "
                        "convert_boolean_attn_mask does"),
    check(T, "window", "no sliding window", "window", "attn-dispatch scope (the kernel's window_size is not wired)",
          _window),
    common.bias_types(T, ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi"),
                      source=ATTENTION_CU + " bias [b, h, sq, skv] (any stride-0 broadcast; rows padded to 16 "
                             "elements as SDPA's preprocess_mask does); pre-scale bias and ALiBi as such a bias"),
    check(T, "bias_grad_causal", "no bias gradient under a top-left causal mask", "bias",
          "measured: tests/gpu/test_masked_engines_gpu.py test_bias_that_takes_gradients_with_causal (H100, "
          "torch 2.11: dbias nonzero above the diagonal)", _bias_grad_under_causal),
    check(T, "softmax_type", "softmax_type vanilla (no sink)", "softmax", ATTENTION_CU + " (no sink term)",
          lambda p, plat, env: None if p.softmax_type == "vanilla" else fail(
              f"softmax_type={p.softmax_type!r}: the memory-efficient kernels have no sink term",
              "use flash_attn_4 or cudnn_fused (sinks), or the unfused engine")),
    common.no_return_max_logit(T, source=ATTENTION_CU + " (returns no max logit)"),
    check(T, "deterministic", "a deterministic backward: run with torch's deterministic flag (one key split)",
          "determinism", ATTENTION_BWD + ": 'Memory Efficient attention defaults to a non-deterministic algorithm'; "
          "under torch.use_deterministic_algorithms(True) num_splits_key = 1", _determinism),
    common.kv_cache(T, contiguous=False, paged=False, source="attn-dispatch scope",
                    why_not="attn-dispatch's KV-cache path does not call this kernel"),
    check(T, "cp_comm_type", "no context parallelism, nor its per-block calls (cp_block)", "context_parallel",
          "attn-dispatch scope: the engine's per-block calls under context parallelism are not wired",
          lambda p, plat, env: None if p.cp_size <= 1 and not p.cp_block else fail(
              ("a per-block call of context parallelism" if p.cp_block else
               f"context parallelism (cp_size={p.cp_size}, {p.cp_comm_type})") + " is not supported by "
              "mem_efficient:torch (its backward reads its own out/lse, not a merged one)",
              "run the call without context parallelism, or use the FlashAttention/cuDNN engines or unfused")),
)


@T.note
def _deterministic_note(p: AttentionParams, plat: Platform) -> str | None:
    if p.is_training and p.deterministic:
        return ("deterministic backward: mem_efficient:torch sets torch.use_deterministic_algorithms(True) for its "
                "backward call, which makes the kernel use one key split (" + ATTENTION_BWD + ")")
    return None


@T.note
def _bias_cost(p: AttentionParams, plat: Platform) -> str | None:
    if p.attn_mask_type == "arbitrary" or p.bias_type == "alibi" or (p.has_padding and p.qkv_format != "thd"):
        return ("the mask (or ALiBi) is read as an additive [b|1, h|1, sq, skv] bias: built once per mask tensor and "
                "version (ALiBi: per slopes tensor), read in full by every call (no blocks skipped)")
    return None


TABLES = [TABLE]
