"""The support matrix, rendered from the constraint tables (the same checks selection runs).

`attn-dispatch matrix --markdown > docs/support-matrix.md`; a test fails when that file is stale."""
from __future__ import annotations

import argparse

from ..constraints import TABLES
from ..constraints.base import Table
from ..constraints.context_parallel import SOURCE, SUPPORT, WINDOW_SOURCE

TOPIC_ORDER = ("environment", "platform", "package", "dtype", "format", "head_dim", "gqa", "seqlen", "mask",
               "window", "bias", "dropout", "softmax", "determinism", "context_parallel", "inference")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _topics(tables: list[Table]) -> list[str]:
    seen = {c.topic for t in tables for c in t.checks}
    return [t for t in TOPIC_ORDER if t in seen] + sorted(seen - set(TOPIC_ORDER))


def render_markdown() -> str:
    tables = list(TABLES.values())
    lines = [
        "# Support matrix",
        "",
        "Generated from the constraint tables by `attn-dispatch matrix --markdown`; do not edit by hand.",
        "Each cell lists what a provider requires on that topic (empty: no requirement). The codes below",
        "are the ones `explain` and `NoBackendAvailableError` report.",
        "",
        "| topic | " + " | ".join(f"`{t.id}`" for t in tables) + " |",
        "|---|" + "---|" * len(tables),
    ]
    for topic in _topics(tables):
        cells = ["<br>".join(_cell(c.requires) for c in t.checks if c.topic == topic) or "-" for t in tables]
        lines.append(f"| {topic} | " + " | ".join(cells) + " |")
    for t in tables:
        lines += ["", f"## `{t.id}`", "", t.description, "",
                  "| code | topic | requires | source |", "|---|---|---|---|"]
        for c in t.checks:
            lines.append(f"| `{c.code}` | {c.topic} | {_cell(c.requires)} | {_cell(c.source)} |")
    return "\n".join(lines + _context_parallel_lines()) + "\n"


def _context_parallel_lines() -> list[str]:
    """attn-dispatch's context parallelism per comm type (the data every table's cp_support check reads)."""
    lines = ["", "## Context parallelism (every engine, through `<family>.cp_support` and the per-block calls)", "",
             "| comm type | formats | masks | sliding window | heads | cross-attention | notes |",
             "|---|---|---|---|---|---|---|"]
    for s in SUPPORT.values():
        masks = "; ".join(f"{fmt}: {', '.join(m)}" for fmt, m in s.masks.items())
        heads = "divisible by the a2a group" if s.heads_divisible_by_group else "any"
        windows = ", ".join(s.window_formats) or "no"
        lines.append(f"| `{s.comm_type}` | {', '.join(s.formats)} | {_cell(masks)} | {windows} | {heads} | "
                     f"{_cell(s.cross_attention)} | {_cell(s.notes)} |")
    lines += ["", f"Source: {_cell(SOURCE)}. Sliding windows: {_cell(WINDOW_SOURCE)}.",
              "Each block's engine is chosen by selection on the block's own parameters (the default policy)."]
    return lines


def render_text() -> str:
    out = []
    for t in TABLES.values():
        out.append(f"{t.id}: {t.description}")
        out.extend(f"  [{c.topic}] {c.requires}   ({c.code})" for c in t.checks)
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--markdown", action="store_true", help="Markdown (as in docs/support-matrix.md)")


def run(args: argparse.Namespace) -> int:
    print(render_markdown() if args.markdown else render_text(), end="" if args.markdown else "\n")
    return 0
