"""A module's FP8 scaling state: per-tensor scales and amax histories, updated on the device (no host sync).

One column per tensor of an attention step (Transformer Engine's DPA tracks the same roles): forward q, k, v
(quantized by attn-dispatch), s (the softmax probabilities, quantized inside cuDNN's kernel), o (written in FP8 by
the kernel); backward do, dp (the softmax gradient inside the kernel), dq, dk, dv. Row 0 of the history collects
the amaxes of the step under way; after the step the history rolls and the scales are recomputed, as in
Transformer Engine's delayed scaling (common/recipe/delayed_scaling.cu): amax = max over the window ('max') or
row 0 ('most_recent'); scale = (fp8_max / amax) / 2**margin, kept when amax is 0 or not finite.
"""
from __future__ import annotations

from typing import Any

import torch

from .recipe import FP8_MAX, Recipe

FORWARD = ("q", "k", "v", "s", "o")
BACKWARD = ("do", "dp", "dq", "dk", "dv")
SLOTS = FORWARD + BACKWARD
INDEX = {name: i for i, name in enumerate(SLOTS)}
SELF_QUANTIZED = ("q", "k", "v", "do")  # current scaling takes these from the tensor's own amax
# cuDNN's FP8 kernel quantizes the softmax's unnormalised block probabilities exp(s - running max) <= 1 with the S
# scale, but reports the amax of the normalised probabilities (0.15 for a no_mask call where causal gives 1.0, seen
# on the H100 with cuDNN 9.19; benchmarks/results/README.md). A scale taken from that amax saturates P: the S
# scale is fp8_max / 1, the bound of what is quantized (cudnn-frontend's own FP8 test fixes s_amax = 1.0 too).
S_AMAX_BOUND = 1.0
_FLOAT32_MAX = torch.finfo(torch.float32).max


