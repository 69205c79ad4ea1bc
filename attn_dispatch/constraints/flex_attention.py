"""FlexAttention (torch.nn.attention.flex_attention), provider 'torch': any mask as a BlockMask, score modifiers.

What attn-dispatch expresses through it: every Transformer Engine mask type (padding and thd as a document mask over
cu_seqlens, causal either way round, sliding windows), 'arbitrary' bool masks of any broadcastable shape (a mask_mod
reading the tensor), pre/post-scale bias tensors and ALiBi (a score_mod reading them), softcap, GQA, and a user's own
mask_mod / score_mod. On CUDA it runs torch.compile'd (Triton kernels that skip the blocks the BlockMask leaves out);
on the CPU torch runs it eagerly, for inference only.
"""
from __future__ import annotations

from ..env import EnvFlags
from ..params import AttentionParams
from ..platform import Platform, parse_version
from . import common
from .base import Check, Failure, Table, fail
from .flash_common import check, deterministic_backward, why_deterministic

FLEX_API = "torch/nn/attention/flex_attention.py (torch 2.13)"
FLEX_LOWERING = "torch/_inductor/kernel/flex/flex_attention.py (torch 2.13)"
FLEX_CONFIGS = "torch/_inductor/template_heuristics/triton.py get_flex_attn_fwd_configs / get_flex_attn_bwd_configs"
MIN_TORCH = "2.5"
MIN_TORCH_BIAS_GRAD = "2.6"
MAX_HEAD_DIM = 256   # the largest head dim torch tunes FlexAttention's kernels for (larger: 16x16 fallback tiles)
MIN_HEAD_DIM = 16    # tl.dot's smallest operand
BLOCK_SIZE = 128     # the BlockMask's tile (create_block_mask's default)
CPU_BACKWARD_ERROR = ("FlexAttention does not support backward on CPU. Please set the input requires_grad to False "
                      "or use another device.")

TABLE = Table("flex_attention", "torch",
              "torch's FlexAttention: any mask as a block-sparse BlockMask, bias/ALiBi/softcap as a score_mod; "
              "compiled with torch.compile on CUDA (eager, inference only, on the CPU)")
T = TABLE


