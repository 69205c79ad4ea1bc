"""Transformer Engine's fixed preference order: the `order` policy, and the fallback of the others."""
from __future__ import annotations

from ..decision import Verdict
from ..params import AttentionParams, SeqLengths
from ..platform import Platform
from .base import Choice


def preference_order(params: AttentionParams, platform: Platform) -> tuple[tuple[str, ...], str]:
    """Families in the order they are preferred, and why. Transformer Engine's order on each architecture:
    FlashAttention before cuDNN fused attention, except on Hopper and newer, where cuDNN's arbitrary-seqlen
    sub-backend goes first 'for performance reasons' (get_attention_backend). flash-attn-4, which Transformer
    Engine does not use, comes after cuDNN and before FA3/FA2 on the architectures it targets (sm90, sm100)."""
    if params.device_type == "cpu" or platform.device_type == "cpu":
        return ("unfused",), "on the CPU only the unfused engine runs"
    if platform.sm >= 90:
        return (("cudnn_fused", "flash_attn_4", "flash_attn_3", "flash_attn_2", "unfused"),
                f"sm{platform.sm} (Hopper or newer): Transformer Engine prefers cuDNN fused attention, then FlashAttention")
    return (("flash_attn_2", "cudnn_fused", "flash_attn_4", "flash_attn_3", "unfused"),
            f"sm{platform.sm}: Transformer Engine prefers FlashAttention 2, then cuDNN fused attention")


def apply_order_rules(order: tuple[str, ...], verdicts: list[Verdict], platform: Platform) -> tuple[str, ...]:
    """Transformer Engine prefers cuDNN on Hopper only with its arbitrary-seqlen sub-backend."""
    if platform.sm >= 90 and order[0] == "cudnn_fused":
        cudnn = next((v for v in verdicts if v.backend == "cudnn_fused" and v.eligible), None)
        if cudnn is not None and cudnn.detail.get("sub_backend") == "F16_max512_seqlen":
            return tuple(f for f in order if f != "cudnn_fused")[:-1] + ("cudnn_fused", "unfused")
    return order


class OrderPolicy:
    name = "order"

    def choose(self, params: AttentionParams, platform: Platform, eligible: list[str],
               lengths: SeqLengths | None = None) -> Choice:
        if not eligible:
            return Choice(None, "no provider is eligible")
        return Choice(eligible[0], "Transformer Engine's preference order: the first eligible provider")
