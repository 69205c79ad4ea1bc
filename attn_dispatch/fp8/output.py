"""What an FP8 output is handed back as (fp8_output=True, or a recipe with fp8_mha=True)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from .quantize import dequantize


class Float8Output(NamedTuple):
    """FP8 data and the scale that undoes its quantization: real value = data * scale_inv. `scale_inv` is a
    float32 [1] tensor on the data's device (what torch._scaled_mm and Transformer Engine's Float8Tensor carry)."""
    data: torch.Tensor
    scale_inv: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self.data, self.scale_inv, dtype)

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> "Float8Output":
        return Float8Output(self.data.flatten(start_dim, end_dim), self.scale_inv)
