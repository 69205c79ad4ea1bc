"""Packed (thd) calls predicted from their lengths' distribution, and the held-out packed grid that checks it."""
from __future__ import annotations

from dataclasses import replace

from attn_dispatch.benchmarking.cases import (CASE_GRIDS, FIFTH_PACKED, FOURTH_PACKED, PACKED_2_SEED, PACKED_3_SEED,
                                              PACKED_4_SEED, PACKED_5_SEED, PACKED_6_SEED, PACKED_7_SEED, PACKED_SEEDS,
                                              SECOND_PACKED, SEVENTH_PACKED, SIXTH_PACKED, THIRD_PACKED, Case,
                                              _draw_packed, _packed_2_coverage, _packed_3_coverage, _packed_4_coverage,
                                              _packed_5_coverage, _packed_6_coverage, _packed_7_coverage,
                                              _packed_coverage)


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


def test_the_second_packed_grid_is_its_seeds_first_with_its_coverage_and_draws_from_other_ranges():
    grid = CASE_GRIDS["eval-blind-packed-2"]()
    assert len(grid) == 24 and sum(c.train for c in grid) == 12 and len({_shape(c) for c in grid}) == 24
    assert _packed_2_coverage(_draw_packed(PACKED_2_SEED, 12, SECOND_PACKED))
    assert not any(_packed_2_coverage(_draw_packed(s, 12, SECOND_PACKED)) for s in range(20261301, PACKED_2_SEED))
    for c in grid:
        assert c.fmt == "thd" and len(c.seqlens) == c.b <= 48 and max(c.seqlens) == c.s and c.h % c.hkv == 0
        assert sum(c.seqlens) <= max(24576, 2 * c.s) and min(c.seqlens) >= 16
    first = CASE_GRIDS["eval-blind-packed"]()
    assert not {c.s for c in grid} & {c.s for c in first}  # other longest lengths, other windows
    assert not {c.window[0] for c in grid if c.window} & {c.window[0] for c in first if c.window}
    others = {_shape(c) for name, cases in CASE_GRIDS.items() if name != "eval-blind-packed-2" for c in cases()}
    assert not others & {_shape(c) for c in grid}
    assert {c.d for c in grid} == {64, 96, 128, 192, 256} and max(c.b for c in grid) > 32


def test_the_third_packed_grid_is_its_seeds_first_with_its_coverage_and_draws_from_other_ranges():
    grid = CASE_GRIDS["eval-blind-packed-3"]()
    assert len(grid) == 24 and sum(c.train for c in grid) == 12 and len({_shape(c) for c in grid}) == 24
    assert _packed_3_coverage(_draw_packed(PACKED_3_SEED, 12, THIRD_PACKED))
    assert not any(_packed_3_coverage(_draw_packed(s, 12, THIRD_PACKED)) for s in range(20261401, PACKED_3_SEED))
    for c in grid:
        assert c.fmt == "thd" and len(c.seqlens) == c.b <= 64 and max(c.seqlens) == c.s and c.h % c.hkv == 0
        assert sum(c.seqlens) <= max(32768, 2 * c.s) and min(c.seqlens) >= 24
    earlier = CASE_GRIDS["eval-blind-packed"]() + CASE_GRIDS["eval-blind-packed-2"]()
    assert not {c.s for c in grid} & {c.s for c in earlier}  # other longest lengths; a window of another width
    assert {c.window[0] for c in grid if c.window} - {c.window[0] for c in earlier if c.window}
    others = {_shape(c) for name, cases in CASE_GRIDS.items() if name != "eval-blind-packed-3" for c in cases()}
    assert not others & {_shape(c) for c in grid}
    assert {c.d for c in grid} == {64, 96, 128, 192, 256} and max(c.b for c in grid) >= 40
    assert any(c.d == 256 and c.hkv != c.h and c.mask == "padding_causal" and not c.window for c in grid)


