"""FlashAttention 2: the flash-attn 2.x package, then the FA2 kernels vendored in torch (provider order)."""
from __future__ import annotations


from ..env import EnvFlags
from ..params import AttentionParams
from ..platform import parse_version, Platform
from . import common, kv_decode
from .base import Failure, Table, fail
from .flash_common import (CONSUMER_SM, CP, FA_CHANGELOG, MASKS, TE_UTILS, check, deterministic_backward, gqa,
                           no_padding_between_sequences, top_left_alignment, version_for)

FA2_API = "flash-attn csrc/flash_attn/flash_api.cpp (mha_fwd, mha_varlen_fwd, mha_bwd)"
TORCH_FLASH_API = "pytorch aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp (vendored FA2)"
TORCH_SDP_UTILS = "pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp"
TORCH_BWD = "pytorch aten/src/ATen/native/transformers/cuda/attention_backward.cu (_flash_attention_backward)"
# Transformer Engine's FlashAttentionUtils.max_version: flash-attn 2.x cannot be built within our GPU lease
TESTED_MAX = "2.8.3"

# ---------------------------------------------------------------------------------------------------------------
PACKAGE_TABLE = Table("flash_attn_2", "package",
                      "the flash-attn 2.x package: _flash_attn_(varlen_)forward/backward, dropout, ALiBi, windows")
P = PACKAGE_TABLE


