"""What this process learned about the live machine while running: engines that failed to load, graphs cuDNN
refused. One immutable value; every new fact (or `selection.clear_cache()`) replaces it with a new one.

The engines record facts here; the live Platform carries the current value (`Platform.detect()`), so the tables
read them as data (`plat.facts`) without importing an engine or selection, and the decision cache, keyed on the
platform, never answers from before a fact. Module plans hold the value they were made under
(freshness.current_stamp), so a new fact re-plans them too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

_EMPTY: Mapping = MappingProxyType({})


@dataclass(frozen=True, eq=False)
class RuntimeFacts:
    """Compared by identity: a new fact, or a cleared cache, is a new value."""

    load_failures: Mapping[str, str] = field(default_factory=lambda: _EMPTY)  # provider id -> why it failed to load
    rejections: Mapping[tuple, str] = field(default_factory=lambda: _EMPTY)  # cuDNN graph signature -> its message
    epoch: int = 0  # how many values came before this one

    def updated(self, **changes: Mapping) -> "RuntimeFacts":
        merged = {name: MappingProxyType({**getattr(self, name), **extra}) for name, extra in changes.items()}
        return RuntimeFacts(**{"load_failures": self.load_failures, "rejections": self.rejections, **merged,
                               "epoch": self.epoch + 1})


NONE = RuntimeFacts()
_CURRENT = [NONE]


def current() -> RuntimeFacts:
    return _CURRENT[0]


def record_load_failure(provider_id: str, message: str) -> None:
    _CURRENT[0] = _CURRENT[0].updated(load_failures={provider_id: message})


def record_rejection(signature: tuple, message: str) -> None:
    _CURRENT[0] = _CURRENT[0].updated(rejections={signature: message})


def renew() -> None:
    """The same facts as a new value: everything decided under the old one is decided again."""
    _CURRENT[0] = _CURRENT[0].updated()