def test_the_fourth_packed_grid_is_its_seeds_first_with_its_coverage_and_draws_from_other_ranges():
    grid = CASE_GRIDS["eval-blind-packed-4"]()
    assert len(grid) == 24 and sum(c.train for c in grid) == 12 and len({_shape(c) for c in grid}) == 24
    assert _packed_4_coverage(_draw_packed(PACKED_4_SEED, 12, FOURTH_PACKED))
    assert not any(_packed_4_coverage(_draw_packed(s, 12, FOURTH_PACKED)) for s in range(20261501, PACKED_4_SEED))
    for c in grid:
        assert c.fmt == "thd" and len(c.seqlens) == c.b <= 56 and max(c.seqlens) == c.s and c.h % c.hkv == 0
        assert sum(c.seqlens) <= max(40960, 2 * c.s) and min(c.seqlens) >= 1
    earlier = [c for name in ("eval-blind-packed", "eval-blind-packed-2", "eval-blind-packed-3")
               for c in CASE_GRIDS[name]()]
    assert not {c.s for c in grid} & {c.s for c in earlier}  # other longest lengths and window widths
    assert not {c.window[0] for c in grid if c.window} & {c.window[0] for c in earlier if c.window}
    others = {_shape(c) for name, cases in CASE_GRIDS.items() if name != "eval-blind-packed-4" for c in cases()}
    assert not others & {_shape(c) for c in grid}
    assert {c.d for c in grid} == {64, 96, 128, 192, 256} and max(c.b for c in grid) >= 40
    assert any(c.window and c.window[1] == 0 and c.window[0] <= 512 and c.hkv != c.h for c in grid)
    assert any(c.d == 64 and c.b >= 32 and c.s <= 1024 for c in grid)


def test_the_fifth_packed_grid_is_its_seeds_first_with_its_coverage_and_draws_from_other_ranges():
    grid = CASE_GRIDS["eval-blind-packed-5"]()
    assert len(grid) == 24 and sum(c.train for c in grid) == 12 and len({_shape(c) for c in grid}) == 24
    assert _packed_5_coverage(_draw_packed(PACKED_5_SEED, 12, FIFTH_PACKED))
    assert not any(_packed_5_coverage(_draw_packed(s, 12, FIFTH_PACKED)) for s in range(20261601, PACKED_5_SEED))
    for c in grid:
        assert c.fmt == "thd" and len(c.seqlens) == c.b <= 60 and max(c.seqlens) == c.s and c.h % c.hkv == 0
        assert sum(c.seqlens) <= max(36864, 2 * c.s) and min(c.seqlens) >= 1
    earlier = [c for name in ("eval-blind-packed", "eval-blind-packed-2", "eval-blind-packed-3", "eval-blind-packed-4")
               for c in CASE_GRIDS[name]()]
    assert not {c.s for c in grid} & {c.s for c in earlier}  # other longest lengths and window widths
    assert not {c.window[0] for c in grid if c.window} & {c.window[0] for c in earlier if c.window}
    others = {_shape(c) for name, cases in CASE_GRIDS.items() if name != "eval-blind-packed-5" for c in cases()}
    assert not others & {_shape(c) for c in grid}
    assert _packed_4_coverage(_draw_packed(PACKED_5_SEED, 12, FIFTH_PACKED))
    # windowed long packs, whose forwards are where a provider without a rate was picked relative to FA2
    assert any(c.d == 128 and c.window and c.window[1] == 0 and c.window[0] >= 640 and c.s >= 8192 for c in grid)
    assert any(c.d != 128 and c.window and c.s >= 8192 for c in grid)
    assert sum(bool(c.window) and c.s >= 8192 and not c.train for c in grid) >= 4


def test_the_sixth_packed_grid_is_its_seeds_first_with_its_coverage_and_draws_from_other_ranges():
    grid = CASE_GRIDS["eval-blind-packed-6"]()
    assert len(grid) == 24 and sum(c.train for c in grid) == 12 and len({_shape(c) for c in grid}) == 24
    assert _packed_6_coverage(_draw_packed(PACKED_6_SEED, 12, SIXTH_PACKED))
    assert not any(_packed_6_coverage(_draw_packed(s, 12, SIXTH_PACKED)) for s in range(20261701, PACKED_6_SEED))
    for c in grid:
        assert c.fmt == "thd" and len(c.seqlens) == c.b <= 64 and max(c.seqlens) == c.s and c.h % c.hkv == 0
        assert sum(c.seqlens) <= max(28672, 2 * c.s) and min(c.seqlens) >= 1
    earlier = [c for name in ("eval-blind-packed", "eval-blind-packed-2", "eval-blind-packed-3", "eval-blind-packed-4",
                              "eval-blind-packed-5") for c in CASE_GRIDS[name]()]
    assert not {c.s for c in grid} & {c.s for c in earlier}  # other longest lengths and window widths
    assert not {c.window[0] for c in grid if c.window} & {c.window[0] for c in earlier if c.window}
    others = {_shape(c) for name, cases in CASE_GRIDS.items() if name != "eval-blind-packed-6" for c in cases()}
    assert not others & {_shape(c) for c in grid}
    assert _packed_5_coverage(_draw_packed(PACKED_6_SEED, 12, SIXTH_PACKED))
    # ragged and uniform lengths, GQA, head dims 64-256, windows of both kinds, training and inference
    assert {c.name.split("-", 1)[1] for c in grid} == set(SIXTH_PACKED.patterns)
    assert {c.d for c in grid} == {64, 96, 128, 192, 256} and any(c.hkv < c.h for c in grid)
    assert {c.window[1] == 0 for c in grid if c.window} == {True, False}
    # a pack of sequences under a tile long on average, a long near-uniform d128 causal pack, a d192 unmasked one
    assert any(c.b >= 32 and sum(c.seqlens) < 128 * c.b for c in grid)
    assert any(c.d == 128 and c.mask == "padding_causal" and not c.window and c.s >= 6144
               and c.name.split("-", 1)[1] in ("uniform", "near") for c in grid)
    assert any(c.d == 192 and c.mask == "padding" and not c.window for c in grid)


