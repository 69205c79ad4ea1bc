"""Plain-text rendering of a Decision (the CLI uses rich when it is installed)."""
from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .decision import Decision


def render_decision(decision: "Decision", *, width: int = 100) -> str:
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
