"""Reading benchmark result files: JSON, or gzipped JSON (.json.gz) for the large grids (the tracked tree travels to
the GPU machines with every call, under a size limit)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any


def read_results(path: str | Path) -> Any:
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())