def test_seventh_packed_grid_is_new_and_covers_the_sixth_grids_misses():
    grid = CASE_GRIDS["eval-blind-packed-7"]()
    assert len(grid) == 24 and sum(c.train for c in grid) == 12 and len({_shape(c) for c in grid}) == 24
    assert _packed_7_coverage(_draw_packed(PACKED_7_SEED, 12, SEVENTH_PACKED))
    assert not any(_packed_7_coverage(_draw_packed(s, 12, SEVENTH_PACKED)) for s in range(PACKED_7_SEED - 1000,
                                                                                          PACKED_7_SEED))
    others = {_shape(c) for name, cases in CASE_GRIDS.items() if name != "eval-blind-packed-7" for c in cases()}
    assert not others & {_shape(c) for c in grid}
    assert any(c.d == 256 and c.window and c.window[1] == 0 and c.window[0] <= 320 for c in grid)
    assert any(c.d == 128 and c.mask == "padding" and not c.window and c.s >= 3072 for c in grid)


def test_fit_windows_grid_is_dense_windowed_and_new():
    from attn_dispatch.benchmarking.cases import FIT_WINDOWS_SEED, _fit_windows_coverage, fit_windows_cases

    grid = CASE_GRIDS["fit-windows"]()
    assert len(grid) == 24 and all(c.fmt == "bshd" and c.window and 112 <= c.window[0] <= 768 for c in grid)
    assert _fit_windows_coverage(grid)
    assert not any(_fit_windows_coverage(fit_windows_cases(s)) for s in range(20261901, FIT_WINDOWS_SEED))
    others = {_shape(c) for name, cases in CASE_GRIDS.items() if name != "fit-windows" for c in cases()}
    assert not others & {_shape(c) for c in grid}


def test_fit_unmasked_grid_fills_the_dense_profiles_d96_and_d192_unmasked_gap_with_new_calls():
    grid = CASE_GRIDS["fit-unmasked"]()
    assert len(grid) == 12 and all(c.fmt == "bshd" and c.mask == "no_mask" and c.s >= 2048 for c in grid)
    assert {c.d for c in grid} == {96, 192} and any(c.hkv and c.hkv < c.h for c in grid)
    others = {_shape(c) for name, cases in CASE_GRIDS.items() if name != "fit-unmasked" for c in cases()}
    assert not others & {_shape(c) for c in grid}


def _assert_new_grid(name: str) -> list[Case]:
    """24 rows, half training, each a call no other grid holds."""
    grid = CASE_GRIDS[name]()
    assert len(grid) == 24 and sum(c.train for c in grid) == 12 and len({_shape(c) for c in grid}) == 24
    others = {_shape(c) for other, cases in CASE_GRIDS.items() if other != name for c in cases()}
    assert not others & {_shape(c) for c in grid}
    return grid


def test_eighth_packed_grid_and_the_held_out_windows_are_new():
    from attn_dispatch.benchmarking.cases import EIGHTH_PACKED, PACKED_8_SEED

    for name in ("eval-blind-packed-8", "eval-windows"):
        _assert_new_grid(name)
    assert _packed_7_coverage(_draw_packed(PACKED_8_SEED, 12, EIGHTH_PACKED))


def test_ninth_and_tenth_packed_grids_are_new_and_cover_a_long_unmasked_d128_pack():
    from attn_dispatch.benchmarking.cases import (NINTH_PACKED, PACKED_9_SEED, PACKED_10_SEED, TENTH_PACKED,
                                                  _packed_9_coverage)

    for name, seed, family in (("eval-blind-packed-9", PACKED_9_SEED, NINTH_PACKED),
                               ("eval-blind-packed-10", PACKED_10_SEED, TENTH_PACKED)):
        grid = _assert_new_grid(name)
        assert _packed_9_coverage(_draw_packed(seed, 12, family))
        assert any(c.d == 128 and c.mask == "padding" and not c.window and c.s >= 6144 for c in grid)
    assert not any(_packed_9_coverage(_draw_packed(s, 12, NINTH_PACKED)) for s in range(20271601, PACKED_9_SEED))


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


