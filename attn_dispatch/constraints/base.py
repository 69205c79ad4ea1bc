"""The constraint mechanism: a table of small named checks per engine provider.

A check is `(params, platform, env) -> Failure | None`. The table wraps each failure into a `Reason`
carrying the check's stable code and source. Selection, explanations, errors and the generated
support matrix all read these same tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

from ..decision import Reason, Verdict
from ..env import EnvFlags
from ..params import AttentionParams
from ..platform import Platform


class Failure(NamedTuple):
    message: str
    fix: str | None = None


def fail(message: str, fix: str | None = None) -> Failure:
    return Failure(message, fix)


CheckFn = Callable[[AttentionParams, Platform, EnvFlags], "Failure | None"]
NoteFn = Callable[[AttentionParams, Platform], "str | None"]


@dataclass(frozen=True)
class Check:
    code: str        # stable, e.g. 'cudnn_fused.seqlen_multiple_of_64'
    requires: str    # the requirement in words, for the support matrix
    topic: str       # groups the matrix rows: platform, package, dtype, head_dim, seqlen, mask, ...
    source: str      # where the fact comes from
    fn: CheckFn

    def __call__(self, params: AttentionParams, platform: Platform, env: EnvFlags) -> Reason | None:
        failure = self.fn(params, platform, env)
        if failure is None:
            return None
        return Reason(code=self.code, message=failure.message, fix=failure.fix, source=self.source)


@dataclass
class Table:
    """The declared support surface of one provider (e.g. flash_attn_2 through torch's vendored kernels)."""

    family: str
    provider: str
    description: str
    checks: list[Check] = field(default_factory=list)
    notes: list[NoteFn] = field(default_factory=list)
    detail: Callable[[AttentionParams, Platform, EnvFlags], dict] | None = None

    @property
    def id(self) -> str:
        return f"{self.family}:{self.provider}"

    def check(self, name: str, *, requires: str, topic: str, source: str) -> Callable[[CheckFn], CheckFn]:
        """Decorator: declare a check under code '<family>.<name>'."""
        def register(fn: CheckFn) -> CheckFn:
            self.add(Check(f"{self.family}.{name}", requires, topic, source, fn))
            return fn
        return register

    def add(self, *checks: Check) -> None:
        known = {c.code for c in self.checks}
        for c in checks:
            if c.code in known:
                raise ValueError(f"check code {c.code!r} declared twice in table {self.id}")
            known.add(c.code)
            self.checks.append(c)

    def note(self, fn: NoteFn) -> NoteFn:
        self.notes.append(fn)
        return fn

    def failures(self, params: AttentionParams, platform: Platform, env: EnvFlags) -> Iterator[Reason]:
        for c in self.checks:
            failure = c.fn(params, platform, env)  # most checks pass: a Reason is built only for a failure
            if failure is not None:
                yield Reason(code=c.code, message=failure.message, fix=failure.fix, source=c.source)

    def evaluate(self, params: AttentionParams, platform: Platform, env: EnvFlags) -> Verdict:
        """Every check runs, so the verdict lists every reason, not only the first."""
        reasons = list(self.failures(params, platform, env))
        notes = [n for n in (fn(params, platform) for fn in self.notes) if n]
        detail = self.detail(params, platform, env) if self.detail and not reasons else {}
        return Verdict(backend=self.family, provider=self.provider, eligible=not reasons, reasons=reasons,
                       notes=notes, detail=detail)
