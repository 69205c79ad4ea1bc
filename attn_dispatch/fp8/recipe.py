"""FP8 recipes with Transformer Engine's names and meanings (transformer_engine/common/recipe/__init__.py):
`DelayedScaling` scales each tensor by the amax history of earlier steps, `Float8CurrentScaling` by the tensor's
own amax at the call. Attention runs in FP8 only when the recipe says `fp8_dpa=True` (TE's default is False:
inside `fp8_autocast` attention stays in bf16/fp16 unless asked); `fp8_mha=True` also keeps the output in FP8.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Union

import torch


class Format(Enum):
    """FP8 formats: E4M3 everywhere, or HYBRID (E4M3 forward, E5M2 backward: gradients need the range)."""

    E4M3 = "E4M3"
    HYBRID = "HYBRID"

    @property
    def forward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2


FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def _format(value: Union[str, Format]) -> Format:
    if isinstance(value, Format):
        return value
    names = {f.value: f for f in Format}
    name = getattr(value, "name", value)  # Transformer Engine's own Format enum members carry the same names
    if name in names:
        return names[name]
    raise ValueError(f"fp8_format={value!r} is not supported; use one of {', '.join(names)} (pure E5M2 training "
                     "is not supported, as in Transformer Engine)")


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")
    return value


@dataclass(frozen=True)
class DelayedScaling:
    """Scale = (fp8_max / amax) / 2**margin, amax taken from the last `amax_history_len` steps ('max') or the
    latest one ('most_recent'); the scale a step uses was computed after the step before it."""

    margin: int = 0
    fp8_format: Union[Format, str] = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", _format(self.fp8_format))
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin={self.margin!r} must be an int >= 0")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len={self.amax_history_len!r} must be an int >= 1")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"amax_compute_algo={self.amax_compute_algo!r} is not supported; use one of "
                             f"{', '.join(AMAX_COMPUTE_ALGOS)} (callables are not supported by attn-dispatch)")
        for name in ("reduce_amax", "fp8_dpa", "fp8_mha"):
            _flag(name, getattr(self, name))
        if self.fp8_mha and not self.fp8_dpa:
            raise ValueError("fp8_mha=True needs fp8_dpa=True (FP8 output comes from FP8 attention)")

    kind = "delayed"


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Each tensor attn-dispatch quantizes itself (q, k, v; dO in backward) is scaled by its own amax at the call.
    The tensors cuDNN's kernel quantizes inside (the softmax S and its gradient dP) and writes (O; dQ, dK, dV) need
    their scale before the kernel runs, so they are scaled from the previous call's amax: as Transformer Engine
    does for S and dP (its DPA forces delayed-scaling quantizers for them)."""

    fp8_format: Union[Format, str] = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", _format(self.fp8_format))
        for name in ("fp8_dpa", "fp8_mha"):
            _flag(name, getattr(self, name))
        if self.fp8_mha and not self.fp8_dpa:
            raise ValueError("fp8_mha=True needs fp8_dpa=True (FP8 output comes from FP8 attention)")

    kind = "current"
    margin = 0
    amax_history_len = 1  # the kernel-written tensors' scales come from the previous call's amax
    amax_compute_algo = "most_recent"
    reduce_amax = True


Recipe = Union[DelayedScaling, Float8CurrentScaling]
RECIPES = (DelayedScaling, Float8CurrentScaling)