# --- the fills a packed call carries --------------------------------------------------------------------------------
import math  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attn_dispatch.call_args import CallArgs  # noqa: E402
from attn_dispatch.params import (AttentionParams, packed_fill_bucket, packed_fills, packed_window_fill,  # noqa: E402
                                  score_tiles)
from attn_dispatch.policy.cost_model import CostModel, measured_pack_fills, packed_share, work  # noqa: E402
from attn_dispatch.sequences import sequence_info  # noqa: E402


def brute_tiles(n_q: int, n_kv: int, causal: bool, bottom_right: bool, tile: int) -> int:
    """Tiles holding at least one attended (query, key) pair, by visiting every pair."""
    offset = n_kv - n_q if bottom_right else 0
    seen = {(i // tile, j // tile) for i in range(n_q) for j in range(n_kv) if not causal or j <= i + offset}
    return len(seen)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(0, 40), st.booleans(), st.booleans(), st.sampled_from([1, 4, 8]))
def test_score_tiles_counts_the_tiles_that_hold_an_attended_pair(n_q, n_kv, causal, bottom_right, tile):
    assert score_tiles(n_q, n_kv, causal, bottom_right, tile) == brute_tiles(n_q, n_kv, causal, bottom_right, tile)


def brute_window_tiles(n_q: int, n_kv: int, causal: bool, bottom_right: bool, tile: int,
                       window: tuple[int, int]) -> int:
    """brute_tiles under a window (left, right; -1 unbounded), aligned bottom right unless top-left causal."""
    offset = n_kv - n_q if bottom_right or not causal else 0
    left, right = window
    right = 0 if causal else right
    seen = {(i // tile, j // tile) for i in range(n_q) for j in range(n_kv)
            if (left < 0 or j >= i + offset - left) and (right < 0 or j <= i + offset + right)}
    return len(seen)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.booleans(), st.booleans(), st.sampled_from([1, 4, 8]),
       st.integers(-1, 20), st.integers(-1, 20), st.booleans())
def test_windowed_score_tiles_count_the_tiles_that_hold_an_attended_pair(n_q, n_kv, causal, bottom_right, tile,
                                                                          left, right, self_attention):
    n_kv = n_q if self_attention else n_kv  # a packed sequence's own keys take the closed form
    window = (left, 0 if causal else right)
    assert score_tiles(n_q, n_kv, causal, bottom_right, tile, window) == \
        brute_window_tiles(n_q, n_kv, causal, bottom_right, tile, window)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=6), st.sampled_from(["padding", "padding_causal"]),
       st.integers(0, 30))
def test_the_window_fill_is_the_bucketed_share_of_the_longest_ones_windowed_tiles(lengths, mask, left):
    causal, longest = mask == "padding_causal", max(lengths)
    window = (left, 0 if causal else left)
    found = packed_window_fill(tuple(lengths), tuple(lengths), longest, longest, mask, window, tile=8)
    own = sum(brute_window_tiles(n, n, causal, False, 8, window) for n in lengths)
    exact = own / (len(lengths) * brute_window_tiles(longest, longest, causal, False, 8, window))
    assert abs(math.log2(found) - math.log2(exact)) <= 0.125 + 1e-12
    assert packed_window_fill(tuple(lengths), tuple(lengths), longest, longest, mask, (-1, -1)) is None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=6), st.sampled_from(["padding", "padding_causal"]))
def test_packed_fills_are_the_bucketed_share_of_the_full_length_tiles_and_tokens(lengths, mask):
    causal = mask == "padding_causal"
    longest = max(lengths)
    fill, tokens = packed_fills(tuple(lengths), tuple(lengths), longest, longest, mask, tile=8)
    own = sum(brute_tiles(n, n, causal, False, 8) for n in lengths)
    exact = own / (len(lengths) * brute_tiles(longest, longest, causal, False, 8))
    assert abs(math.log2(fill) - math.log2(exact)) <= 0.125 + 1e-12  # the nearest quarter octave
    assert abs(math.log2(tokens) - math.log2(sum(lengths) / (len(lengths) * longest))) <= 0.125 + 1e-12


