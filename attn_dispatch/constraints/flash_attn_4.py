"""flash-attn-4 (`flash_attn.cute`, CuTe DSL): Hopper sm90 and datacenter Blackwell sm100/sm103/sm110.

Facts from flash-attn-4 4.0.0b36's flash_attn/cute/interface.py (the release the engine is written against and
runs on the project's H100), unless a check says otherwise.
"""
from __future__ import annotations


from ..env import EnvFlags
from ..params import AttentionParams
from ..platform import parse_version, Platform
from . import common, kv_decode
from . import flash_attn_4_sm90 as sm90
from .base import Failure, Table, fail
from .flash_common import CP, MASKS, check, gqa, no_padding_between_sequences, top_left_alignment

FA4_IFACE = "flash-attn-4 4.0.0b36 flash_attn/cute/interface.py"
MINIMUM = "4.0.0b36"  # the engine calls its internal API: _flash_attn_fwd's 5 results, _flash_attn_bwd(learnable_sink=)
TESTED = "4.0.0b36"

CUTE_TABLE = Table("flash_attn_4", "cute",
                   "flash-attn-4 CuTe DSL kernels (flash_attn.cute), called directly; JIT-compiled per configuration")
T = CUTE_TABLE


def _package(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    """Like common.package, but pre-releases count: the internal API changes between 4.0.0 betas."""
    status = plat.package("flash-attn-4")
    if not status.installed:
        return fail(f"flash-attn-4 is not available: {status.error or 'not installed'}",
                    f"pip install 'flash-attn-4[cu13]=={TESTED}' (or [cu12])")
    version = plat.package_version("flash-attn-4")
    if version is None:
        return None  # an unparsable version: the import check decides
    if version < parse_version(MINIMUM):
        return fail(f"flash-attn-4 {status.version} is installed; flash_attn_4:cute calls the internal API of "
                    f"{MINIMUM} and later (_flash_attn_fwd returning 5 values, _flash_attn_bwd taking learnable_sink)",
                    f"pip install -U 'flash-attn-4=={TESTED}'")
    if version > parse_version(TESTED) and not env.allow_untested_versions:
        return fail(f"flash-attn-4 {status.version} is newer than the release tested here ({TESTED}); its internal "
                    "API changes between betas, so it is not used unless allowed",
                    f"set ATTN_DISPATCH_ALLOW_UNTESTED_VERSIONS=1 to use it anyway, or pip install "
                    f"'flash-attn-4=={TESTED}'")
    return None


def _fp8(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.fp8 or p.dtype == "fp8":
        return fail("flash-attn-4 has an FP8 forward on sm100 only (no backward), and attn-dispatch does not "
                    "implement FP8 attention", "run attention in bf16/fp16")
    return None


def _head_dims(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    """_validate_head_dims: sm90 any pair in [8, 256]; sm100/sm110 both <= 128, or (192, 128), or (256, 256)."""
    d, dv = p.head_dim_qk, p.head_dim_v
    problems = [f"{name}={x} is not a multiple of 8" for name, x in (("head_dim_qk", d), ("head_dim_v", dv)) if x % 8]
    if plat.sm // 10 in (10, 11):
        if not ((d <= 128 and dv <= 128) or (d, dv) in ((192, 128), (256, 256))):
            problems.append(f"(head_dim_qk, head_dim_v)=({d}, {dv}) on sm{plat.sm}: it takes both <= 128, or "
                            "(192, 128), or (256, 256)")
    elif d > 256 or dv > 256:
        problems.append(f"(head_dim_qk, head_dim_v)=({d}, {dv}): both must be <= 256")
    if problems:
        return fail("flash_attn_4:cute head dims: " + "; ".join(problems))
    return None


def _dims_in_range(p: AttentionParams) -> bool:
    """Head dims the sm90 kernels take at all (the head_dim check reports the others)."""
    return all(8 <= d <= 256 and d % 8 == 0 for d in (p.head_dim_qk, p.head_dim_v))


def _sm90_forward(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if plat.sm // 10 != 9 or not _dims_in_range(p):
        return None
    problem = sm90.forward_problem(p.head_dim_qk, p.head_dim_v, p.window_size)
    return fail(*problem) if problem else None


def _sm90_backward(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if plat.sm // 10 != 9 or not p.is_training or not _dims_in_range(p):
        return None
    problem = sm90.backward_problem(p.head_dim_qk, p.head_dim_v, p.window_size, p.gqa_ratio)
    return fail(*problem) if problem else None


def key_tile(head_dim: int, head_dim_v: int, window: tuple[int, int], sm_major: int) -> int:
    """The forward's key tile (tile_n): sm90 interface._tile_size_fwd_sm90; sm100/sm110 128
    (interface._get_fwd_config; its retile of unequal head dims under split-KV aside)."""
    if sm_major == 9 and all(8 <= d <= 256 for d in (head_dim, head_dim_v)):
        return sm90.fwd_tile(head_dim, head_dim_v, *sm90.masking(tuple(window)))[1]
    return 128


def paged_loader_problem(page_size: int, head_dim: int, head_dim_v: int, window: tuple[int, int],
                         sm_major: int) -> str | None:
    """Why flash-attn-4 cannot load a paged cache of this page size (pages that are not one key tile load row by
    row, which needs head dims that are multiples of 16), or None. Shared by the table and the engine."""
    tile = key_tile(head_dim, head_dim_v, window, sm_major)
    odd = [f"{name}={d}" for name, d in (("head_dim_qk", head_dim), ("head_dim_v", head_dim_v)) if d % 16]
    if page_size == tile or not odd:
        return None
    return (f"page_size={page_size} is not flash-attn-4's key tile ({tile}), so its pages load row by row, which "
            f"needs head dims that are multiples of 16 ({', '.join(odd)}): 'Paged KV does not support irregular "
            "head dim'")


def _paged_loader(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if not (p.inference_kv_cache and p.kv_cache_paged and p.kv_page_size):
        return None
    problem = paged_loader_problem(p.kv_page_size, p.head_dim_qk, p.head_dim_v, p.window_size, plat.sm // 10)
    if problem is None:
        return None
    tile = key_tile(p.head_dim_qk, p.head_dim_v, p.window_size, plat.sm // 10)
    return fail(problem, f"InferenceParams(page_size={tile}), a contiguous cache, or head dims that are multiples "
                         "of 16")


def _softcap(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    """interface.py _flash_attn_fwd(softcap=) and _flash_attn_bwd(softcap) turn it into a score_mod pair
    (utils.create_softcap_scoremod / _bwd) that the sm90 and sm100/sm110 kernels apply after the softmax scale; the
    dedicated sm100 hd256 backward asserts softcap == 0."""
    if p.softcap and p.inference_kv_cache:
        return fail(f"softcap={p.softcap:g} with a KV cache: attn-dispatch's flash-attn-4 KV-cache path "
                    "(forward_kv_cache) does not pass softcap yet", "use the unfused engine for soft-capped decoding")
    if (p.softcap and p.is_training and plat.sm // 10 in (10, 11)
            and (p.head_dim_qk, p.head_dim_v) == (256, 256)):
        return fail(f"softcap={p.softcap:g} training with head dims (256, 256) on sm{plat.sm}: flash-attn-4's "
                    "dedicated hd256 backward has no soft-capping", "use head dims <= 128, or run inference")
    return None


def _sink_backward(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if (p.softmax_type != "vanilla" and p.is_training and plat.sm // 10 in (10, 11)
            and (p.head_dim_qk, p.head_dim_v) == (256, 256)):
        return fail(f"softmax_type={p.softmax_type!r} training with head dims (256, 256) on sm{plat.sm}: the dedicated "
                    "hd256 backward has no learnable sink", "use head dims <= 128, or run inference")
    return None


T.add(
    common.env_enabled(T),
    common.on_cuda(T, min_sm=90, max_sm=110, why="(Hopper sm90, Blackwell sm100/sm103/sm110)",
                   source=FA4_IFACE + " (_validate_head_dims and the backward dispatch cover 9.x, 10.x, 11.x; "
                   "sm80 has no backward, sm120 no deterministic backward: not used)"),
    check(T, "package", f"flash-attn-4 >= {MINIMUM}, tested {TESTED} (newer betas need "
          "ATTN_DISPATCH_ALLOW_UNTESTED_VERSIONS=1)", "package", FA4_IFACE + " (internal API the engine calls)",
          _package),
    common.loads(T),
    common.dtypes(T, ("float16", "bfloat16"), source=FA4_IFACE + " _flash_attn_bwd: 'inputs must be float16 or "
                  "bfloat16'"),
    check(T, "fp8", "no FP8 (not implemented in attn-dispatch)", "dtype", FA4_IFACE, _fp8),
    check(T, "head_dim", "multiples of 8; sm90: both <= 256; sm100/sm110: both <= 128, (192, 128) or (256, 256)",
          "head_dim", FA4_IFACE + " _validate_head_dims", _head_dims),
    check(T, "sm90_forward_smem", "sm90: the forward tile for (head_dim_qk, head_dim_v) fits in 227 KiB of shared "
          "memory, its output tile included (both <= 128, equal dims, and most unequal pairs do)", "head_dim",
          sm90.SOURCE, _sm90_forward),
    check(T, "sm90_backward", "sm90 training: head_dim_qk <= 128 padded alike to 16 and 32 (not 8-16, 40-48, 72-80, "
          "104-112: wrong dQ); a buildable (head_dim_qk, head_dim_v) layout (dO swizzle, swapped dK/dV M axis) whose "
          "backward tile fits in 227 KiB of shared memory (every equal pair does; (64, 128) and (128, 256) do not); "
          "GQA/MQA with head_dim_qk == head_dim_v", "head_dim",
          sm90.SOURCE + "; flash_bwd_sm90.py FlashAttentionBackwardSm90 (hdim_multiple_of 16 vs the interface's 32: "
          "flash-attention PR #2896; GQA assert; _setup_attributes/_get_tiled_mma layouts); launch failure observed "
          "on H100 for (64, 128): 'Allocated: 248832 bytes. Max: 232448 bytes.'", _sm90_backward),
    gqa(T),
    common.formats(T, ("bshd", "sbhd", "thd"),
                   source=FA4_IFACE + " (bshd with any strides but the last; thd via cu_seqlens_q/k)"),
    common.masks(T, MASKS, source=FA4_IFACE + " (causal, window sizes, cu_seqlens; no mask tensor)"),
    top_left_alignment(T, source="flash-attn-4 4.0.0b36 mask.py (causal_row_offset = seqlen_k - seqlen_q: "
                       "bottom-right)"),
    no_padding_between_sequences(T),
    common.bias_types(T, ("no_bias",), source=FA4_IFACE + " (no ALiBi, no bias tensor)"),
    common.no_dropout(T, source=FA4_IFACE + " (no dropout argument)"),
    common.softmax_types(T, ("vanilla", "off-by-one", "learnable"),
                         source=FA4_IFACE + " learnable_sink [h] (softmax.py apply_learnable_sink; dsink in backward)"),
    check(T, "softcap", "logit soft-capping (Gemma 2) forward and backward; not with a KV cache (not wired there), "
          "nor training with head dims (256, 256) on sm100/sm110", "softmax",
          FA4_IFACE + " _flash_attn_fwd(softcap=) L855/L1102-1104 and _flash_attn_bwd(softcap) L2579-2584 "
          "(score_mod pair from utils.create_softcap_scoremod[_bwd], applied after softmax_scale: "
          "utils.compute_softmax_scale_log2), passed to FlashAttentionBackwardSm90/Sm100; L2958 'SM100 backward "
          "with head_dim=256 does not support softcap'", _softcap),
    check(T, "sink_backward", "a sink with head dims (256, 256) on sm100/sm110: inference only", "softmax",
          FA4_IFACE + " _flash_attn_bwd: 'SM100 backward with head_dim=256 does not support learnable_sink'",
          _sink_backward),
    common.no_return_max_logit(T, source=FA4_IFACE + " (no max logit output)"),
    common.kv_cache(T, contiguous=True, paged=True,
                    source=FA4_IFACE + " _flash_attn_fwd: seqused_k [b] with k/v [b, s_k, h_k, d] (a contiguous cache "
                    "read in place), or page_table [b, pages] int32 with a (num_pages, page_size, h_k, d) pool; "
                    "'page_table is not supported with cu_seqlens_k'. (Transformer Engine does not run flash-attn-4 "
                    "with a KV cache: " + common.TE_KV_FILTER + ")"),
    check(T, "kv_cache_page_loader", "a paged KV cache whose page_size is not the forward's key tile (128 for head "
          "dims <= 128) is loaded row by row: both head dims multiples of 16", "inference",
          FA4_IFACE + " (paged_kv_non_tma=page_size not in [None, tile_n]); flash_fwd_sm90.py / flash_fwd_sm100.py "
          "__init__: 'Paged KV does not support irregular head dim' (flash_fwd.py pads head dims to 16)",
          _paged_loader),
    common.cp_comm_types(T, ("p2p", "all_gather", "a2a", "a2a+p2p"), source=CP),
)


@T.note
def _jit(p: AttentionParams, plat: Platform) -> str | None:
    if plat.package("flash-attn-4").installed:
        return ("flash-attn-4 JIT-compiles each new kernel configuration (dtype, head dims, GQA ratio, causal/window, "
                "varlen, sink) on first use, ~2-3 s for the forward and again for the backward, then caches it "
                "in-process; `import flash_attn.cute` itself takes ~10 s on the engine's first use")
    return None


@T.note
def _torch_registration(p: AttentionParams, plat: Platform) -> str | None:
    if plat.package("flash-attn-4").installed and plat.torch >= parse_version("2.11"):
        return ("called through flash_attn.cute directly: torch 2.11's own FA4 registration "
                "(torch.nn.attention.activate_flash_attention_impl('FA4')) fails with flash-attn-4 4.0.0b36 "
                "('too many values to unpack': _flash_attn_fwd returns 5 values)")
    return None


@T.note
def _determinism(p: AttentionParams, plat: Platform) -> str | None:
    if p.is_training and p.deterministic:
        return ("deterministic backward: flash-attn-4 4.0.0b36 serialises dQ (and GQA dK/dV) accumulation with "
                "semaphores on sm90 and sm100/sm110 (earlier releases: sm100/sm110 only)")
    return None


@T.note
def _kv_decode(p: AttentionParams, plat: Platform) -> str | None:
    return kv_decode.note(T.id, p, plat, kv_decode.FA4_SOURCE)


TABLES = [CUTE_TABLE]
