"""FlashAttention-3 (hopper/, `flash_attn_interface`): Hopper only. From its documentation; the engine is untested.

FlashAttention-3 cannot be installed on the project's machines (no wheel; a source build outlasts a GPU lease),
so every fact here comes from hopper/flash_api.cpp, hopper/flash_attn_interface.py, the README's
'FlashAttention-3 beta release' section and Transformer Engine's rules, and every verdict says so.
"""
from __future__ import annotations

from ..env import EnvFlags
from ..params import AttentionParams
from ..platform import Platform
from . import common
from .base import Failure, Table, fail
from .flash_common import CP, MASKS, TE_UTILS, check, gqa, no_padding_between_sequences, top_left_alignment

FA3_API = "flash-attention hopper/flash_api.cpp (mha_fwd, mha_bwd)"
FA3_README = "flash-attention README.md 'FlashAttention-3 beta release' (H100/H800, CUDA >= 12.3)"

INTERFACE_TABLE = Table("flash_attn_3", "interface",
                        "FlashAttention-3 for Hopper (flash_attn_interface); untested: written from its documentation")
T = INTERFACE_TABLE


def _fp8(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.fp8 or p.dtype == "fp8":
        return fail("FlashAttention-3 has an FP8 (e4m3) forward for inference, but attn-dispatch does not implement "
                    "FP8 attention", "run attention in bf16/fp16")
    return None


def _head_dims(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    """hopper/flash_api.cpp: head dims <= 256 (d_v up to 512 in forward with d_qk <= 64), multiples of 8; unequal
    pairs only as Transformer Engine's _is_fa3_supported lists them; backward needs max(d_qk, d_v) <= 256."""
    d, dv = p.head_dim_qk, p.head_dim_v
    problems = [f"{name}={x} is not a multiple of 8" for name, x in (("head_dim_qk", d), ("head_dim_v", dv)) if x % 8]
    if d > 256:
        problems.append(f"head_dim_qk={d} > 256")
    if d != dv and not ((128 < d <= 192 and 96 < dv <= 128) or (d <= 64 and dv <= 512)):
        problems.append(f"(head_dim_qk, head_dim_v)=({d}, {dv}): unequal head dims need 128 < d_qk <= 192 with "
                        "96 < d_v <= 128, or d_qk <= 64 with d_v <= 512")
    elif dv > 256 and p.is_training:
        problems.append(f"head_dim_v={dv} > 256 has no backward (mha_bwd: max(d_qk, d_v) <= 256)")
    if problems:
        return fail("flash_attn_3:interface head dims: " + "; ".join(problems))
    return None


T.add(
    common.env_enabled(T),
    common.on_cuda(T, min_sm=90, max_sm=90, why="(Hopper)",
                   source=FA3_README + "; " + TE_UTILS + " (compute capability != (9, 0) disables FA3)"),
    common.package(T, "flash-attn-3", minimum="3.0.0b1",
                   source=TE_UTILS + " (flash-attn-3 3.0.0 betas, module flash_attn_interface)"),
    common.loads(T),
    common.dtypes(T, ("float16", "bfloat16"), source=FA3_API + " (fp16, bf16; fp8 e4m3 forward only)"),
    check(T, "fp8", "no FP8 (not implemented in attn-dispatch)", "dtype", FA3_API, _fp8),
    check(T, "head_dim", "head dims <= 256, multiples of 8; unequal only (128-192, 96-128] or (<= 64, <= 512 fwd)",
          "head_dim", FA3_API + "; " + TE_UTILS + " _is_fa3_supported", _head_dims),
    gqa(T),
    common.formats(T, ("bshd", "sbhd", "thd"), source="flash_attn_func (bshd) and flash_attn_varlen_func (thd)"),
    common.masks(T, MASKS, source=FA3_API + " (is_causal, window sizes, cu_seqlens; no mask tensor)"),
    top_left_alignment(T, source=FA3_API + " (causal aligned bottom-right, as FA2 >= 2.1); " + TE_UTILS),
    no_padding_between_sequences(T),
    common.bias_types(T, ("no_bias",), source=TE_UTILS + " (ALiBi disables FA3); " + FA3_API + " has no ALiBi"),
    common.no_dropout(T, source=FA3_API + " hardcodes p_dropout = 0; " + TE_UTILS + " (dropout disables FA3)"),
    common.softmax_types(T, ("vanilla",),
                         source=TE_UTILS + " (softmax_type other than vanilla disables FlashAttention)"),
    common.no_return_max_logit(T, source=TE_UTILS + " (return_max_logit disables FlashAttention)"),
    common.kv_cache(T, contiguous=False, paged=False, source=common.TE_KV_FILTER + " (FA3 takes both)",
                    why_not="FA3's flash_attn_with_kvcache is not wired up in attn-dispatch"),
    common.cp_comm_types(T, ("p2p", "all_gather", "a2a", "a2a+p2p"), source=CP),
)


@T.note
def _untested(p: AttentionParams, plat: Platform) -> str | None:
    return ("flash_attn_3:interface is untested: FlashAttention-3 cannot be installed on the project's machines; "
            "the engine follows hopper/flash_attn_interface.py and this table its documentation")


TABLES = [INTERFACE_TABLE]