def test_the_bucket_is_a_quarter_octave_and_stable_inside_it():
    for x in (1.0, 0.9, 0.5, 0.3, 0.01, 1e-9):
        b = packed_fill_bucket(x)
        assert b == packed_fill_bucket(b) and 0 < b <= 1
        assert x < 2 ** -12 or abs(math.log2(b) - math.log2(x)) <= 0.125 + 1e-12
    assert packed_fill_bucket(0.26) == packed_fill_bucket(0.24) == 0.25


def thd_info(lengths: list[int], mask: str = "padding_causal", window: tuple[int, int] = (-1, -1)):
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    q = torch.zeros(int(cu[-1]), 2, 8)
    return sequence_info("thd", mask, q, q, CallArgs(cu_seqlens_q=cu, cu_seqlens_kv=cu), window)


def test_a_windowed_pack_keys_its_plan_on_its_window_fill_and_its_work_follows_it():
    # one long sequence among short ones under a causal window: the short ones cost their own causal half, far under
    # the longest's band per token, which the token fill alone would charge them
    lengths = [3968] + [23 + 7 * i for i in range(63)]
    plain, windowed = thd_info(lengths), thd_info(lengths, window=(640, 0))
    assert plain.window_fill is None and plain.plan_key() != windowed.plan_key()
    assert windowed.window_fill == packed_window_fill(*windowed.lengths, 3968, 3968, "padding_causal", (640, 0))
    assert (windowed.fill, windowed.token_fill) == (plain.fill, plain.token_fill)
    call = thd(batch_size=64, max_seqlen_q=3968, window_size=(640, 0), packed_fill=windowed.fill,
               packed_token_fill=windowed.token_fill, packed_window_fill=windowed.window_fill)
    assert packed_share(call) == windowed.window_fill
    assert windowed.window_fill < 0.7 * packed_share(call.replace(packed_window_fill=None))
    assert work(call) == pytest.approx(windowed.window_fill * work(call, CostModel(packed_lengths=False)), rel=1e-12)


def test_a_packed_call_reads_its_fills_from_its_lengths_and_keys_its_plan_on_the_buckets():
    ragged = thd_info([7000, 33, 500, 1200, 3000, 80, 2000, 4000])
    assert (ragged.fill, ragged.token_fill) == packed_fills(*ragged.lengths, 7000, 7000, "padding_causal")
    assert ragged.fill < 0.25 and ragged.token_fill < 0.35
    # another pack of the same count and longest, lengths a little different: the same bucket, the same plan
    nearby = thd_info([7000, 40, 480, 1250, 3000, 90, 2010, 3990])
    assert nearby.plan_key() == ragged.plan_key()
    uniform = thd_info([7000] * 8)
    assert uniform.fill == uniform.token_fill == 1.0 and uniform.plan_key() != ragged.plan_key()


def test_fills_are_validated_with_the_field_named():
    for bad in (0.0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match="packed_fill"):
            AttentionParams(qkv_format="thd", packed_fill=bad, packed_token_fill=0.5)
    assert "packed-fill=0.25" in AttentionParams(qkv_format="thd", packed_fill=0.25, packed_token_fill=0.5).describe()


# --- the profile's work of a packed call ------------------------------------------------------------------------------
def thd(**kw) -> AttentionParams:
    base = dict(dtype="bf16", qkv_format="thd", batch_size=8, num_heads=32, num_gqa_groups=8, head_dim_qk=128,
                max_seqlen_q=7000, attn_mask_type="padding_causal", is_training=True)
    return AttentionParams(**{**base, **kw})


def test_packed_work_is_the_full_length_work_times_the_fill():
    full = work(thd(), CostModel(packed_lengths=False))
    assert work(thd(packed_fill=0.25, packed_token_fill=0.5)) == pytest.approx(0.25 * full, rel=1e-12)
    assert work(thd(packed_fill=1.0, packed_token_fill=1.0)) == pytest.approx(full, rel=1e-12)
    dense = thd(qkv_format="bshd", attn_mask_type="causal", packed_fill=None)
    assert work(dense) == work(dense, CostModel(packed_lengths=False))  # dense calls are unchanged


def test_a_windowed_pack_counts_at_most_its_tokens_share_of_the_band():
    # one 7000-token sequence and seven of 2000 under a 256-token window: the band is ~linear in the length, so the
    # tokens' share bounds it, well above the pairs' share
    lengths = [7000] + [2000] * 7
    fill, tokens = packed_fills(tuple(lengths), tuple(lengths), 7000, 7000, "padding_causal")
    p = thd(window_size=(256, 0), packed_fill=fill, packed_token_fill=tokens)
    share = packed_share(p)
    assert share == pytest.approx(tokens, rel=1e-12) and share > 1.5 * fill
    # the exact windowed tiles of these sequences, against the share the model takes
    exact = sum(_band_tiles(n, 256) for n in lengths) / (8 * _band_tiles(7000, 256))
    assert 0.8 < share / exact < 1.35