def _installed_with_metadata(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    status = plat.package("flash-attn")
    if status.installed and status.version == "unknown":
        return fail("a `flash_attn` module is importable but no flash-attn distribution is installed: flash-attn-4 "
                    "alone provides the `flash_attn.cute` namespace package, without the FA2 kernels "
                    "(flash_attn_2_cuda)", f"pip install 'flash-attn>=2.1.1,<={TESTED_MAX}'")
    return None


def _blackwell_version(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    version = plat.package_version("flash-attn")
    if plat.sm >= 100 and version is not None and version < parse_version("2.7.3"):
        return fail(f"flash-attn {plat.package('flash-attn').version} has no kernels for sm{plat.sm} (Blackwell); "
                    "it needs flash-attn >= 2.7.3", "pip install -U 'flash-attn>=2.7.3'")
    return None


def _consumer_gpu_backward(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    """Head dims above 192 train on ~100 KB-shared-memory GPUs only without dropout, and only since 2.5.5."""
    if not p.is_training or plat.sm not in CONSUMER_SM or p.head_dim_qk <= 192:
        return None
    version = plat.package_version("flash-attn")
    if version is not None and version < parse_version("2.5.5"):
        return fail(f"backward with head_dim={p.head_dim_qk} > 192 on sm{plat.sm} needs flash-attn >= 2.5.5 (before "
                    f"that only sm80/sm90 trained head dims above 192); {plat.package('flash-attn').version} is "
                    "installed", "pip install -U 'flash-attn>=2.5.5', or use head_dim <= 192, or run inference")
    if p.dropout > 0:
        return fail(f"backward with head_dim={p.head_dim_qk} > 192 and attention_dropout={p.dropout} needs an "
                    f"sm80/sm90-class GPU; sm{plat.sm} has too little shared memory",
                    "set attention_dropout=0, or use head_dim <= 192")
    return None


P.add(
    common.env_enabled(P),
    common.on_cuda(P, min_sm=80, source="flash-attn README 'Installation and features' (Ampere, Ada, Hopper); "
                   + FA2_API + " 'FlashAttention only supports Ampere GPUs or newer'"),
    common.package(P, "flash-attn", minimum="2.1.1", tested_max=TESTED_MAX,
                   source=TE_UTILS + " FlashAttentionUtils (version_required 2.1.1, max_version 2.8.3)"),
    check(P, "distribution", "flash-attn distribution metadata (not just the flash_attn.cute namespace)", "package",
          "importlib.metadata; flash-attn-4 wheels ship flash_attn/cute without flash_attn/__init__.py",
          _installed_with_metadata),
    check(P, "blackwell_version", "sm100+ needs flash-attn >= 2.7.3", "package",
          TE_UTILS + " FlashAttentionUtils.version_required_blackwell", _blackwell_version),
    common.loads(P),
    common.dtypes(P, ("float16", "bfloat16"), source=FA2_API + " 'FlashAttention only support fp16 and bf16'"),
    common.no_fp8(P, source="flash-attn 2.x has no FP8 kernels"),
    common.head_dim_limit(P, max_qk=256, multiple=8, same_qk_v=True,
                          source=FA2_API + " head_size <= 256, multiple of 8; one head dim for q, k, v (" + TE_UTILS
                          + ": FA2 does not support MLA)"),
    check(P, "head_dim_backward", "training with head_dim > 192 on sm86/sm89/sm120: flash-attn >= 2.5.5, no dropout",
          "head_dim", "flash-attn README ('Head dim 256 backward now works on consumer GPUs (if there's no dropout) "
          "as of flash-attn 2.5.5'); " + FA2_API + " mha_bwd", _consumer_gpu_backward),
    gqa(P),
    common.formats(P, ("bshd", "sbhd", "thd"),
                   source="flash_attn_func takes bshd (sbhd as a strided view); flash_attn_varlen_func takes thd"),
    common.masks(P, MASKS, source="FlashAttention takes no mask tensor: a causal flag, and cu_seqlens for padding"),
    top_left_alignment(P, source=FA_CHANGELOG + " 2.1 'Change behavior of causal flag'; " + TE_UTILS),
    no_padding_between_sequences(P),
    version_for(P, "sliding_window_version", "flash-attn", "2.3", feature="sliding window",
                applies=lambda p, env: p.has_sliding_window, source=FA_CHANGELOG + " 2.3: local attention",
                topic="window"),
    common.bias_types(P, ("no_bias", "alibi"), source="flash_attn_func: alibi_slopes only, no bias tensor"),
    version_for(P, "alibi_version", "flash-attn", "2.4", feature="ALiBi", applies=lambda p, env: p.bias_type == "alibi",
                source=FA_CHANGELOG + " 2.4: ALiBi", topic="bias"),
    version_for(P, "deterministic_version", "flash-attn", "2.4.1", feature="a deterministic backward",
                applies=deterministic_backward, topic="determinism",
                source=FA_CHANGELOG + " 2.4 (deterministic backward); " + TE_UTILS + " (>= 2.4.1 for determinism)"),
    common.softmax_types(P, ("vanilla",), source=TE_UTILS + " (softmax_type other than vanilla disables "
                                                            "FlashAttention)"),
    common.no_return_max_logit(P, source=TE_UTILS + " (return_max_logit disables FlashAttention)"),
    common.kv_cache(P, contiguous=False, paged=False, source=common.TE_KV_FILTER,
                    why_not="flash_attn_with_kvcache is not wired up in attn-dispatch"),
    common.cp_comm_types(P, ("p2p", "all_gather", "a2a", "a2a+p2p"), source=CP),
)


@P.note
def _package_untested(p: AttentionParams, plat: Platform) -> str | None:
    if plat.package("flash-attn").installed:
        return ("flash_attn_2:package follows flash-attn's internal API across 2.x releases by parameter name; it "
                "has not run on the project's machines (flash-attn 2.x is not installable there)")
    return None


# ---------------------------------------------------------------------------------------------------------------
TORCH_TABLE = Table("flash_attn_2", "torch",
                    "torch's vendored FA2 kernels: aten::_flash_attention_forward/_backward (cum_seq, windows)")
T = TORCH_TABLE


def _torch_build(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if plat.device_type == "cuda" and not plat.torch_flash_sdpa:
        return fail(f"this torch ({plat.torch_version}) was built without its FlashAttention kernels "
                    "(torch.backends.cuda.is_flash_attention_available() is False)",
                    "install a CUDA build of torch for sm80+")
    return None


def _torch_version(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if plat.torch < parse_version("2.4"):
        return fail(f"torch {plat.torch_version} predates the FA2 2.5 interface of aten::_flash_attention_forward "
                    "(window sizes, ALiBi slopes, the [h, t] varlen lse) that flash_attn_2:torch calls",
                    "pip install -U 'torch>=2.4'")
    return None


# The oldest torch whose aten::_flash_attention_forward schema we have seen take block_table (and num_splits).
TORCH_BLOCK_TABLE = "2.13"


def _paged_needs_block_table(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.inference_kv_cache and p.kv_cache_paged and plat.torch < parse_version(TORCH_BLOCK_TABLE):
        return fail(f"torch {plat.torch_version}'s aten::_flash_attention_forward takes no block_table (seen from "
                    f"torch {TORCH_BLOCK_TABLE}), so it cannot read a paged KV cache",
                    f"pip install -U 'torch>={TORCH_BLOCK_TABLE}', or use a contiguous cache")
    return None


def _torch_consumer_backward(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    """sdp_utils: on sm86..89 and sm120..121, training needs head_dim <= 192, or head_dim > 224 without dropout."""
    if not p.is_training or plat.sm not in CONSUMER_SM or p.head_dim_qk <= 192:
        return None
    if p.head_dim_qk <= 224 or p.dropout > 0:
        return fail(f"training with head_dim={p.head_dim_qk} and attention_dropout={p.dropout} on sm{plat.sm}: torch's "
                    "flash backward supports head_dim in (192, 224] nowhere on this GPU, and head_dim > 224 only "
                    "without dropout", "use head_dim <= 192, or head_dim > 224 with attention_dropout=0")
    return None


def _torch_bias(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.bias_type == "alibi":
        return fail("core_attention_bias_type='alibi' is not supported by flash_attn_2:torch: torch compiles its "
                    "FA2 kernels with FLASHATTENTION_DISABLE_ALIBI, so aten::_flash_attention_forward raises 'This "
                    "flash attention build does not support alibi.' (observed on torch 2.11.0+cu130), although its "
                    "schema has an alibi_slopes argument",
                    "use flash_attn_2:package (flash-attn >= 2.4), cudnn_fused or the unfused engine")
    if p.bias_type != "no_bias":
        return fail(f"core_attention_bias_type={p.bias_type!r} is not supported by flash_attn_2:torch: the op takes "
                    "no bias tensor", "use no_bias, or cudnn_fused / the unfused engine for a bias")
    return None


T.add(
    common.env_enabled(T),
    common.on_cuda(T, min_sm=80, max_sm=121,
                   source=TORCH_SDP_UTILS + " check_flash_attention_hardware_support: [sm80, sm121]"),
    check(T, "torch_build", "torch built with its FlashAttention kernels", "platform",
          "torch.backends.cuda.is_flash_attention_available()", _torch_build),
    check(T, "torch_version", "torch >= 2.4", "package",
          "pytorch PRs #126061 and #126520 (May 2024: window_size_left/right, seqused_k, alibi_slopes on "
          "aten::_flash_attention_forward, synced with FA2 2.5)", _torch_version),
    common.loads(T),
    common.dtypes(T, ("float16", "bfloat16"), source=TORCH_FLASH_API + " 'FlashAttention only support fp16 and bf16'"),
    common.no_fp8(T, source="aten::_flash_attention_forward runs FA2 kernels only (fp16/bf16)"),
    common.head_dim_limit(T, max_qk=256, multiple=8, same_qk_v=True,
                          source=TORCH_FLASH_API + " mha_fwd: head_size <= 256, a multiple of 8 ('ensured by "
                          "padding' in SDPA, not in the op), v shaped like k; " + TORCH_SDP_UTILS
                          + " check_head_dim_size_flash"),
    check(T, "head_dim_backward", "training on sm86-89/sm120-121: head_dim <= 192, or > 224 without dropout",
          "head_dim", TORCH_SDP_UTILS + " check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120",
          _torch_consumer_backward),
    gqa(T),
    common.formats(T, ("bshd", "sbhd", "thd"),
                   source=TORCH_FLASH_API + " mha_fwd (bshd, any strides but the last; sbhd as a view) and "
                   "mha_varlen_fwd (cum_seq_q/k)"),
    common.masks(T, MASKS, source="the op takes is_causal and cumulative sequence lengths, no mask tensor"),
    top_left_alignment(T, source=TORCH_SDP_UTILS + " check_flash_causal_non_square_seqlens (FA2 is bottom-right); "
                       + TE_UTILS),
    no_padding_between_sequences(T),
    check(T, "bias_type", "no_bias only (no bias tensor; ALiBi compiled out of torch's FA2)", "bias",
          TORCH_FLASH_API + " set_params_alibi: '#ifdef FLASHATTENTION_DISABLE_ALIBI ... This flash attention build "
          "does not support alibi.'; observed on torch 2.11.0+cu130 (H100, GPU test alibi_inference)", _torch_bias),
    common.softmax_types(T, ("vanilla",), source="the op has no sink/offset argument"),
    common.no_return_max_logit(T, source="the op returns no max logit"),
    common.kv_cache(T, contiguous=True, paged=True, page_multiple=256,
                    source="aten::_flash_attention_forward (varlen: seqused_k for cache rows, block_table for pages); "
                           "flash-attn flash_api.cpp 'Paged KV cache block size must be divisible by 256'; "
                           + common.TE_KV_FILTER),
    check(T, "kv_cache_pages", "a paged KV cache: torch whose op takes block_table", "inference",
          "aten::_flash_attention_forward schema (block_table)", _paged_needs_block_table),
    common.cp_comm_types(T, ("p2p", "all_gather", "a2a", "a2a+p2p"), source=CP),
)


@T.note
def _torch_determinism(p: AttentionParams, plat: Platform) -> str | None:
    if p.is_training and p.deterministic:
        return ("deterministic backward: torch's flash backward reads torch.use_deterministic_algorithms(); "
                "flash_attn_2:torch sets it for the duration of its backward call (" + TORCH_BWD + ")")
    return None


@T.note
def _torch_fa4_registration(p: AttentionParams, plat: Platform) -> str | None:
    if plat.device_type == "cuda" and plat.torch >= parse_version("2.11"):
        return ("torch.nn.attention.activate_flash_attention_impl('FA4') would reroute aten::_flash_attention_forward "
                "to flash-attn-4, and fails with flash-attn-4 4.0.0b36 ('too many values to unpack'); attn-dispatch "
                "leaves it off (flash_attn_4:cute calls flash_attn.cute directly)")
    return None


@T.note
def _kv_decode(p: AttentionParams, plat: Platform) -> str | None:
    return kv_decode.note(T.id, p, plat, kv_decode.FA2_SOURCE)


TABLES = [PACKAGE_TABLE, TORCH_TABLE]
