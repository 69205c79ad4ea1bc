"""Every benchmarks/ path the package, the README and the docs cite exists (a glob matches at least one file), so a
moved or removed result cannot leave a claim without its evidence."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
CITATION = re.compile(r"benchmarks/[A-Za-z0-9_./*-]+")


def _cited() -> dict[str, set[str]]:
    cited: dict[str, set[str]] = {}
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "attn_dispatch").rglob("*.py"))]
    for path in files:
        for match in CITATION.findall(path.read_text()):
            cited.setdefault(match.rstrip(".,;:)`"), set()).add(str(path.relative_to(ROOT)))
    return cited


def test_every_cited_benchmark_path_exists():
    missing = {path: sorted(where) for path, where in _cited().items() if not list(ROOT.glob(path))}
    assert not missing, missing
