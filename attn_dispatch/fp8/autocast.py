"""`fp8_autocast`: the region in which DotProductAttention runs in FP8 (Transformer Engine's `fp8_autocast`).

The active recipe is per thread (a stack, so regions nest); modules read it when they are called. `ACTIVE` counts
the regions open in any thread so that a module's cached path can tell in one read that no FP8 region exists.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

from .recipe import RECIPES, DelayedScaling, Recipe

ACTIVE = [0]  # FP8-enabled regions open in any thread
_LOCAL = threading.local()
_LOCK = threading.Lock()


class FP8Region:
    __slots__ = ("recipe", "group")

    def __init__(self, recipe: Recipe, group: Any):
        self.recipe, self.group = recipe, group


@contextmanager
def fp8_autocast(enabled: bool = True, recipe: Recipe | None = None, *, fp8_recipe: Recipe | None = None,
                 fp8_group: Any = None) -> Iterator[None]:
    """Run DotProductAttention calls in FP8 when `recipe.fp8_dpa` is True. `fp8_recipe` is Transformer Engine's
    name for `recipe`; `fp8_group` (a torch.distributed group) takes the max of each amax over its ranks, as
    Transformer Engine's amax reduction does. `enabled=False` opens a region without FP8 (nested regions too)."""
    if recipe is not None and fp8_recipe is not None:
        raise ValueError("pass the recipe once: recipe= or fp8_recipe= (Transformer Engine's name), not both")
    recipe = recipe if recipe is not None else fp8_recipe
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled={enabled!r} must be True or False")
    if recipe is None:
        recipe = DelayedScaling()
    elif not isinstance(recipe, RECIPES):
        raise ValueError(f"recipe={recipe!r} is not supported; use attn_dispatch.fp8.DelayedScaling or "
                         "Float8CurrentScaling")
    stack = _stack()
    stack.append(FP8Region(recipe, fp8_group) if enabled else None)
    if enabled:
        with _LOCK:
            ACTIVE[0] += 1
    try:
        yield
    finally:
        stack.pop()
        if enabled:
            with _LOCK:
                ACTIVE[0] -= 1


def _stack() -> list:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def current_region() -> FP8Region | None:
    """The innermost FP8 region of this thread whose recipe runs attention in FP8 (fp8_dpa), else None."""
    if not ACTIVE[0]:
        return None
    stack = getattr(_LOCAL, "stack", None)
    if not stack or stack[-1] is None or not stack[-1].recipe.fp8_dpa:
        return None
    return stack[-1]
