"""The benchmark grids: the blind held-out grid is fixed by its seed, distinct, and shares no call with the grids
the profile is fitted on or was checked against before."""
from dataclasses import replace
from functools import cache

import pytest

from attn_dispatch.benchmarking.cases import CASE_GRIDS, eval_blind_cases


def _shape(case):
    return replace(case, name="")


@cache
def _shapes(name: str) -> frozenset:
    """A grid's calls without their names, drawn once per test process (each test compares a grid with all others;
    that a seed gives the same draw twice is checked below)."""
    return frozenset(_shape(c) for c in CASE_GRIDS[name]())


def test_blind_grid_is_fixed_distinct_and_disjoint_from_other_grids():
    blind = eval_blind_cases()
    assert [c.label for c in blind] == [c.label for c in eval_blind_cases()]  # same seed, same draw
    assert len(blind) == 48 and len({_shape(c) for c in blind}) == 48
    others = set().union(*(_shapes(name) for name in CASE_GRIDS if not name.startswith("eval-blind")))
    assert not others & {_shape(c) for c in blind}
    assert {c.fmt for c in blind} >= {"bshd", "sbhd", "thd"}
    assert {c.d for c in blind} >= {64, 80, 96, 128, 192, 256}
    assert any(c.window for c in blind) and any(c.hkv != c.h for c in blind)
    assert sum(c.train for c in blind) == 24


def test_second_blind_grid_is_disjoint_from_every_earlier_grid():
    second = CASE_GRIDS["eval-blind2"]()
    assert len(second) == 48 and len({_shape(c) for c in second}) == 48
    earlier = set().union(*(_shapes(name) for name in CASE_GRIDS if name != "eval-blind2"))
    assert not earlier & {_shape(c) for c in second}


def test_third_blind_grid_is_disjoint_from_every_other_grid():
    third = CASE_GRIDS["eval-blind3"]()
    assert len(third) == 48 and len({_shape(c) for c in third}) == 48
    others = set().union(*(_shapes(name) for name in CASE_GRIDS if name != "eval-blind3"))
    assert not others & {_shape(c) for c in third}


def test_fit_drawn_grids_share_no_call_with_each_other_or_the_blind_grids():
    a, b = CASE_GRIDS["fit-drawn-a"](), CASE_GRIDS["fit-drawn-b"]()
    a_shapes, b_shapes = {_shape(c) for c in a}, {_shape(c) for c in b}
    assert len(a_shapes) == len(a) and len(b_shapes) == len(b) and not a_shapes & b_shapes
    blind = set().union(*(_shapes(name) for name in CASE_GRIDS if name.startswith("eval-blind")))
    assert not blind & (a_shapes | b_shapes)
    assert sum(1 for c in a if c.window) >= 30 and sum(1 for c in a if c.d == 192) >= 6


@pytest.mark.parametrize("name", ["eval-blind4", "eval-blind5", "eval-blind6", "eval-blind7", "eval-blind8",
                                  "eval-blind9", "eval-blind10", "eval-blind11", "eval-blind12",
                                  "eval-blind13", "eval-blind14", "eval-blind15", "eval-blind16",
                                  "eval-blind17", "eval-blind18", "eval-blind19", "eval-blind20", "eval-blind21",
                                  "eval-blind22", "eval-blind23", "eval-blind24",
                                  "eval-blind25"])
def test_later_blind_grids_cover_the_issue_and_are_disjoint_from_every_other_grid(name):
    grid = CASE_GRIDS[name]()
    assert len(grid) == 48 and len({_shape(c) for c in grid}) == 48
    others = set().union(*(_shapes(other) for other in CASE_GRIDS if other != name))
    assert not others & {_shape(c) for c in grid}  # fit-drawn, fit-thd and the other blind grids included
    assert {c.d for c in grid} >= {64, 80, 96, 128, 192, 256} and {c.fmt for c in grid} >= {"sbhd", "thd"}
    assert {c.window[1] == 0 for c in grid if c.window} == {True, False}  # causal and two-sided windows
    assert all(c.h % c.hkv == 0 for c in grid)


