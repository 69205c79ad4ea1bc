"""FP8 attention (Transformer Engine's `fp8_dpa`): recipes, the autocast region, the per-module scaling state.

    from attn_dispatch import DotProductAttention, fp8_autocast
    from attn_dispatch.fp8 import DelayedScaling

    with fp8_autocast(recipe=DelayedScaling(fp8_dpa=True)):
        out = attn(q, k, v)          # q, k, v bf16/fp16: quantized to FP8 by the module, output back in bf16

The module keeps its scales and amax histories (attn.fp8_state) and checkpoints them in its state_dict
(`_extra_state`, as Transformer Engine's modules do).
"""
from .autocast import fp8_autocast
from .output import Float8Output
from .recipe import DelayedScaling, Float8CurrentScaling, Format
from .state import FP8ScalingState

__all__ = ["DelayedScaling", "Float8CurrentScaling", "Float8Output", "FP8ScalingState", "Format", "fp8_autocast"]
