"""Packed (thd) calls predicted from their lengths' distribution, and the held-out packed grid that checks it."""
from __future__ import annotations

from dataclasses import replace

from attn_dispatch.benchmarking.cases import CASE_GRIDS, PACKED_SEEDS, Case, _draw_packed, _packed_coverage


def _shape(case: Case) -> Case:
    return replace(case, name="")


def test_packed_grid_is_fixed_by_its_seed_and_the_first_with_its_coverage():
    grid = CASE_GRIDS["eval-blind-packed"]()
    assert [c.label for c in grid] == [c.label for c in CASE_GRIDS["eval-blind-packed"]()]
    assert len(grid) == 24 and sum(c.train for c in grid) == 12 and len({_shape(c) for c in grid}) == 24
    seed = PACKED_SEEDS[0]
    assert _packed_coverage(_draw_packed(seed, 12))
    assert not any(_packed_coverage(_draw_packed(s, 12)) for s in range(20261201, seed))


def test_packed_grid_holds_its_own_lengths_and_shares_no_call_with_other_grids():
    grid = CASE_GRIDS["eval-blind-packed"]()
    for c in grid:
        assert c.fmt == "thd" and len(c.seqlens) == c.b and max(c.seqlens) == c.s and min(c.seqlens) >= 1
        assert c.h % c.hkv == 0
    others = {_shape(c) for name, cases in CASE_GRIDS.items() if name != "eval-blind-packed" for c in cases()}
    assert not others & {_shape(c) for c in grid}
    assert {c.d for c in grid} >= {64, 256} and any(c.hkv != c.h for c in grid)
    assert {c.window[1] == 0 for c in grid if c.window} == {True, False}
    assert any(min(c.seqlens) == c.s for c in grid) and any(min(c.seqlens) < c.s // 8 for c in grid)


def test_a_case_refuses_lengths_that_do_not_fit_it():
    for bad in (dict(b=2, s=100, seqlens=(100, 50, 20)), dict(b=2, s=100, seqlens=(90, 50)),
                dict(b=2, s=100, seqlens=(100, 0))):
        try:
            Case(h=8, d=64, mask="padding", fmt="thd", **bad)
        except ValueError as exc:
            assert "seqlens" in str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")
    try:
        Case(b=2, s=100, h=8, d=64, seqlens=(100, 50))
    except ValueError as exc:
        assert "fmt='thd'" in str(exc)
    else:
        raise AssertionError("seqlens accepted on a bshd case")
    assert Case(b=2, s=100, h=8, d=64, mask="padding", fmt="thd", seqlens=[100, 7]).seqlens == (100, 7)
