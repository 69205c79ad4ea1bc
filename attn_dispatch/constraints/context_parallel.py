"""What attn-dispatch's context parallelism supports, per comm type, and which plain calls it makes per block.

Two questions decide whether engines can serve a context-parallel call, answered in two places:
1. does our CP implementation support the call's features under its comm type? `params_failures`, which every
   engine table asks through its `<family>.cp_support` check (constraints/common.py);
2. can an engine run the per-block calls? `block_params` declares them (plain calls: cp_size 1, vanilla softmax,
   no bias or dropout); selection evaluates each engine's own table on them and composes (selection.py), and
   the CP code picks each block's engine through selection.select on those same params.
Nothing here imports selection or torch.

Transformer Engine's rules differ (it has no learnable sinks under p2p or all_gather, no unfused CP, and sliding
windows only with all_gather and a2a); this table says what attn-dispatch does, and cites TE where it agrees.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cp_bands import chunk_bands, gathered_band, key_exchange

SOURCE = "attn_dispatch.context_parallel (our implementation; constraints/context_parallel.py)"
TE_CP = ("Transformer Engine (commit d0067d0) pytorch/attention/dot_product_attention/context_parallel.py "
         "attn_forward_func_with_cp: 'Context parallelism does not support sliding window attention with "
         "cp_comm_type' other than a2a and all_gather; AttnFuncWithCPAndKVAllGather slices K/V per chunk "
         "(get_kv_seq_info_after_all_gather); utils.py get_attention_backend disables FusedAttention for sliding "
         "windows with p2p and a2a+p2p")
WINDOW_SOURCE = (TE_CP + ". attn-dispatch also runs windows under p2p and a2a+p2p (bshd/sbhd): each (query chunk, "
                 "key chunk) pair becomes one trimmed band call (constraints/cp_bands.py), blocks outside the "
                 "window are skipped and the ring stops after the last step any rank needs; a window within the "
                 "neighbouring chunks fetches only its keys under p2p and a2a too (cp_bands.key_exchange)")
COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
_BSHD_MASKS = ("no_mask", "causal")
_THD_MASKS = ("padding", "padding_causal", "no_mask", "causal")  # thd masks are per sequence either way
UNBOUNDED = -1


@dataclass(frozen=True)
class CommTypeSupport:
    comm_type: str
    formats: tuple[str, ...]
    masks: dict[str, tuple[str, ...]]  # per format
    window_formats: tuple[str, ...] = ()  # formats that take a sliding window under this comm type
    bias_types: tuple[str, ...] = ("no_bias",)
    dropout: bool = False
    softmax_types: tuple[str, ...] = SOFTMAX_TYPES
    return_max_logit: bool = False
    cross_attention: str = "no_mask only (local q and kv lengths may differ), no window"
    heads_divisible_by_group: bool = False
    groups: int = 1
    engine_block_masks: tuple[str, ...] = ()  # what the engine is called with
    notes: str = ""


SUPPORT: dict[str, CommTypeSupport] = {
    "p2p": CommTypeSupport(
        "p2p", ("bshd", "sbhd", "thd"), {"bshd": _BSHD_MASKS, "sbhd": _BSHD_MASKS, "thd": _THD_MASKS},
        window_formats=("bshd", "sbhd"),
        engine_block_masks=("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal"),
        notes="ring of batched isend/irecv (K and V in one buffer) from a separate stream; causal and windows need "
              "the load-balanced layout; blocks outside the window or fully masked are skipped; sink merged once; "
              "a window within the neighbouring chunks: only its keys are fetched, as under all_gather"),
    "all_gather": CommTypeSupport(
        "all_gather", ("bshd", "sbhd"), {"bshd": _BSHD_MASKS, "sbhd": _BSHD_MASKS},
        window_formats=("bshd", "sbhd"),
        engine_block_masks=("no_mask", "causal", "causal_bottom_right"),
        notes="thd is not supported; causal: square causal diagonal chunks plus unmasked key prefixes, merged with "
              "the lse; a window: each query chunk fetches only the keys it sees (point-to-point) and runs one "
              "trimmed band call"),
    "a2a": CommTypeSupport(
        "a2a", ("bshd", "sbhd", "thd"), {"bshd": _BSHD_MASKS, "sbhd": _BSHD_MASKS, "thd": _THD_MASKS},
        window_formats=("bshd", "sbhd", "thd"),
        cross_attention="no (local q and kv lengths must be equal)", heads_divisible_by_group=True,
        engine_block_masks=("no_mask", "causal", "padding", "padding_causal"),
        notes="num_heads and num_gqa_groups divisible by cp_size; the engine sees whole sequences (a window as is); "
              "bshd/sbhd under a window within the neighbouring chunks: only its keys are fetched, as under "
              "all_gather (no all-to-all)"),
    "a2a+p2p": CommTypeSupport(
        "a2a+p2p", ("bshd", "sbhd", "thd"), {"bshd": _BSHD_MASKS, "sbhd": _BSHD_MASKS, "thd": _THD_MASKS},
        window_formats=("bshd", "sbhd"),
        cross_attention="no (local q and kv lengths must be equal)", heads_divisible_by_group=True, groups=2,
        engine_block_masks=("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal"),
        notes="cp_group = [a2a_group, p2p_group]; heads divisible by the a2a group size (AttentionParams."
              "cp_a2a_size); layout rank = p2p_rank * a2a_size + a2a_rank"),
}


def is_windowed(mask_type: str, window_size) -> bool:
    plain = (UNBOUNDED, 0) if "causal" in mask_type else (UNBOUNDED, UNBOUNDED)
    return window_size is not None and tuple(window_size) not in (plain, (UNBOUNDED, UNBOUNDED))


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
    if is_windowed(mask_type, window_size) and qkv_format not in s.window_formats:
        takes = [c for c, t in SUPPORT.items() if qkv_format in t.window_formats]
        out.append(f"window_size={tuple(window_size)!r}: sliding windows with qkv_format={qkv_format!r} are not "
                   f"supported under cp_comm_type={comm_type!r}; use cp_comm_type=" + " or ".join(map(repr, takes)))
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
    """(code suffix, message, fix) for an AttentionParams with cp_size > 1; empty when our CP supports it."""
    if p.cp_size <= 1:
        return []
    failures = [("cp_feature", m, None) for m in unsupported_features(
        p.cp_comm_type, p.qkv_format, p.attn_mask_type, p.window_size, p.bias_type,
        p.dropout if p.is_training else 0.0, p.softmax_type, p.return_max_logit)]
    if p.alibi_slopes_shape is not None and p.bias_type != "alibi":
        failures.append(("cp_feature", "ALiBi is not supported under context parallelism", None))
    if p.inference_kv_cache:
        failures.append(("cp_kv_cache", "context parallelism with a KV cache is not supported (nor in Transformer "
                         "Engine)", None))
    if p.pad_between_seqs:
        failures.append(("cp_padding", "thd with padding between sequences is not supported under context "
                         "parallelism", "pack the sequences without gaps"))
    if SUPPORT.get(p.cp_comm_type, SUPPORT["p2p"]).heads_divisible_by_group:
        group = p.a2a_size
        if p.num_heads % group or p.num_gqa_groups % group:
            failures.append(("cp_heads", f"cp_comm_type={p.cp_comm_type!r} splits heads across {group} ranks: "
                             f"num_heads={p.num_heads} and num_gqa_groups={p.num_gqa_groups} must be divisible by "
                             f"{group}", "use cp_comm_type='p2p'"))
    if (p.is_causal or p.has_sliding_window or p.qkv_format == "thd") and (p.max_seqlen_q % 2 or p.max_seqlen_kv % 2):
        # context_parallel.api checks the same on the tensors; the per-block calls (block_params) halve these lengths
        failures.append(("cp_seqlen_even", f"local max_seqlen_q={p.max_seqlen_q} / max_seqlen_kv={p.max_seqlen_kv}: "
                         "with a causal mask, a window or thd each rank holds two equal chunks of every sequence (the "
                         "sequence cut in 2*cp_size chunks), so local lengths must be even",
                         f"pad the sequences to a multiple of 2*cp_size={2 * p.cp_size}"))
    if p.is_causal and p.max_seqlen_q != p.max_seqlen_kv:
        failures.append(("cp_causal_cross", f"a causal mask under context parallelism needs self-attention; "
                         f"max_seqlen_q={p.max_seqlen_q} != max_seqlen_kv={p.max_seqlen_kv}", None))
    elif p.has_sliding_window and p.max_seqlen_q != p.max_seqlen_kv:
        failures.append(("cp_window_cross", f"a sliding window under context parallelism needs self-attention; "
                         f"max_seqlen_q={p.max_seqlen_q} != max_seqlen_kv={p.max_seqlen_kv}", None))
    return failures


FP8_COMM_TYPES = ("a2a",)
FP8_SOURCE = ("attn_dispatch.context_parallel.fp8_a2a (our implementation); Transformer Engine (commit d0067d0) "
              "context_parallel.py AttnFuncWithCPAndQKVOA2A quantizes q, k, v before the all-to-all and sends FP8; "
              "backends.py: 'Amax reduction across TP+CP group is necessary when using context parallelism with FP8'")
FP8_RING_REASON = ("the per-step backward of a ring or gathered key range runs on the merged output and log-sum-exp, "
                   "while cudnn_fused:fp8's backward runs on the FP8 O and softmax stats its own forward saved "
                   "(Transformer Engine re-quantizes the merged O for each step; attn-dispatch does not)")
TE_CP_FP8_THD = ("Transformer Engine utils.py get_attention_backend: 'Disabling FusedAttention as it does not support "
                 "context parallelism with FP8 attention and THD format'")


def fp8_failures(p) -> list[tuple[str, str, str | None]]:
    """Why this implementation cannot run an FP8 call (p.fp8) under p.cp_comm_type; empty when it can (or with no
    context parallelism). The FP8 table asks (its `cudnn_fused.fp8_context_parallel` check); the other tables refuse
    FP8 calls of their own accord.
    FP8 runs under 'a2a' only: each rank then makes one whole-sequence FP8 call for its heads, so the FP8 engine's
    own forward and backward pair up as on one GPU (context_parallel/fp8_a2a.py)."""
    out = []
    if p.cp_size <= 1 or not p.fp8:
        return out
    if p.cp_comm_type not in FP8_COMM_TYPES:
        out.append(("cp_fp8_comm_type", f"FP8 attention under cp_comm_type={p.cp_comm_type!r} is not implemented in "
                    f"attn-dispatch: {FP8_RING_REASON}",
                    "use cp_comm_type='a2a' (each rank runs whole-sequence FP8 calls for num_heads / cp_size heads), "
                    "or run attention in bf16 (recipe fp8_dpa=False)"))
    if p.qkv_format == "thd":
        out.append(("cp_fp8_thd", "FP8 attention with qkv_format='thd' under context parallelism is not supported "
                    "(nor in Transformer Engine)", "use bshd/sbhd, or bf16 attention for packed sequences"))
    if p.fp8_output:
        out.append(("cp_fp8_output", "an FP8 output (fp8_output=True / recipe fp8_mha=True) under context "
                    "parallelism is not implemented in attn-dispatch", "return bf16 outputs (fp8_output=False)"))
    return out


def block_params(p) -> list:
    """The plain (cp_size=1) calls the engines will receive for this CP call, as AttentionParams (distinct ones).

    Convention: under CP, p.max_seqlen_q / max_seqlen_kv are the LOCAL lengths (tokens on this rank) and p is
    for one rank of p.cp_size; a2a+p2p splits heads over p.a2a_size ranks."""
    plain = dict(cp_size=1, cp_block=True, cp_comm_type="p2p", cp_a2a_size=None, softmax_type="vanilla",
                 return_max_logit=False, dropout=0.0, bias_type="no_bias", bias_shape=None, alibi_slopes_shape=None)
    sq, skv, size, thd = p.max_seqlen_q, p.max_seqlen_kv, p.cp_size, p.qkv_format == "thd"
    full_mask = "padding" if thd else "no_mask"
    diag_mask = "padding_causal" if thd else "causal"
    windowed = p.has_sliding_window

    def blk(q, kv, mask, window=None, **kw):
        if window is None:
            window = (-1, 0) if "causal" in mask else (-1, -1)
        return p.replace(max_seqlen_q=q, max_seqlen_kv=kv, attn_mask_type=mask, window_size=window, **plain, **kw)

    def from_band(b, **kw):
        return blk(b.q_len, b.k_len, b.mask, b.window, **kw)

    def ring(q_len, kv_len, ranks, **kw):
        if windowed:
            chunk = q_len // 2
            seen = {}
            for rank in range(ranks):
                for src in range(ranks):
                    for _, _, b in chunk_bands(ranks, rank, src, chunk, p.window_size):
                        seen.setdefault((b.q_len, b.k_len, b.mask, b.window), from_band(b, **kw))
            return list(seen.values())
        if not p.is_causal:
            return [blk(q_len, kv_len, full_mask, **kw)]
        return [blk(q_len, kv_len, diag_mask, **kw), blk(q_len, kv_len // 2, full_mask, **kw),
                blk(q_len // 2, kv_len, full_mask, **kw)]

    half = sq // 2
    if windowed and key_exchange(p.cp_comm_type, p.qkv_format, half, p.window_size, p.fp8):
        seen = {}  # each query chunk fetches the keys its window reaches: one band call per chunk
        for chunk_index in range(2 * size):
            hit = gathered_band(size, chunk_index, half, p.window_size)
            if hit is not None:
                seen.setdefault(hit[1][1:], from_band(hit[1]))
        return list(seen.values())
    if p.cp_comm_type == "p2p":
        return ring(sq, skv, size)
    if p.cp_comm_type == "all_gather":
        if not p.is_causal:
            return [blk(sq, skv * size, "no_mask")]
        return [blk(half, half, "causal")] + [blk(half, c * half, "no_mask") for c in range(1, 2 * size)]
    group = p.a2a_size
    heads = dict(num_heads=max(p.num_heads // group, 1), num_gqa_groups=max(p.num_gqa_groups // group, 1))
    if p.cp_comm_type == "a2a":
        mask = diag_mask if p.is_causal else full_mask
        return [blk(sq * size, skv * size, mask, p.window_size, **heads)]
    return ring(sq * group, skv * group, max(size // group, 1), **heads)