def _band_tiles(n: int, left: int, tile: int = 128) -> int:
    rows = -(-n // tile)
    return sum(min(i, (i * tile + tile - 1) // tile) - max(0, (i * tile - left) // tile) + 1 for i in range(rows))


def test_unknown_lengths_take_the_measured_packs_expected_fill():
    rng = random.Random(7)
    for batch, longest, mask in ((8, 4096, "padding_causal"), (2, 16384, "padding_causal"), (32, 1024, "padding")):
        draws = []
        for _ in range(400):  # the harness's draw: the first sequence the longest, the others in [max/2, max]
            lengths = [longest] + [rng.randint(longest // 2, longest) for _ in range(batch - 1)]
            causal = mask == "padding_causal"
            own = sum(score_tiles(n, n, causal, False, 128) for n in lengths)
            draws.append(own / (batch * score_tiles(longest, longest, causal, False, 128)))
        expected, _ = measured_pack_fills(batch, longest, longest, mask, 128)
        assert expected == pytest.approx(sum(draws) / len(draws), rel=0.02)
    assert packed_share(thd()) == pytest.approx(measured_pack_fills(8, 7000, 7000, "padding_causal", 128)[0])


def test_the_module_s_decision_carries_the_pack_s_fills():
    """What the module decides on (and explain() answers) is the pack's own fill, not the expected one."""
    from attn_dispatch import DotProductAttention

    lens = [33, 700, 90, 512]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    t = int(cu[-1])
    q, k, v = (torch.randn(t, 4, 32) for _ in range(3))
    module = DotProductAttention(4, 32, qkv_format="thd", attn_mask_type="padding_causal").eval()
    with torch.no_grad():
        module(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=700, max_seqlen_kv=700)
    params = module.last_decision.params
    want = packed_fills(tuple(lens), tuple(lens), 700, 700, "padding_causal")
    assert (params["packed_fill"], params["packed_token_fill"]) == want
    assert want[0] < 0.5  # a ragged pack: far from the batch x max it used to be counted as
    explained = module.explain(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=700, max_seqlen_kv=700)
    assert explained.params == module.last_decision.params


def test_eleventh_packed_grid_is_new_and_covers_grid_10s_misses():
    from attn_dispatch.benchmarking.cases import ELEVENTH_PACKED, PACKED_11_SEED, _packed_11_coverage

    grid = _assert_new_grid("eval-blind-packed-11")
    assert _packed_11_coverage(_draw_packed(PACKED_11_SEED, 12, ELEVENTH_PACKED))
    assert any(c.d == 128 and c.mask == "padding_causal" and not c.window and c.hkv == 1 for c in grid)
    assert not any(_packed_11_coverage(_draw_packed(s, 12, ELEVENTH_PACKED)) for s in range(20288700, PACKED_11_SEED))


def test_twelfth_packed_grid_is_new_and_covers_grid_11s_misses():
    from attn_dispatch.benchmarking.cases import PACKED_12_SEED, TWELFTH_PACKED, _packed_12_coverage

    grid = _assert_new_grid("eval-blind-packed-12")
    assert _packed_12_coverage(_draw_packed(PACKED_12_SEED, 12, TWELFTH_PACKED))
    assert any(c.d == 128 and c.window == (208, 0) for c in grid)
    assert not any(_packed_12_coverage(_draw_packed(s, 12, TWELFTH_PACKED)) for s in range(20291201, PACKED_12_SEED))


def test_thirteenth_packed_grid_is_new_and_covers_grid_12s_misses():
    from attn_dispatch.benchmarking.cases import PACKED_13_SEED, THIRTEENTH_PACKED, _packed_13_coverage

    grid = _assert_new_grid("eval-blind-packed-13")
    assert _packed_13_coverage(_draw_packed(PACKED_13_SEED, 12, THIRTEENTH_PACKED))
    assert any(c.d == 128 and c.window == (192, 0) for c in grid)
    assert any(c.d == 64 and c.mask == "padding" and not c.window for c in grid)
    assert not any(_packed_13_coverage(_draw_packed(s, 12, THIRTEENTH_PACKED)) for s in range(20291501, PACKED_13_SEED))


def test_fourteenth_packed_grid_is_new_and_covers_grid_13s_misses():
    from attn_dispatch.benchmarking.cases import FOURTEENTH_PACKED, PACKED_14_SEED, _packed_14_coverage

    grid = _assert_new_grid("eval-blind-packed-14")
    assert _packed_14_coverage(_draw_packed(PACKED_14_SEED, 12, FOURTEENTH_PACKED))
    assert any(c.d == 128 and c.window == (224, 0) for c in grid)
    assert any(c.d == 64 and c.window and c.window[1] > 0 for c in grid)
    assert not any(_packed_14_coverage(_draw_packed(s, 12, FOURTEENTH_PACKED)) for s in range(20291701, PACKED_14_SEED))


def test_fifteenth_packed_grid_is_new_and_covers_grid_14s_misses():
    from attn_dispatch.benchmarking.cases import FIFTEENTH_PACKED, PACKED_15_SEED, _packed_15_coverage

    grid = _assert_new_grid("eval-blind-packed-15")
    assert _packed_15_coverage(_draw_packed(PACKED_15_SEED, 12, FIFTEENTH_PACKED))
    assert any(c.d == 192 and c.mask == "padding_causal" for c in grid)
    assert any(c.d == 256 and c.window and c.window[1] == 0 for c in grid)
    assert not any(_packed_15_coverage(_draw_packed(s, 12, FIFTEENTH_PACKED)) for s in range(20292101, PACKED_15_SEED))


def test_sixteenth_packed_grid_is_new_and_covers_grid_15s_miss():
    from attn_dispatch.benchmarking.cases import PACKED_16_SEED, SIXTEENTH_PACKED, _packed_16_coverage

    grid = _assert_new_grid("eval-blind-packed-16")
    assert _packed_16_coverage(_draw_packed(PACKED_16_SEED, 12, SIXTEENTH_PACKED))
    assert any(c.d == 128 and c.mask == "padding_causal" and not c.window and c.b >= 32 for c in grid)
    assert any(c.d == 64 and c.window and c.window[1] == 0 and c.window[0] <= 1024 for c in grid)
    assert not any(_packed_16_coverage(_draw_packed(s, 12, SIXTEENTH_PACKED)) for s in range(20292901, PACKED_16_SEED))


def test_seventeenth_packed_grid_is_new_and_covers_grid_16s_misses():
    from attn_dispatch.benchmarking.cases import PACKED_17_SEED, SEVENTEENTH_PACKED, _packed_17_coverage

    grid = _assert_new_grid("eval-blind-packed-17")
    assert _packed_17_coverage(_draw_packed(PACKED_17_SEED, 12, SEVENTEENTH_PACKED))
    assert any(c.d == 256 and c.mask == "padding_causal" and not c.window and c.b >= 48 for c in grid)
    assert any(c.d == 256 and c.window and c.window[1] > 0 for c in grid)
    assert not any(_packed_17_coverage(_draw_packed(s, 12, SEVENTEENTH_PACKED))
                   for s in range(20293501, PACKED_17_SEED))


def test_eighteenth_packed_grid_is_new_and_covers_grid_17s_misses():
    from attn_dispatch.benchmarking.cases import EIGHTEENTH_PACKED, PACKED_18_SEED, _packed_18_coverage

    grid = _assert_new_grid("eval-blind-packed-18")
    assert _packed_18_coverage(_draw_packed(PACKED_18_SEED, 12, EIGHTEENTH_PACKED))
    assert any(c.d == 96 and c.mask == "padding" and not c.window and c.b >= 32 for c in grid)
    assert any(c.d == 64 and c.window and c.window[1] == 0 and c.window[0] <= 640 for c in grid)
    assert not any(_packed_18_coverage(_draw_packed(s, 12, EIGHTEENTH_PACKED))
                   for s in range(20293701, PACKED_18_SEED))


def test_nineteenth_packed_grid_is_new_and_covers_grid_18s_misses():
    from attn_dispatch.benchmarking.cases import NINETEENTH_PACKED, PACKED_19_SEED, _packed_19_coverage

    grid = _assert_new_grid("eval-blind-packed-19")
    assert _packed_19_coverage(_draw_packed(PACKED_19_SEED, 12, NINETEENTH_PACKED))
    assert any(c.d == 128 and c.window and c.window[1] > 0 and c.h >= 4 * c.hkv for c in grid)
    assert any(c.d == 64 and c.window and c.window[1] == 0 and c.window[0] <= 640 for c in grid)
    assert not any(_packed_19_coverage(_draw_packed(s, 12, NINETEENTH_PACKED))
                   for s in range(20294401, PACKED_19_SEED))


def test_twentieth_packed_grid_is_new_and_covers_grid_19s_misses():
    from attn_dispatch.benchmarking.cases import PACKED_20_SEED, TWENTIETH_PACKED, _packed_20_coverage

    grid = _assert_new_grid("eval-blind-packed-20")
    assert _packed_20_coverage(_draw_packed(PACKED_20_SEED, 12, TWENTIETH_PACKED))
    assert any(c.d == 96 and c.mask == "padding" and not c.window and c.b >= 16 and c.s >= 2048 for c in grid)
    assert any(c.d == 192 and c.mask == "padding_causal" and not c.window for c in grid)
    assert any(c.d == 128 and c.mask == "padding_causal" and not c.window and c.b >= 16 and c.s >= 4096
               for c in grid)
    assert not any(_packed_20_coverage(_draw_packed(s, 12, TWENTIETH_PACKED))
                   for s in range(20295101, PACKED_20_SEED))


def test_twenty_first_packed_grid_is_new_and_covers_grid_20s_miss():
    from attn_dispatch.benchmarking.cases import PACKED_21_SEED, TWENTY_FIRST_PACKED, _packed_21_coverage

    grid = _assert_new_grid("eval-blind-packed-21")
    assert _packed_21_coverage(_draw_packed(PACKED_21_SEED, 12, TWENTY_FIRST_PACKED))
    assert any(c.d == 192 and c.window and c.window[1] > 0 and 4 * c.window[0] <= c.s for c in grid)
    assert not any(_packed_21_coverage(_draw_packed(s, 12, TWENTY_FIRST_PACKED))
                   for s in range(20296501, PACKED_21_SEED))


def test_twenty_second_packed_grid_is_new_and_covers_grid_21s_miss():
    from attn_dispatch.benchmarking.cases import PACKED_22_SEED, TWENTY_SECOND_PACKED, _packed_22_coverage

    grid = _assert_new_grid("eval-blind-packed-22")
    assert _packed_22_coverage(_draw_packed(PACKED_22_SEED, 12, TWENTY_SECOND_PACKED))
    assert any(c.window and c.window[1] == 0 and c.b >= 48 and c.s >= 2 * c.window[0] for c in grid)
    assert not any(_packed_22_coverage(_draw_packed(s, 12, TWENTY_SECOND_PACKED))
                   for s in range(20296601, PACKED_22_SEED))


def test_a_packs_fills_follow_each_modules_mask_on_the_same_cu_seqlens():
    """The sequence facts are cached on the cu_seqlens tensors; the fills depend on the mask type, so a causal
    module reading the tensors a padding module read first gets its own (causal) fill."""
    import torch

    from attn_dispatch import DotProductAttention
    from attn_dispatch.params import packed_fills

    cu = torch.tensor([0, 128, 384], dtype=torch.int32)
    q, k, v = (torch.randn(384, 4, 64) for _ in range(3))
    fills = {}
    for mask in ("padding", "padding_causal"):
        module = DotProductAttention(4, 64, qkv_format="thd", attn_mask_type=mask).eval()
        explained = module.explain(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=256, max_seqlen_kv=256)
        fills[mask] = explained.params["packed_fill"]
        assert fills[mask] == packed_fills((128, 256), (128, 256), 256, 256, mask)[0]
    assert fills["padding"] != fills["padding_causal"]


def test_a_windowed_modules_question_carries_its_window_fill_and_a_plain_ones_on_the_same_tensors_none():
    import torch

    from attn_dispatch import DotProductAttention

    cu = torch.tensor([0, 96, 1120], dtype=torch.int32)
    q, k, v = (torch.randn(1120, 4, 64) for _ in range(3))
    found = {}
    for window in ((128, 0), None, (4096, 0)):  # the last masks nothing at these lengths: dropped, fill and all
        module = DotProductAttention(4, 64, qkv_format="thd", attn_mask_type="padding_causal",
                                     window_size=window).eval()
        found[window] = module.explain(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=1024,
                                       max_seqlen_kv=1024).params
    assert found[(128, 0)]["packed_window_fill"] == packed_window_fill((96, 1024), (96, 1024), 1024, 1024,
                                                                       "padding_causal", (128, 0))
    assert found[None]["packed_window_fill"] is None
    assert found[(4096, 0)]["packed_window_fill"] is None and tuple(found[(4096, 0)]["window_size"]) == (-1, 0)
    assert found[(128, 0)]["packed_fill"] == found[None]["packed_fill"]
