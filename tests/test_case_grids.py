"""The benchmark grids: the blind held-out grid is fixed by its seed, distinct, and shares no call with the grids
the profile is fitted on or was checked against before."""
from dataclasses import replace

from attn_dispatch.benchmarking.cases import CASE_GRIDS, eval_blind_cases


def _shape(case):
    return replace(case, name="")


def test_blind_grid_is_fixed_distinct_and_disjoint_from_other_grids():
    blind = eval_blind_cases()
    assert [c.label for c in blind] == [c.label for c in eval_blind_cases()]  # same seed, same draw
    assert len(blind) == 48 and len({_shape(c) for c in blind}) == 48
    others = {_shape(c) for name, grid in CASE_GRIDS.items() if not name.startswith("eval-blind") for c in grid()}
    assert not others & {_shape(c) for c in blind}
    assert {c.fmt for c in blind} >= {"bshd", "sbhd", "thd"}
    assert {c.d for c in blind} >= {64, 80, 96, 128, 192, 256}
    assert any(c.window for c in blind) and any(c.hkv != c.h for c in blind)
    assert sum(c.train for c in blind) == 24


def test_second_blind_grid_is_disjoint_from_every_earlier_grid():
    second = CASE_GRIDS["eval-blind2"]()
    assert len(second) == 48 and len({_shape(c) for c in second}) == 48
    earlier = {_shape(c) for name, grid in CASE_GRIDS.items() if name != "eval-blind2" for c in grid()}
    assert not earlier & {_shape(c) for c in second}


def test_third_blind_grid_is_disjoint_from_every_other_grid():
    third = CASE_GRIDS["eval-blind3"]()
    assert len(third) == 48 and len({_shape(c) for c in third}) == 48
    others = {_shape(c) for name, grid in CASE_GRIDS.items() if name != "eval-blind3" for c in grid()}
    assert not others & {_shape(c) for c in third}


def test_fit_drawn_grids_share_no_call_with_each_other_or_the_blind_grids():
    a, b = CASE_GRIDS["fit-drawn-a"](), CASE_GRIDS["fit-drawn-b"]()
    a_shapes, b_shapes = {_shape(c) for c in a}, {_shape(c) for c in b}
    assert len(a_shapes) == len(a) and len(b_shapes) == len(b) and not a_shapes & b_shapes
    blind = {_shape(c) for name, grid in CASE_GRIDS.items() if name.startswith("eval-blind") for c in grid()}
    assert not blind & (a_shapes | b_shapes)
    assert sum(1 for c in a if c.window) >= 30 and sum(1 for c in a if c.d == 192) >= 6
