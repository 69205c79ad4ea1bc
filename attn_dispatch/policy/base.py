"""What a policy returns to selection: the pick among the eligible providers, and why."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..params import AttentionParams, SeqLengths
from ..platform import Platform


@dataclass(frozen=True)
class Choice:
    chosen: str | None
    reason: str
    estimates: dict[str, float] = field(default_factory=dict)  # provider -> cost, in `unit`
    unit: str = ""


class Policy(Protocol):
    """A strategy selection consults: `eligible` lists the eligible provider ids in the preference order; `lengths`
    (a packed call's own, or None) is what a policy that times the call times it on (a small packed call's engines
    rank by the tokens present; benchmarks/results/README.md)."""

    name: str

    def choose(self, params: AttentionParams, platform: Platform, eligible: list[str],
               lengths: SeqLengths | None = None) -> Choice: ...