class FP8ScalingState:
    """scale [10] and amax_history [L, 10] (float32, on the device of the calls)."""

    def __init__(self, recipe: Recipe, device: torch.device | str = "cpu"):
        self.recipe = recipe
        self.amax_history = torch.zeros(recipe.amax_history_len, len(SLOTS), dtype=torch.float32, device=device)
        self.scale = torch.ones(len(SLOTS), dtype=torch.float32, device=device)
        fwd, bwd = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
        self.dtypes = {name: fwd if name in FORWARD else bwd for name in SLOTS}
        self._fp8_max = torch.tensor([FP8_MAX[self.dtypes[n]] for n in SLOTS], dtype=torch.float32, device=device)
        # column masks made once: a host list copied to the device at each update would wait for the GPU
        self._s_column = torch.tensor([n == "s" for n in SLOTS], device=device)
        self._self_quantized = torch.tensor([n in SELF_QUANTIZED for n in SLOTS], device=device)
        self.steps = 0  # forward calls recorded (informational; checkpointed)

    # --- the recipe a module is called under may change -------------------------------------------------
    def matches(self, recipe: Recipe) -> bool:
        return (type(recipe) is type(self.recipe) and recipe.fp8_format is self.recipe.fp8_format
                and recipe.amax_history_len == self.amax_history.shape[0])

    def adopt(self, recipe: Recipe) -> "FP8ScalingState":
        """This state under another recipe: scales kept, history cut or zero-padded to its length."""
        new = FP8ScalingState(recipe, self.scale.device)
        if recipe.fp8_format is self.recipe.fp8_format:
            new.scale.copy_(self.scale)
        rows = min(new.amax_history.shape[0], self.amax_history.shape[0])
        new.amax_history[:rows] = self.amax_history[:rows]
        new.steps = self.steps
        return new

    def to(self, device: torch.device) -> "FP8ScalingState":
        if self.scale.device != device:
            self.amax_history, self.scale = self.amax_history.to(device), self.scale.to(device)
            self._fp8_max = self._fp8_max.to(device)
            self._s_column, self._self_quantized = self._s_column.to(device), self._self_quantized.to(device)
        return self

    # --- per call --------------------------------------------------------------------------------------
    def amax_slot(self, name: str) -> torch.Tensor:
        """The [1] view of row 0 the step's amax of `name` is written into (kernels write it in place)."""
        i = INDEX[name]
        return self.amax_history[0, i:i + 1]

    def scale_of(self, name: str) -> torch.Tensor:
        i = INDEX[name]
        return self.scale[i:i + 1]

    def fp8_max(self, name: str) -> float:
        return FP8_MAX[self.dtypes[name]]

    def current_scale(self, name: str, amax: torch.Tensor) -> torch.Tensor:
        """Current scaling: the scale of a tensor from its own amax (a [1] tensor), written into `scale` so that
        what the step used stays visible."""
        scale = self.scale_of(name)
        new = _scale_from_amax(amax, self.fp8_max(name) / 2 ** self.recipe.margin, scale)
        scale.copy_(new)
        return scale

    def update(self, names: tuple[str, ...], group: Any = None) -> None:
        """After a step: reduce row 0 over `group` (max), compute the new scales of `names`, roll the history."""
        cols = slice(INDEX[names[0]], INDEX[names[-1]] + 1)
        history = self.amax_history[:, cols]
        if group is not None and self.recipe.reduce_amax:
            import torch.distributed as dist

            row = history[0].clone()
            dist.all_reduce(row, op=dist.ReduceOp.MAX, group=group)
            history[0] = row
        amax = history.amax(0) if self.recipe.amax_compute_algo == "max" else history[0]
        if "s" in names:  # a masked select, not an indexed store: storing a host scalar would sync
            amax = torch.where(self._s_column[cols], S_AMAX_BOUND, amax)
        scale = self.scale[cols]
        new = _scale_from_amax(amax, self._fp8_max[cols] / 2 ** self.recipe.margin, scale)
        if self.recipe.kind == "current":  # the self-quantized tensors are scaled at each call, not here
            new = torch.where(self._self_quantized[cols], scale, new)
        scale.copy_(new)
        if history.shape[0] > 1:
            history.copy_(torch.roll(history, -1, 0))
        history[0].zero_()
        if names[0] == FORWARD[0]:
            self.steps += 1

    def snapshot(self) -> tuple:
        """What a call may change before it fails (scales, histories, step count), for restore()."""
        return self.scale.clone(), self.amax_history.clone(), self.steps

    def restore(self, snapshot: tuple) -> None:
        """Undo a call that failed part-way (after quantizing, before or in its kernel)."""
        scale, history, steps = snapshot
        self.scale.copy_(scale)
        self.amax_history.copy_(history)
        self.steps = steps

    # --- checkpoints (DotProductAttention's extra state) -----------------------------------------------
    def state_dict(self) -> dict:
        r = self.recipe
        return {"recipe": type(r).__name__, "fp8_format": r.fp8_format.value,
                "amax_history": self.amax_history.detach().cpu().clone(), "scale": self.scale.detach().cpu().clone(),
                "steps": self.steps}

    @classmethod
    def from_state_dict(cls, state: dict, recipe: Recipe, device: torch.device | str = "cpu") -> "FP8ScalingState":
        try:
            history, scale = state["amax_history"], state["scale"]
        except (KeyError, TypeError):
            raise ValueError(f"FP8 extra state {type(state).__name__} lacks 'amax_history'/'scale': not a state "
                             "saved by attn_dispatch.DotProductAttention") from None
        if not isinstance(history, torch.Tensor) or history.dim() != 2 or history.shape[1] != len(SLOTS) \
                or not isinstance(scale, torch.Tensor) or scale.shape != (len(SLOTS),):
            raise ValueError(f"FP8 extra state has amax_history {getattr(history, 'shape', None)} and scale "
                             f"{getattr(scale, 'shape', None)}; expected [L, {len(SLOTS)}] and [{len(SLOTS)}]")
        new = cls(recipe, device)
        new.amax_history = history.to(device=device, dtype=torch.float32).clone()
        new.scale = scale.to(device=device, dtype=torch.float32).clone()
        new.steps = int(state.get("steps", 0))
        return new


def _scale_from_amax(amax: torch.Tensor, scaled_max: Any, previous: torch.Tensor) -> torch.Tensor:
    """(fp8_max / 2**margin) / amax; the previous scale where amax is 0 or not finite; FLT_MAX where that
    overflows (Transformer Engine's rule)."""
    ok = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(ok, scaled_max / torch.where(ok, amax, torch.ones_like(amax)), previous)
    return torch.where(torch.isinf(scale), torch.full_like(scale, _FLOAT32_MAX), scale)
