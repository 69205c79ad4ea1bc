"""How each engine spreads a KV-cache decode step over the GPU: split-KV (flash-decoding) or not.

A decode step reads every cached key and value once and does little arithmetic on them: it is bound by memory
bandwidth, and reaches it only when enough thread blocks stream the cache at once. Without split-KV an engine
runs one block per (sequence, kv head) (GQA query heads packed into the block's rows), so a small batch leaves
most SMs idle however long the context; with split-KV the keys of one (sequence, kv head) are divided among
several blocks and their partial results combined. These facts are read by the tables' notes (explain) and by
the auto policy's decode model (policy/decode.py). Facts, with their sources:

- flash_attn_2:torch (aten::_flash_attention_forward, varlen path; pytorch flash_api.cpp mha_varlen_fwd):
  set_params_splitkv runs when seqlenq_ngroups_swapped (max_seqlen_q == 1, num_heads > num_heads_k, no
  window, no dropout, no ALiBi: the query heads of a group become rows of one block) or, in torches whose op
  takes block_table, for a paged cache; its num_splits_heuristic fills 2 x SMs blocks. Otherwise (MHA decode,
  sliding windows, q_len > 1) one block per (sequence, head, 128 queries).
- flash_attn_4:cute (interface._flash_attn_fwd, 4.0.0b36): pack_gqa packs a group's heads into the query tile;
  num_splits=0 (what the engine passes off sm90) runs num_splits_heuristic(total_mblocks, SMs, n_blocks, 128);
  sm90 asserts 'SplitKV not supported on SM 9.0', so there a step runs batch x kv heads blocks.
- cudnn_fused:frontend: the cuDNN backend library's engines on sm90 do not document how they parallelise an
  s_q = 1 graph; cudnn-frontend's own split-KV decode kernels (sdpa_fwd_decode) target sm100+ and are python
  engines this engine deselects. Unknown here: measured by benchmarks/bench_kv_decode.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..params import AttentionParams
from ..platform import Platform, parse_version

FA2_SOURCE = ("pytorch aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp mha_varlen_fwd "
              "(seqlenq_ngroups_swapped, set_params_splitkv, num_splits_heuristic)")
FA4_SOURCE = "flash-attn-4 4.0.0b36 flash_attn/cute/interface.py _flash_attn_fwd / _get_fwd_config"
# torch whose aten::_flash_attention_forward takes block_table (constraints/flash_attn_2.py TORCH_BLOCK_TABLE)
TORCH_PAGED_SPLIT = "2.13"


@dataclass(frozen=True)
class DecodeLaunch:
    """blocks: thread blocks a step runs before any split; split_kv: whether the engine splits the keys among
    more blocks when those leave SMs idle (None: not known); why: the rule that applied."""

    blocks: int
    split_kv: bool | None
    why: str


def _packed_blocks(p: AttentionParams, tile_m: int) -> int:
    """Blocks with a group's query heads packed into one tile of tile_m rows."""
    rows = p.max_seqlen_q * p.gqa_ratio
    return p.batch_size * p.num_gqa_groups * -(-rows // tile_m)


def launch(provider: str, p: AttentionParams, plat: Platform) -> DecodeLaunch | None:
    """The decode launch of a provider for this KV-cache call; None for one this module knows nothing of."""
    windowed = p.window_size[0] >= 0
    if provider == "flash_attn_2:torch":
        swapped = p.max_seqlen_q == 1 and p.gqa_ratio > 1 and not windowed
        if swapped:
            return DecodeLaunch(p.batch_size * p.num_gqa_groups, True,
                                "q_len 1 with GQA and no window: query heads packed per kv head, keys split")
        if p.kv_cache_paged and plat.torch >= parse_version(TORCH_PAGED_SPLIT):
            return DecodeLaunch(p.batch_size * p.num_heads * -(-p.max_seqlen_q // 64), True,
                                "a paged cache (block_table) runs the split-KV kernel")
        why = ("a sliding window" if windowed else "no GQA" if p.gqa_ratio == 1 else f"q_len {p.max_seqlen_q}")
        return DecodeLaunch(p.batch_size * p.num_heads * -(-p.max_seqlen_q // 128), False,
                            f"{why}: one block per (sequence, head), keys not split")
    if provider == "flash_attn_4:cute":
        blocks = _packed_blocks(p, 128)
        if plat.sm // 10 == 9:
            return DecodeLaunch(blocks, False, "sm90 has no split-KV kernel: one block per (sequence, kv head)")
        return DecodeLaunch(blocks, True, "num_splits=0: its heuristic splits the keys to fill the SMs")
    if provider == "cudnn_fused:frontend":
        return DecodeLaunch(p.batch_size * p.num_heads, None, "cuDNN does not document its decode parallelism")
    return None


def note(provider: str, p: AttentionParams, plat: Platform, source: str) -> str | None:
    """The decode note a table shows (explain) for a KV-cache call with a short query."""
    if not p.inference_kv_cache or plat.device_type != "cuda":
        return None
    found = launch(provider, p, plat)
    if found is None:
        return None
    if found.split_kv is None:
        return f"KV-cache step: split-KV unknown: {found.why} ({source})"
    split = "splits the keys across blocks (split-KV)" if found.split_kv else "does not split the keys"
    return f"KV-cache step: {found.blocks} thread blocks before any split, {split}: {found.why} ({source})"
