"""Decision, Verdict, Reason: what selection concluded and why. Also what explain() returns, and its plain-text
rendering (the CLI uses rich when it is installed)."""
from __future__ import annotations

import textwrap
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Reason(BaseModel):
    model_config = ConfigDict(frozen=True)

    code: str
    message: str
    fix: str | None = None
    source: str = ""


class Verdict(BaseModel):
    model_config = ConfigDict(frozen=True)  # shared by every caller of a cached decision: never edited in place

    backend: str   # family, e.g. 'flash_attn_2'
    provider: str  # e.g. 'torch' (the FA2 kernels vendored in torch)
    eligible: bool
    reasons: tuple[Reason, ...] = ()
    notes: tuple[str, ...] = ()
    detail: dict[str, Any] = Field(default_factory=dict)  # e.g. cuDNN's sub-backend

    @property
    def id(self) -> str:
        return f"{self.backend}:{self.provider}"

    def has(self, code: str) -> bool:
        return any(r.code == code for r in self.reasons)


class Decision(BaseModel):
    """Immutable: a cached decision is shared by every call that hits it (model_copy(update=...) derives one)."""
    model_config = ConfigDict(frozen=True)

    chosen: str | None = None           # provider id 'family:provider', None when nothing qualifies
    policy: str = "auto"
    policy_reason: str = ""             # why the policy picked `chosen` over the other eligible providers
    estimates: dict[str, float] = Field(default_factory=dict)  # provider -> cost behind the pick
    estimate_unit: str = ""             # e.g. 'ms per step, predicted' (profile) or 'ms per step, measured here'
    forced: str | None = None           # what the user forced, and through what
    forced_by: str | None = None
    order: tuple[str, ...] = ()  # families in preference order for this platform
    order_reason: str = ""
    verdicts: tuple[Verdict, ...] = ()
    params: dict[str, Any] = Field(default_factory=dict)
    platform: dict[str, Any] = Field(default_factory=dict)
    params_text: str = ""
    platform_text: str = ""
    notes: tuple[str, ...] = ()  # how the caller's arguments were read (e.g. the SDPA function's bool mask)

    @property
    def backend(self) -> str | None:
        """The chosen family ('cudnn_fused'), or None."""
        return self.chosen.partition(":")[0] if self.chosen else None

    @property
    def provider(self) -> str | None:
        return self.chosen.partition(":")[2] if self.chosen else None

    @property
    def ok(self) -> bool:
        return self.chosen is not None

    def with_notes(self, *notes: str) -> "Decision":
        """This decision with more notes on how the call was read (itself when there are none)."""
        return self.model_copy(update={"notes": self.notes + notes}) if notes else self

    def verdict(self, backend: str, provider: str | None = None) -> Verdict:
        """The verdict of a family (its first eligible provider, else its first) or of one provider."""
        matches = [v for v in self.verdicts if v.backend == backend and (provider is None or v.provider == provider)]
        if not matches:
            raise KeyError(f"no verdict for backend {backend!r}{f' provider {provider!r}' if provider else ''}; "
                           f"known: {', '.join(v.id for v in self.verdicts)}")
        return next((v for v in matches if v.eligible), matches[0])

    def reasons(self, backend: str) -> list[Reason]:
        """Every reason across the family's providers."""
        return [r for v in self.verdicts if v.backend == backend for r in v.reasons]

    def summary(self, *, width: int = 100) -> str:
        return render_decision(self, width=width)

    def __str__(self) -> str:
        return self.summary()


def render_decision(decision: Decision, *, width: int = 100) -> str:
    lines = [f"call:     {decision.params_text}", f"platform: {decision.platform_text}"]
    if decision.forced:
        lines.append(f"forced:   {decision.forced} (by {decision.forced_by})")
    lines.append(f"policy:   {decision.policy}; order: {' > '.join(decision.order)} ({decision.order_reason})")
    lines.append(f"chosen:   {decision.chosen or 'NONE - no backend qualifies'}")
    for note in decision.notes:
        lines.extend(textwrap.wrap(f"note:     {note}", width, subsequent_indent=" " * 10))
    if decision.policy_reason:
        lines.extend(textwrap.wrap(f"why:      {decision.policy_reason}", width, subsequent_indent=" " * 10))
    lines.append("")
    name_width = max(len(v.id) for v in decision.verdicts) + 2 if decision.verdicts else 10
    text_width = max(40, width - name_width - 14)
    for v in decision.verdicts:
        mark = "CHOSEN" if v.id == decision.chosen else ("eligible" if v.eligible else "rejected")
        estimate = decision.estimates.get(v.id)
        lines.append(f"{v.id:<{name_width}}{mark}" + (f"  ({estimate:.3f} {decision.estimate_unit})"
                                                        if estimate is not None else ""))
        for r in v.reasons:
            body = textwrap.wrap(f"{r.message} [{r.code}]", text_width)
            lines.extend(" " * (name_width + 2) + ("- " if i == 0 else "  ") + part for i, part in enumerate(body))
            if r.fix:
                lines.extend(" " * (name_width + 4) + part for part in textwrap.wrap(f"fix: {r.fix}", text_width))
        for note in v.notes:
            lines.extend(" " * (name_width + 2) + part for part in textwrap.wrap(f"note: {note}", text_width))
    return "\n".join(lines)


class NoBackendAvailableError(RuntimeError):
    """Nothing qualifies (or the forced backend does not). Carries the Decision; the message has every reason."""
    def __init__(self, decision: Decision):
        self.decision = decision
        super().__init__(_error_message(decision))


def _error_message(decision: Decision) -> str:
    if decision.forced:
        head = (f"The backend forced by {decision.forced_by} ({decision.forced}) cannot run this attention call; "
                "nothing falls back silently.")
    else:
        head = "No attention backend can run this attention call."
    lines = [head, f"  call: {decision.params_text}", f"  platform: {decision.platform_text}"]
    for v in decision.verdicts:
        if v.eligible:
            lines.append(f"  {v.id}: eligible (not forced)")
            continue
        lines.append(f"  {v.id}:")
        for r in v.reasons:
            lines.append(f"    - [{r.code}] {r.message}" + (f" Fix: {r.fix}" if r.fix else ""))
    return "\n".join(lines)