def _torch_version(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if plat.torch < parse_version(MIN_TORCH):
        return fail(f"torch {plat.torch_version} has no torch.nn.attention.flex_attention (added in torch {MIN_TORCH})",
                    f"pip install -U 'torch>={MIN_TORCH}'")
    return None


def _device(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.device_type == "cuda":
        if plat.device_type != "cuda":
            return fail("the call is on CUDA but the platform has no CUDA GPU")
        if plat.sm < 80:
            return fail(f"flex_attention:torch needs compute capability sm80+ (Triton's bf16 dot, the GPUs torch tunes "
                        f"FlexAttention for); this GPU ({plat.device_name}) is sm{plat.sm}",
                        "use mem_efficient:torch (sm50+) or the unfused engine")
        if not plat.triton:
            return fail("triton is not importable, so torch.compile cannot build FlexAttention's kernels (eager "
                        "FlexAttention materialises every score)", "pip install triton (torch's CUDA wheels bring it)")
        return None
    if p.is_training:
        return fail(f"training on the CPU: torch raises '{CPU_BACKWARD_ERROR}' (observed on torch 2.13.0+cpu)",
                    "run inference (eval mode, or no grad), or move the call to a CUDA device")
    return None


def _dtypes(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    allowed = ("float16", "bfloat16", "float32") + (("float64",) if p.device_type == "cpu" else ())
    if p.dtype not in allowed:
        where = "on the CPU (eager)" if p.device_type == "cpu" else "on CUDA (Triton kernels)"
        return fail(f"dtype {p.dtype} is not supported by flex_attention:torch {where}; it takes "
                    f"{', '.join(allowed)}", "cast q, k, v to bfloat16 or float16")
    return None


def _head_dims(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.device_type != "cuda":
        return None  # the eager path is plain matmuls
    dims = (("head_dim_qk", p.head_dim_qk), ("head_dim_v", p.head_dim_v))
    small = [f"{name}={d}" for name, d in dims if d < MIN_HEAD_DIM]
    if small:
        return fail(f"{', '.join(small)} < {MIN_HEAD_DIM}: FlexAttention's CUDA lowering raises 'NYI: embedding "
                    f"dimension of the query, key, and value must be at least {MIN_HEAD_DIM}'",
                    f"pad the head dims to {MIN_HEAD_DIM}, or use mem_efficient:torch")
    large = [f"{name}={d}" for name, d in dims if d > MAX_HEAD_DIM]
    if large:
        return fail(f"{', '.join(large)} > {MAX_HEAD_DIM}: torch tunes FlexAttention's kernels up to head dim "
                    f"{MAX_HEAD_DIM}; beyond it they fall back to 16x16 backward tiles, which attn-dispatch has not "
                    "measured", "use mem_efficient:torch (no head-dim bound) or the unfused engine")
    return None


def _bias(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.has_bias_tensor and p.bias_requires_grad and p.is_training:
        if plat.torch < parse_version(MIN_TORCH_BIAS_GRAD):
            return fail(f"a bias that requires grad: torch {plat.torch_version}'s FlexAttention raises 'Captured "
                        f"buffers that require grad are not yet supported' (learnable biases from torch "
                        f"{MIN_TORCH_BIAS_GRAD})", f"pip install -U 'torch>={MIN_TORCH_BIAS_GRAD}', or detach the bias")
    return None


def _determinism(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if deterministic_backward(p, env) and p.has_bias_tensor and p.bias_requires_grad:
        return fail(f"{why_deterministic(p)} demands a deterministic backward, but FlexAttention accumulates the "
                    "gradient of a bias it reads in a score_mod with atomic adds", "detach the bias, or use the "
                    "unfused engine (deterministic)")
    return None


def _user_mods(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    return None  # FlexAttention is where a user's mask_mod / score_mod run: nothing to refuse


T.add(
    check(T, "torch_version", f"torch >= {MIN_TORCH}", "package",
          f"torch {MIN_TORCH}.0 release notes (FlexAttention, prototype: torch.nn.attention.flex_attention)",
          _torch_version),
    common.loads(T),
    check(T, "device", "CUDA sm80+ with triton (torch.compile); the CPU for inference only", "platform",
          FLEX_API + " _validate_device: '" + CPU_BACKWARD_ERROR + "'; Triton bf16 tl.dot needs sm80; "
          + FLEX_CONFIGS + " (a100/h100/sm100 tuned configs)", _device),
    check(T, "dtype", "float16, bfloat16, float32 (and float64 on the CPU)", "dtype",
          FLEX_CONFIGS + " (float32 configs; half types); the CPU runs torch's eager math path", _dtypes),
    common.no_fp8(T, source="FlexAttention's Triton kernels take fp16/bf16/fp32"),
    check(T, "head_dim", f"CUDA: {MIN_HEAD_DIM} <= head_dim_qk, head_dim_v <= {MAX_HEAD_DIM} (any, not only powers "
          "of two; head_dim_v may differ)", "head_dim",
          FLEX_LOWERING + " ('NYI: embedding dimension ... must be at least 16'; set_head_dim_values rounds to a "
          "power of two, v may differ); " + FLEX_CONFIGS + " (tuned for head_dim <= 256)", _head_dims),
    common.formats(T, ("bshd", "sbhd", "thd"),
                   source="attn_dispatch.backends.flex_attention: bshd/sbhd as [b, h, s, d] views; thd as one "
                          "sequence of packed documents (a document mask over cu_seqlens, padded offsets too)"),
    common.masks(T, ("no_mask", "padding", "causal", "causal_bottom_right", "padding_causal",
                     "padding_causal_bottom_right", "arbitrary"),
                 source="attn_dispatch.backends.flex_attention: every mask type as a mask_mod; 'arbitrary' reads "
                        "the bool tensor ([1|b, 1|h, sq, skv]) in the mask_mod and in the BlockMask's blocks"),
    common.bias_types(T, ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi"),
                      source="attn_dispatch.backends.flex_attention: score_mod reads the bias tensor (any of "
                             "1hss, b1ss, bhss, 11ss) or the ALiBi slopes"),
    check(T, "bias_grad", f"a bias that requires grad: torch >= {MIN_TORCH_BIAS_GRAD}", "bias",
          "pytorch PR #137452 ('[FlexAttention] add support for learnable biases in Inductor', Oct 2024: "
          "tl.atomic_add into the captured buffer's gradient)", _bias),
    common.no_dropout(T, source=FLEX_API + " flex_attention has no dropout argument"),
    check(T, "softmax_type", "softmax_type vanilla (no sink)", "softmax", FLEX_API + " (no sink term in the softmax)",
          lambda p, plat, env: None if p.softmax_type == "vanilla" else fail(
              f"softmax_type={p.softmax_type!r}: FlexAttention's softmax has no sink term",
              "use flash_attn_4 or cudnn_fused (sinks), or the unfused engine")),
    check(T, "softcap", "any softcap >= 0 (a score_mod: softcap * tanh(score / softcap))", "softmax",
          "attn_dispatch.backends.flex_attention score_mod; " + FLEX_API + " (score_mod is applied after the scale)",
          lambda p, plat, env: None),
    common.no_return_max_logit(T, source="attn-dispatch does not read FlexAttention's max_scores"),
    check(T, "deterministic", "a deterministic backward: no bias that requires grad", "determinism",
          FLEX_LOWERING + " flex_attention_backward_grid (each dQ block and each dK/dV block written by one "
          "program); torch/_inductor/kernel/flex/common.py zeros_and_scatter lowering (scatter_mode='atomic_add' "
          "for captured buffers' gradients)", _determinism),
    check(T, "user_mods", "a user's mask_mod (b, h, q_idx, kv_idx) -> bool and score_mod (score, b, h, q_idx, "
          "kv_idx) -> score", "mask", FLEX_API + " flex_attention(score_mod=, block_mask=)", _user_mods),
    common.kv_cache(T, contiguous=False, paged=False, source="attn-dispatch scope",
                    why_not="attn-dispatch's KV-cache path does not call FlexAttention"),
    check(T, "cp_comm_type", "no context parallelism, nor its per-block calls (cp_block)", "context_parallel",
          "FlexAttention's backward is reached through autograd only: it cannot take the merged out/lse that context "
          "parallelism's per-block backward passes",
          lambda p, plat, env: None if p.cp_size <= 1 and not p.cp_block else fail(
              ("a per-block call of context parallelism" if p.cp_block else
               f"context parallelism (cp_size={p.cp_size}, {p.cp_comm_type})") + " is not supported by "
              "flex_attention:torch: its backward runs through autograd and cannot take a merged out/lse",
              "run the masked call without context parallelism, or use a mask the FlashAttention/cuDNN engines "
              "express (padding, causal, windows)")),
)


@T.note
def _new_structure_cost(p: AttentionParams, plat: Platform) -> str | None:
    if p.device_type != "cuda":
        return ("on the CPU FlexAttention runs eagerly: it materialises the [b, h, sq, skv] scores (no block "
                "skipping); the unfused engine is preferred there")
    return (f"a new mask structure costs a BlockMask build ({BLOCK_SIZE}x{BLOCK_SIZE} tiles: reductions over the mask, "
            "once per mask tensor and version, or per cu_seqlens tensor) and, for a new mask kind, grad mode, head "
            "configuration or dtype, a torch.compile of FlexAttention (seconds, once per process; new lengths "
            "recompile once, then run dynamic); a mask that changes every step pays the build every step")


# --------------------------------------------------------------------------------------------
# Provider 'flash_attn_4': the same FlexAttention call lowered to flash-attn-4's CuTe kernels
# --------------------------------------------------------------------------------------------
FLASH_LOWERING = "torch/_inductor/kernel/flex/flex_flash_attention.py (torch 2.11-2.13)"
MIN_TORCH_FLASH = "2.11"           # the first torch whose flex lowering attn-dispatch ran with BACKEND='FLASH'
FLASH_HEAD_DIMS = (64, 96, 128)    # flash-attn-4's sm90 tiles (constraints/flash_attn_4_sm90.py) attn-dispatch runs
FLASH_MEASURED = "benchmarks/results/masks/flex_flash_h200.json"
# Training: the engine's training call asks flex for no LSE. FLASH's backward cannot differentiate through one
# ('FLASH backend backward does not support differentiating through logsumexp (dLSE)', every training check of
# benchmarks/results/masks/bench_masks_h200_full_flash.json, where the engine asked for it); without it the
# experiment in FLASH_MEASURED trained (dq within 0.008 of flex's Triton kernels).

FLASH_TABLE = Table("flex_attention", "flash_attn_4",
                    "FlexAttention lowered to flash-attn-4's CuTe kernels (flex_attention kernel_options "
                    "BACKEND='FLASH'): the mask as flash-attn-4's block sparsity and mask_mod, on Hopper/Blackwell")
F = FLASH_TABLE


def flash_kind(thd: bool, mask_type: str, window: tuple, bias_type: str, softcap: bool, mask_mod: bool,
               score_mod: bool, training: bool, head_dims: tuple[int, int], dtype: str) -> tuple:
    """What a FLASH compile depends on: the key a refused compile is recorded under, by the engine and this table."""
    return ("flex_flash", thd, mask_type, tuple(window), bias_type, softcap, mask_mod, score_mod, training,
            tuple(head_dims), dtype)


def flash_kind_of(p: AttentionParams) -> tuple:
    return flash_kind(p.qkv_format == "thd", p.attn_mask_type, p.window_size or (-1, -1), p.bias_type,
                      bool(p.softcap), p.mask_mod, p.score_mod, p.is_training, (p.head_dim_qk, p.head_dim_v),
                      p.dtype)


def _flash_torch(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if plat.torch < parse_version(MIN_TORCH_FLASH):
        return fail(f"torch {plat.torch_version}: attn-dispatch runs FlexAttention's BACKEND='FLASH' from torch "
                    f"{MIN_TORCH_FLASH} (the lowering to flash-attn-4 it was measured with)",
                    f"pip install -U 'torch>={MIN_TORCH_FLASH}'")
    return None


def _flash_package(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if not plat.package("flash-attn-4").installed:
        return fail("flash-attn-4 is not installed: FlexAttention's BACKEND='FLASH' lowers to its CuTe kernels "
                    "(flash_attn.cute)", "pip install flash-attn-4")
    return None


def _flash_device(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.device_type != "cuda" or plat.device_type != "cuda":
        return fail("flash-attn-4's kernels run on CUDA only", "use flex_attention:torch (the CPU, inference)")
    if plat.sm not in (90, 100, 103):
        return fail(f"this GPU ({plat.device_name}) is sm{plat.sm}: flash-attn-4's CuTe kernels target sm90 "
                    "(Hopper) and sm100 (Blackwell)", "flex_attention:torch runs the same call (Triton, sm80+)")
    return None


def _flash_head_dims(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.head_dim_qk != p.head_dim_v or p.head_dim_qk not in FLASH_HEAD_DIMS:
        return fail(f"head_dim_qk={p.head_dim_qk}, head_dim_v={p.head_dim_v}: attn-dispatch runs FlexAttention's "
                    f"FLASH lowering with equal head dims in {FLASH_HEAD_DIMS} (flash-attn-4's sm90 tiles; others "
                    "not run)", "flex_attention:torch takes head dims 16-256")
    return None


def _flash_score_mod_grad(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if not p.is_training:
        return None
    given = [what for what, present in (("a bias", p.has_bias_tensor), ("ALiBi", p.bias_type == "alibi"),
                                         ("softcap", bool(p.softcap)), ("a user score_mod", p.score_mod)) if present]
    if given:
        return fail(f"training with {', '.join(given)} (a score_mod): FlexAttention's FLASH backward has none "
                    "(the lowering accepts only the identity score graph there)",
                    "flex_attention:torch (Triton) differentiates score_mods")
    return None


def _flash_determinism(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if deterministic_backward(p, env) and plat.sm < 100:
        return fail(f"{why_deterministic(p)} demands a deterministic backward; FlexAttention's FLASH backward with "
                    f"a block mask has one on sm100+ only (this GPU: sm{plat.sm})",
                    "flex_attention:torch (Triton) has a deterministic backward without a learnable bias")
    return None


def _flash_packed_band(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.qkv_format == "thd" and (p.is_causal or p.has_sliding_window):
        return fail(f"a packed (thd) call with attn_mask_type={p.attn_mask_type!r}"
                    + (f" and window_size={tuple(p.window_size)}" if p.has_sliding_window else "")
                    + ": FlexAttention's FLASH lowering does not compile the per-sequence band from int64 positions, "
                    "and with int32 ones it crashed the process (an illegal memory access) once other packs had run",
                    "flash_attn_4:cute and cudnn_fused run packed bands natively; flex_attention:torch runs it too")
    return None


def _flash_refused(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    message = plat.facts.rejections.get(flash_kind_of(p)) if plat.facts.rejections else None
    if message:
        return fail(f"torch.compile refused this kind of call with BACKEND='FLASH' in this process: {message}",
                    "flex_attention:torch runs it")
    return None


F.add(
    check(F, "torch_version", f"torch >= {MIN_TORCH_FLASH} (flex_attention kernel_options BACKEND='FLASH')",
          "package", FLASH_LOWERING + " _use_flex_flash_attention; run on torch 2.11.0+cu130: " + FLASH_MEASURED,
          _flash_torch),
    common.loads(F),
    check(F, "package", "flash-attn-4 installed (flash_attn.cute)", "package",
          FLASH_LOWERING + " ensure_flash_available: 'CUTE flash attention library is not available'",
          _flash_package),
    check(F, "device", "CUDA sm90 or sm100", "platform", "flash-attn-4's README (Hopper and Blackwell)",
          _flash_device),
    common.dtypes(F, ("float16", "bfloat16"), source="flash-attn-4's CuTe kernels take fp16/bf16"),
    common.no_fp8(F, source="FlexAttention's FLASH lowering takes the inputs' fp16/bf16"),
    check(F, "head_dim", f"head_dim_qk == head_dim_v in {FLASH_HEAD_DIMS}", "head_dim",
          "attn_dispatch.constraints.flash_attn_4_sm90 (flash-attn-4's sm90 tile choices by head dim)",
          _flash_head_dims),
    common.formats(F, ("bshd", "sbhd", "thd"),
                   source="attn_dispatch.backends.flex_attention (as flex_attention:torch)"),
    common.masks(F, ("no_mask", "padding", "causal", "causal_bottom_right", "padding_causal",
                     "padding_causal_bottom_right", "arbitrary"),
                 source="attn_dispatch.backends.flex_attention (as flex_attention:torch): a BlockMask with full "
                        "blocks, which the FLASH lowering requires"),
    common.bias_types(F, ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi"),
                      source="attn_dispatch.backends.flex_attention score_mod (inference; see score_mod_grad)"),
    check(F, "score_mod_grad", "training: no score_mod (bias, ALiBi, softcap, a user's)", "bias",
          FLASH_LOWERING + " is_trivial_score_graph ('Backwards currently doesn't support score_mods'); "
          "_can_use_flex_flash_attention ('Input buffers require gradients (not supported by flash attention)')",
          _flash_score_mod_grad),
    common.no_dropout(F, source=FLEX_API + " flex_attention has no dropout argument"),
    check(F, "softmax_type", "softmax_type vanilla (no sink)", "softmax", FLEX_API + " (no sink term)",
          lambda p, plat, env: None if p.softmax_type == "vanilla" else fail(
              f"softmax_type={p.softmax_type!r}: FlexAttention's softmax has no sink term",
              "use flash_attn_4:cute or cudnn_fused (sinks)")),
    check(F, "softcap", "softcap in inference (a score_mod)", "softmax",
          "attn_dispatch.backends.flex_attention score_mod", lambda p, plat, env: None),
    common.no_return_max_logit(F, source="attn-dispatch does not read FlexAttention's max_scores"),
    check(F, "deterministic", "a deterministic backward: sm100+", "determinism",
          FLASH_LOWERING + " ('Deterministic backward for flex_attention with block_mask and BACKEND=FLASH requires "
          "SM100+')", _flash_determinism),
    check(F, "user_mods", "a user's mask_mod; a user's score_mod in inference", "mask",
          FLEX_API + " flex_attention(score_mod=, block_mask=)", _user_mods),
    common.kv_cache(F, contiguous=False, paged=False, source="attn-dispatch scope",
                    why_not="attn-dispatch's KV-cache path does not call FlexAttention"),
    check(F, "cp_comm_type", "no context parallelism, nor its per-block calls (cp_block)", "context_parallel",
          "as flex_attention:torch: its backward runs through autograd",
          lambda p, plat, env: None if p.cp_size <= 1 and not p.cp_block else fail(
              "context parallelism is not supported by flex_attention:flash_attn_4: its backward runs through "
              "autograd and cannot take a merged out/lse", "run the masked call without context parallelism")),
    check(F, "packed_band", "a packed (thd) call: no causal mask, no window", "mask",
          "run on the H200 (torch 2.11.0+cu130, flash-attn-4 4.0.0b36): with the pack's int64 positions the CuTe DSL "
          "refused the band ('Type mismatch, store Int64 to Tensor with element type Int32', "
          "benchmarks/results/held_out/eval_blind_packed_11_h200_full_flex_rerun.json.gz); with int32 positions it "
          "compiled and matched float32 alone, then a bench process died with 'an illegal memory access' on the "
          "tenth pack (benchmarks/results/held_out/eval_blind_packed_12_h200_full.json.gz), twice, and not without "
          "this engine", _flash_packed_band),
    check(F, "compile_refused", "torch.compile accepted this kind of call with BACKEND='FLASH'", "platform",
          "observed at run time (the engine records a refused compile)", _flash_refused),
)

F.note(_new_structure_cost)

# flash-attn-4's lowering first: on the H200 it ran a prefix-LM bool mask (S=8k) 1.69x faster than flex's Triton
# kernels forward, and a document mask (S=16k) within 1.1x (FLASH_MEASURED)
TABLES = [FLASH_TABLE, TABLE]


def refuse_user_mods(table: Table) -> Check:
    """A user's mask_mod / score_mod run only in FlexAttention; the registry adds this refusal to every other table."""
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        given = [name for name in ("mask_mod", "score_mod") if getattr(p, name)]
        if given:
            return fail(f"a user {' and '.join(given)} is given: {table.id} cannot run a Python modifier",
                        "flex_attention:torch runs it (CUDA; the CPU in inference)")
        return None
    return check(table, "user_mods", "no user mask_mod / score_mod (FlexAttention's)", "mask",
                 "attn-dispatch scope: only flex_attention:torch takes FlexAttention's modifiers", fn)