def test_fit_dense_grid_is_new_and_drawn_from_the_missed_families():
    dense = CASE_GRIDS["fit-dense"]()
    shapes = {_shape(c) for c in dense}
    assert len(dense) == len(shapes) == 76 and sum(c.train for c in dense) == 38
    others = set().union(*(_shapes(name) for name in CASE_GRIDS if name != "fit-dense"))
    assert not others & shapes  # no call of a fit grid, and none of a blind grid (before or after it)
    assert sum(c.name.split("-", 1)[1].startswith("enc") for c in dense) == 24
    assert {c.fmt for c in dense} >= {"thd", "sbhd"} and any(c.window for c in dense)


def test_fit_thd_grid_is_every_runnable_packed_call_of_the_fit_grids():
    refresh = CASE_GRIDS["fit-thd"]()
    assert all(c.fmt == "thd" and c.h % c.hkv == 0 for c in refresh)
    # fit-dense was measured after the thd host path changed: it needs no refresh
    fit_grids = [g for name, g in CASE_GRIDS.items()
                 if not name.startswith(("eval-blind", "fit-thd", "smoke", "fit-dense"))]
    packed = {_shape(c) for grid in fit_grids for c in grid() if c.fmt == "thd" and c.h % c.hkv == 0}
    assert {_shape(c) for c in refresh} == packed and len(refresh) == len(packed)
    blind = set().union(*(_shapes(name) for name in CASE_GRIDS if name.startswith("eval-blind")))
    assert not blind & packed


def test_grids_already_measured_keep_their_draws():
    """The measured grids' JSON names rows by these draws: a change to the families must not redraw them (the
    digests of their labels as committed when they were measured)."""
    import hashlib

    measured = {"eval-blind": "301871978b22ab7286bd071f2f2c9ca9", "eval-blind2": "072b425820337b2f0faf937afa6815e7",
                "eval-blind3": "3446527e549e97926400a1bb66ee627e", "fit-drawn-a": "3ad045ab61988eca69ce72f3337f31da",
                "fit-drawn-b": "a151a2549190c733d6b392759d7b6b95", "fit-drawn-c": "a49ab3d3f1499c8f1451a05bb1a65a96",
                "eval-blind4": "a18b0e651bcbb158be68911c45367a54", "eval-blind5": "d8ecede6e64522330adf7ccede64e931",
                "eval-blind6": "fa8bb4c63c1e7750e58614e0feddfd91",
                "eval-blind7": "6b8b7eefc7c4e26ec08e225f39b72052",  # blind7-15: committed before measured
                "eval-blind8": "6ab63c604c794a49ed6f9419dbf38fba", "eval-blind9": "b075a9e2a72e0fa2df2ab8269573564b",
                "eval-blind10": "1d05d2effdf6cb3c5cf4f8141f37c69b", "eval-blind11": "69febdea2fa0fee1af7207c67b5e1671",
                "eval-blind12": "8ae7b4372fa6efc7107e1f8873be19cf", "eval-blind13": "4f08c5f9a1aa6c07c8e4bfc24592430c",
                "eval-blind15": "6ca759fac4dd61300c3a748d3dbfc49e",
                "eval-blind14": "c40be9ac962011bef63e448499b355db",
                "eval-blind16": "6504fdfc34711fc4176acde441974295", "eval-blind17": "407999e4e7f20c9bab869fd6e88c4a03",
                "eval-blind18": "42020aebe25f464bdfc35f7bb63e8d43",
                "eval-blind19": "fa2894809535433690018c6e0af58119",
                "eval-blind20": "60b0902df3537b7185feabf2c6635288",  # blind20-21: committed before measured
                "eval-blind21": "93f2d6c121cf6ef03032723fe58f4f10",
                "eval-blind22": "88e413aabf4d1f7af15fd7244f6c94c1",  # blind22-24: committed before measured
                "eval-blind23": "99022b37cc1c783c697647bc3e5f6bc7", "eval-blind24": "5da4a33c4a5d54d8afcd8c3953e3890e",
                "eval-blind25": "85e7227665215e587000fec63e5d0427"}  # blind25: committed before measured
    for name, digest in measured.items():
        labels = str([c.label for c in CASE_GRIDS[name]()])
        assert hashlib.md5(labels.encode()).hexdigest() == digest, name
