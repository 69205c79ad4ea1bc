"""benchmarks/static_bound.py: the best fixed engine per call over runs of one grid, and how runs are grouped."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import static_bound  # noqa: E402
from attn_dispatch.benchmarking.results import read_results  # noqa: E402
from attn_dispatch.policy.profile import PROFILE_DIR, Profile  # noqa: E402

HELD_OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "held_out"
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="module")
def params() -> dict:
    """A real call's parameters (the profile predicts for them); the times below are made up per test."""
    return read_results(HELD_OUT / "blind19_h100_from0.json.gz")["rows"][1]["params"]


def write_run(path: Path, rows: list[tuple[str, dict[str, float]]], params: dict, grid: str = "g",
              fa4: str = "4.0.0b36") -> str:
    data = {"grid": grid, "environment": {"device": H100, "flash_attn_4": fa4},
            "rows": [{"label": label, "params": params, "times_ms": times} for label, times in rows]}
    path.write_text(json.dumps(data))
    return str(path)


def test_the_bound_is_the_engine_whose_worst_ratio_over_the_runs_is_least(tmp_path, params):
    a, b, c = "cudnn_fused:frontend", "flash_attn_4:cute", "flash_attn_2:torch"
    paths = [write_run(tmp_path / "r1.json", [("x", {a: 1.0, b: 1.1, c: 1.5, "sdpa": 1.1})], params),
             write_run(tmp_path / "r2.json", [("x", {a: 1.21, b: 1.2, c: 1.0, "sdpa": 1.0})], params)]
    (key, runs), = static_bound.groups(paths).items()
    assert key == ("g", "full", H100) and len(runs) == 2
    profile = Profile(json.loads((PROFILE_DIR / "sm90.json").read_text()))
    row, = static_bound.bound_rows(runs, False, profile, H100)
    # ratios to each run's fastest: a 1.0, 1.21 (the least mean); b 1.1, 1.2 (the least worst); c 1.5, 1.0
    assert row["best"] == b and row["best_worst"] == pytest.approx(1.2)
    assert row["sdpa_best"] == pytest.approx(min(max(1.0 / 1.1, 1.21), max(1.1 / 1.1, 1.2), max(1.5 / 1.1, 1.0)))
    assert row["pick_worst"] == pytest.approx({a: 1.21, b: 1.2, c: 1.5}[row["pick"]])


def test_a_resumed_run_joins_its_run_and_a_single_run_is_no_group(tmp_path, params):
    t = {"cudnn_fused:torch": 1.0, "flash_attn_2:torch": 1.1}
    first = write_run(tmp_path / "a_from0.json", [("x", t), ("y", t)], params, fa4="absent")
    rest = write_run(tmp_path / "a_from2.json", [("z", t)], params, fa4="absent")
    other = write_run(tmp_path / "b_from0.json", [("x", t), ("y", t), ("z", t)], params, fa4="absent")
    (key, runs), = static_bound.groups([first, rest, other]).items()
    assert key[1] == "stock" and len(runs) == 2
    assert sorted(len(rows) for _, rows in runs) == [3, 3]
    assert static_bound.groups([first, rest]) == {}  # one run, resumed: nothing to bound
