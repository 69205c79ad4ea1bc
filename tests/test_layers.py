"""The package's layers point one way: the import-linter contracts in pyproject.toml hold, and no function-local
import inside the package hides a cycle (function-local imports defer optional third-party packages only)."""
from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "attn_dispatch"
# The root package's lazy attributes (DotProductAttention, ...): `import attn_dispatch` stays light for the CLI's
# described-platform questions; nothing inside the package imports the root.
ALLOWED = {"__init__.py"}


def _local_package_imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                relative = isinstance(sub, ast.ImportFrom) and sub.level > 0
                absolute = isinstance(sub, (ast.Import, ast.ImportFrom)) and any(
                    name.startswith("attn_dispatch") for name in
                    ([a.name for a in sub.names] if isinstance(sub, ast.Import) else [sub.module or ""]))
                if relative or absolute:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{sub.lineno}: {ast.unparse(sub)}")
    return found


def test_no_function_local_import_inside_the_package():
    offenders = [line for path in sorted(PACKAGE.rglob("*.py")) if path.name not in ALLOWED or path.parent != PACKAGE
                 for line in _local_package_imports(path)]
    assert not offenders, "function-local imports of the package itself:\n" + "\n".join(offenders)


def test_the_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("lint-imports")
    if lint is None:
        pytest.fail("lint-imports is not installed: pip install -e '.[test]' installs import-linter")
    result = subprocess.run([lint, "--no-cache"], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
