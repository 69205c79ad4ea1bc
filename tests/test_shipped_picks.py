"""The shipped profile's picks stay what they were: every call of every committed grid, on a described H100 and
H200 with the full stack and with stock torch, gets the engine recorded in tests/data (first made at commit
9f4e03f). Regenerate it only for a deliberate change of the profile or the tables, with
`python tests/test_shipped_picks.py --write`, which prints how many picks moved and in which grids: say that, and
why, in the commit."""
from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import sys

import pytest

from attn_dispatch import selection
from attn_dispatch.benchmarking.cases import CASE_GRIDS
from attn_dispatch.params import AttentionParams, normalize_window, packed_fields
from attn_dispatch.platform import Platform

RECORDED = pathlib.Path(__file__).parent / "data" / "shipped_picks.json.gz"


def params_of(case) -> AttentionParams:
    """The call's params as the module builds them (a packed case with its own lengths carries their fills)."""
    fills = {}
    if case.seqlens:
        fills = packed_fields(case.seqlens, case.seqlens, case.s, case.skv, case.mask, case.window)
    return AttentionParams(**fills, dtype="bf16", qkv_format=case.fmt, batch_size=case.b, num_heads=case.h,
                           num_gqa_groups=case.hkv, head_dim_qk=case.d, head_dim_v=case.dv, max_seqlen_q=case.s,
                           max_seqlen_kv=case.skv, attn_mask_type=case.mask,
                           window_size=normalize_window(case.window, case.mask), is_training=case.train,
                           device_type="cuda").without_idle_window()


def platforms() -> dict[str, Platform]:
    described = {}
    for name in ("h100-cudnn9", "h200-cudnn9"):
        full = Platform.profile(name)
        described[name] = full
        described[name + "-stock"] = full.with_packages(cudnn_frontend=None, flash_attn_4=None)
    return described


def picks(grid: str) -> list[list[str]]:
    rows = []
    described = platforms()
    for case in CASE_GRIDS[grid]():
        try:
            params = params_of(case)
        except ValueError:
            rows.append([case.label, "invalid"])
            continue
        rows.append([case.label] + [selection.explain(params, plat).chosen for plat in described.values()])
    return rows


@pytest.fixture(scope="module")
def recorded() -> dict:
    with gzip.open(RECORDED, "rt") as f:
        return json.load(f)


@pytest.fixture(autouse=True)
def no_local_tuning(tmp_path, monkeypatch):
    for name in ("ATTN_DISPATCH_POLICY", "ATTN_DISPATCH_BACKEND", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN",
                 "NVTE_UNFUSED_ATTN", "NVTE_FUSED_ATTN_BACKEND", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ATTN_DISPATCH_CACHE_DIR", str(tmp_path))
    selection.clear_cache()
    yield
    selection.clear_cache()


def test_the_recording_covers_every_grid(recorded):
    assert recorded["platforms"] == list(platforms())
    assert set(recorded["grids"]) == set(CASE_GRIDS) - {"smoke"}


@pytest.mark.parametrize("grid", sorted(set(CASE_GRIDS) - {"smoke"}))
def test_the_shipped_profile_picks_what_it_picked(recorded, grid):
    now = picks(grid)
    changed = [(then, row) for then, row in zip(recorded["grids"][grid], now) if then != row]
    assert len(now) == len(recorded["grids"][grid]) and not changed, changed[:5]


def write() -> int:
    """Records every grid's picks anew; prints each pick that moved."""
    with gzip.open(RECORDED, "rt") as f:
        before = json.load(f)["grids"]
    grids = {grid: picks(grid) for grid in sorted(set(CASE_GRIDS) - {"smoke"})}
    moved = 0
    for grid, rows in grids.items():
        for then, now in zip(before.get(grid, []), rows):
            if then != now:
                moved += sum(a != b for a, b in zip(then[1:], now[1:]))
                print(f"{grid}: {now[0]}: {then[1:]} -> {now[1:]}")
    new = sorted(set(grids) - set(before))
    print(f"{moved} picks moved; new grids: {', '.join(new) or 'none'}")
    with gzip.GzipFile(RECORDED, "wb", mtime=0) as f:
        f.write(json.dumps({"platforms": list(platforms()), "grids": grids}).encode())
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Record the shipped profile's picks (tests/data).")
    ap.add_argument("--write", action="store_true", required=True)
    ap.parse_args()
    sys.exit(write())
