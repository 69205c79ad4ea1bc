"""Transformer Engine's fixed preference order: the `order` policy, and the fallback of the others."""
from __future__ import annotations

from ..decision import Verdict
from ..params import AttentionParams, SeqLengths
from ..platform import Platform
from .base import Choice


# After every engine Transformer Engine knows: FlexAttention (any mask as a block-sparse BlockMask, modifiers), then
# torch's memory-efficient kernels (an additive mask/bias read in full), then unfused, the last resort on a GPU.
MASKED_FAMILIES = ("flex_attention", "mem_efficient")
ONE_QUERY_TILE = 128  # FlexAttention's BlockMask tile (constraints/flex_attention.py BLOCK_SIZE)


def preference_order(params: AttentionParams, platform: Platform) -> tuple[tuple[str, ...], str]:
    """Families in the order they are preferred, and why. Transformer Engine's order on each architecture:
    FlashAttention before cuDNN fused attention, except on Hopper and newer, where cuDNN's arbitrary-seqlen
    sub-backend goes first 'for performance reasons' (get_attention_backend). flash-attn-4, which Transformer
    Engine does not use, comes after cuDNN and before FA3/FA2 on the architectures it targets (sm90, sm100); the
    masked-call families follow, unfused last. On the CPU unfused comes first (FlexAttention runs eagerly there,
    materialising the scores): FlexAttention runs only what unfused cannot (a user's mask_mod / score_mod)."""
    if params.device_type == "cpu" or platform.device_type == "cpu":
        return (("unfused", "flex_attention"),
                "on the CPU the unfused engine runs; FlexAttention (eager) only where unfused cannot")
    masked = MASKED_FAMILIES
    if params.attn_mask_type == "arbitrary" and params.max_seqlen_q <= ONE_QUERY_TILE:
        # one query tile (decode steps): a BlockMask can skip only key blocks every query masks, and it is built per
        # mask tensor, which such callers make anew each step; the memory-efficient kernel reads the mask as it is
        masked = tuple(reversed(MASKED_FAMILIES))
    if platform.sm >= 90:
        return (("cudnn_fused", "flash_attn_4", "flash_attn_3", "flash_attn_2") + masked + ("unfused",),
                f"sm{platform.sm} (Hopper or newer): Transformer Engine prefers cuDNN fused attention, then "
                "FlashAttention; FlexAttention and the memory-efficient kernels before unfused")
    return (("flash_attn_2", "cudnn_fused", "flash_attn_4", "flash_attn_3") + masked + ("unfused",),
            f"sm{platform.sm}: Transformer Engine prefers FlashAttention 2, then cuDNN fused attention; FlexAttention "
            "and the memory-efficient kernels before unfused")


def apply_order_rules(order: tuple[str, ...], verdicts: list[Verdict], platform: Platform) -> tuple[str, ...]:
    """Transformer Engine prefers cuDNN on Hopper only with its arbitrary-seqlen sub-backend: with the max512 one it
    goes after the FlashAttention families."""
    if platform.sm >= 90 and order[0] == "cudnn_fused":
        cudnn = next((v for v in verdicts if v.backend == "cudnn_fused" and v.eligible), None)
        if cudnn is not None and cudnn.detail.get("sub_backend") == "F16_max512_seqlen":
            rest = [f for f in order if f != "cudnn_fused"]
            last_flash = max(i for i, f in enumerate(rest) if f.startswith("flash_attn"))
            return tuple(rest[:last_flash + 1] + ["cudnn_fused"] + rest[last_flash + 1:])
    return order


class OrderPolicy:
    name = "order"

    def choose(self, params: AttentionParams, platform: Platform, eligible: list[str],
               lengths: SeqLengths | None = None) -> Choice:
        if not eligible:
            return Choice(None, "no provider is eligible")
        return Choice(eligible[0], "Transformer Engine's preference order: the first eligible provider")


def without_last_resort(eligible: list[str], params: AttentionParams, platform: Platform) -> list[str]:
    """The providers a policy compares: on a GPU the unfused engine is the last resort, left out while any other
    provider is eligible (over 2329 calls timed on the H100 and H200 it was 4.1x or more slower than a fused engine:
    policy/measured.py), so that a provider the performance profile has not measured yet is not passed over for it."""
    if params.device_type != "cuda" or platform.device_type != "cuda":
        return eligible
    fused = [p for p in eligible if not p.startswith("unfused:")]
    return fused or eligible
