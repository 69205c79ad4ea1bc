"""A provider the rate rows never timed (FlexAttention's) is predicted on a packed call relative to the providers the
decision compares: its time over theirs on the nearest measured packed calls of the call's kind and head dims (the
profile's `packed` entries), moved to the call's mean sequence length along the slope those entries show, x their
predicted times (Profile.relative); checked against the formula recomputed here in float64 from the entries, on
synthetic profiles."""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import pytest

from attn_dispatch import AttentionParams, Platform
from attn_dispatch.params import packed_fills
from attn_dispatch.policy import AutoPolicy
from attn_dispatch.policy.cost_model import COST_MODEL, features
from attn_dispatch.policy.profile import Profile
from attn_dispatch.policy.profile_build import EAGER_FALLBACK, build, packed_entries

MACHINE = "test GPU"
KNOWN = ("x:fast", "x:slow")  # providers with rates: dense rows at 400 and 200 TFLOP/s of every kind used here
NEW = "z:new"  # timed on the packed calls only


def dense_rows() -> list[dict]:
    rows = []
    for i, (s, d, train, window) in enumerate((s, d, t, w) for s in (1024, 4096, 16384) for d in (64, 128)
                                               for t in (True, False) for w in (None, (512, 0))):
        p = AttentionParams(batch_size=2, num_heads=16, head_dim_qk=d, max_seqlen_q=s, attn_mask_type="causal",
                            window_size=window, is_training=train)
        flops = 4.0 * 2 * 16 * s * min(s, window[0] + 1 if window else s) * d * (3.5 if train else 1.0)
        rows.append({"label": f"d{i}", "params": p.to_dict(),
                     "times_ms": {"x:fast": flops / 4e11 + 0.05, "x:slow": flops / 2e11 + 0.05}})
    return rows


def pack(s: int, lengths: tuple[int, ...], *, d: int = 128, window=(512, 0), train: bool = False,
         heads: int = 16) -> AttentionParams:
    fill, tokens = packed_fills(lengths, lengths, s, s, "padding_causal")
    return AttentionParams(qkv_format="thd", batch_size=len(lengths), num_heads=heads, head_dim_qk=d,
                           max_seqlen_q=s, attn_mask_type="padding_causal", window_size=window, is_training=train,
                           packed_fill=fill, packed_token_fill=tokens)


def packed_row(i: int, p: AttentionParams, times: dict[str, float]) -> dict:
    return {"label": f"p{i}", "params": p.to_dict(), "times_ms": times}


def profile_with(packed_rows: list[dict], model=COST_MODEL) -> Profile:
    data = build([{"machine": MACHINE, "rows": dense_rows()}], arch="sm90", stack={}, date="", model=model,
                 packed=[{"machine": MACHINE, "rows": packed_rows}] if packed_rows else [])
    return Profile(data, model=model)


# measured packs of the target's kind (d128 causal-window forwards): z:new faster than x:fast on the long ones, at
# other ratios to each provider so that the weights and the geometric mean show, and slower the shorter the pack's
# sequences are (the slope); 5x x:fast on the far one of 40 short sequences
NEAR = [packed_row(0, pack(8192, (8192, 3000, 100)), {"x:fast": 2.0, "x:slow": 4.1, NEW: 1.5}),
        packed_row(1, pack(4096, (4096, 4096, 60, 900)), {"x:fast": 1.0, "x:slow": 1.9, NEW: 0.9}),
        packed_row(2, pack(1024, (1024,) * 40), {"x:fast": 0.5, "x:slow": 1.0, NEW: 2.5}),
        packed_row(3, pack(16384, (16384, 12000, 9000, 30, 1200, 500)), {"x:fast": 3.0, "x:slow": 6.6, NEW: 2.0})]
TARGET = pack(12288, (12288, 5000, 40, 700, 2000))
SIZES = ("d_qk", "d_v", "sq", "skv", "span", "bh", "gqa")


def log2_mean_length(p: AttentionParams) -> float:
    return math.log2(p.packed_token_fill * p.max_seqlen_q)


def slope(rows: list[dict], kind: tuple, dims: list[float], reference: str) -> float:
    """The least-squares slope of log(NEW / reference) over log2 of the mean length, over the rows of one kind and
    head dims (the only group of those rows with more than one member in these tests)."""
    points = []
    for row in rows:
        q = AttentionParams(**row["params"])
        k2, l2, _ = features(q)
        if k2 == kind and [round(l2[f], 4) for f in SIZES[:2]] == dims and reference in row["times_ms"]:
            points.append((round(log2_mean_length(q), 4), math.log(row["times_ms"][NEW] / row["times_ms"][reference])))
    return statistics.linear_regression(*zip(*points)).slope


def expected(profile: Profile, p: AttentionParams, rows: list[dict], among: list[str], *, k: int = 3,
             moved: bool = True) -> float:
    """The formula in float64 from the rows: the k nearest (the rate model's distance), each giving NEW's time over
    each reference's there, moved along the slope from its mean length to the call's (with `moved`), times that
    reference's prediction here (geometric mean), weighted 1/(dist + 0.25); a packed call's x the model's margin."""
    predicted = profile.predict(p, machine=MACHINE).times_ms
    kind, log2, _ = features(p)
    here = [log2[f] for f in SIZES]
    dims = [round(v, 4) for v in here[:2]]
    found = []
    for row in rows:
        q = AttentionParams(**row["params"])
        k2, l2, _ = features(q)
        there = [round(l2[f], 4) for f in SIZES]
        if k2 != kind or there[:2] != dims:
            continue
        dist = sum(w * abs(a - b) for w, a, b in zip(COST_MODEL.weights, here, there))
        refs = [r for r in among if r in predicted and r in row["times_ms"]]
        shift = {r: slope(rows, kind, dims, r) * (log2_mean_length(p) - round(log2_mean_length(q), 4)) if moved
                 else 0.0 for r in refs}
        log_ratio = sum(math.log(predicted[r] * row["times_ms"][NEW] / row["times_ms"][r]) + shift[r]
                        for r in refs) / len(refs)
        found.append((dist, log_ratio))
    found.sort()
    used = found[:k]
    weights = [1.0 / (dist + 0.25) for dist, _ in used]
    margin = profile.model.relative_packed_margin if p.qkv_format == "thd" else 1.0
    return margin * math.exp(sum(w * lr for w, (_, lr) in zip(weights, used)) / sum(weights))


def test_a_provider_without_a_rate_is_its_time_over_the_others_on_the_three_nearest_packs_times_theirs_here():
    profile = profile_with(NEAR)
    among = [*KNOWN, NEW]
    got = profile.predict(TARGET, machine=MACHINE, among=among)
    want = expected(profile, TARGET, NEAR, among)
    assert got.times_ms[NEW] == pytest.approx(want, rel=1e-12)
    # the far pack (40 short sequences, z:new 5x x:fast) is not one of the three nearest
    assert got.times_ms[NEW] < got.times_ms["x:fast"] and got.best(among) == NEW
    assert got.relative[NEW] == ("p3", "p0", "p1")
    for known in KNOWN:  # the providers with rates keep their own predictions
        assert got.times_ms[known] == profile.predict(TARGET, machine=MACHINE).times_ms[known]
    # compared with x:slow alone, it is read off x:slow's ratios, slope and prediction
    alone = profile.predict(TARGET, machine=MACHINE, among=["x:slow", NEW]).times_ms[NEW]
    assert alone == pytest.approx(expected(profile, TARGET, NEAR, ["x:slow", NEW]), rel=1e-12)
    assert not math.isclose(alone, got.times_ms[NEW], rel_tol=1e-3)


def test_each_neighbour_is_moved_to_the_calls_mean_length_along_the_slope_of_the_packed_entries():
    profile = profile_with(NEAR)
    among = [*KNOWN, NEW]
    kind, log2, _ = features(TARGET)
    dims = [round(log2[f], 4) for f in SIZES[:2]]
    for reference in KNOWN:  # z:new loses ground the shorter the sequences: a negative slope, the formula's own
        assert profile.relative_slope(NEW, reference) == pytest.approx(slope(NEAR, kind, dims, reference), rel=1e-9)
        assert profile.relative_slope(NEW, reference) < 0
    # the same neighbours without the slope: the plain weighted geometric mean; a pack of shorter sequences than
    # its neighbours' is predicted slower with the slope than without it
    plain = dataclasses.replace(COST_MODEL, relative_length_slope=False)
    unmoved = profile_with(NEAR, plain)
    assert unmoved.predict(TARGET, machine=MACHINE, among=among).times_ms[NEW] == pytest.approx(
        expected(unmoved, TARGET, NEAR, among, moved=False), rel=1e-12)
    short = pack(12288, (12288,) + (300,) * 30)
    assert log2_mean_length(short) < min(log2_mean_length(AttentionParams(**r["params"])) for r in NEAR[:2])
    assert (profile.predict(short, machine=MACHINE, among=among).times_ms[NEW]
            > unmoved.predict(short, machine=MACHINE, among=among).times_ms[NEW])
    # never moved past the longest mean length measured: two packs of the same sizes whose mean lengths are both
    # beyond every neighbour's get the same prediction; a shorter one another
    longest = max(round(log2_mean_length(AttentionParams(**r["params"])), 4) for r in NEAR)
    uniform = pack(16384, (16384,) * 6)
    ragged = pack(16384, (16384, 16000, 15000, 14000, 13000, 12000))
    shorter = pack(16384, (16384, 9000, 8000, 3000, 1000, 500))
    assert min(log2_mean_length(uniform), log2_mean_length(ragged)) > longest > log2_mean_length(shorter)
    # (NEW over the geometric mean of the references it was read against: what the slope moves)
    ratio = {p: (lambda t: t[NEW] / math.sqrt(t["x:fast"] * t["x:slow"]))(
        profile.predict(p, machine=MACHINE, among=among).times_ms) for p in (uniform, ragged, shorter)}
    assert ratio[uniform] == pytest.approx(ratio[ragged], rel=1e-12)
    assert ratio[shorter] > ratio[uniform] * 1.01
    # relative_k=2 reads the two nearest alone
    two = profile_with(NEAR, dataclasses.replace(COST_MODEL, relative_k=2))
    assert two.predict(TARGET, machine=MACHINE, among=among).relative[NEW] == ("p3", "p0")
    assert two.predict(TARGET, machine=MACHINE, among=among).times_ms[NEW] == pytest.approx(
        expected(two, TARGET, NEAR, among, k=2), rel=1e-12)


def test_no_prediction_from_fewer_than_three_packs_of_its_kind_and_head_dims_nor_for_dense_calls():
    profile = profile_with(NEAR)
    among = [*KNOWN, NEW]
    assert NEW not in profile.predict(TARGET, machine=MACHINE).times_ms  # not asked: the rate model's times only
    other_dims = pack(12288, (12288, 5000, 40, 700, 2000), d=64)
    training = pack(12288, (12288, 5000, 40, 700, 2000), train=True)
    unwindowed = pack(12288, (12288, 5000, 40, 700, 2000), window=None)
    for p in (other_dims, training, unwindowed):  # no pack of that head dim, pass or mask was measured
        found = profile.predict(p, machine=MACHINE, among=among)
        assert NEW not in found.times_ms and found.best(among) in KNOWN
    two = profile_with(NEAR[:2])
    assert NEW not in two.predict(TARGET, machine=MACHINE, among=among).times_ms
    dense = AttentionParams(batch_size=5, num_heads=16, max_seqlen_q=12288, attn_mask_type="causal",
                            window_size=(512, 0), is_training=False)
    assert NEW not in profile.predict(dense, machine=MACHINE, among=among).times_ms


def test_a_pack_of_another_head_dim_or_pass_never_changes_it_and_leave_out_skips_the_calls_own_shape():
    among = [*KNOWN, NEW]
    base = profile_with(NEAR).predict(TARGET, machine=MACHINE, among=among).times_ms[NEW]
    others = [packed_row(10, pack(12288, (12288, 5000, 40, 700, 2000), d=64), {"x:fast": 1.0, NEW: 9.0}),
              packed_row(11, pack(12288, (12288, 5000, 40, 700, 2000), train=True), {"x:fast": 1.0, NEW: 9.0})]
    assert profile_with(NEAR + others).predict(TARGET, machine=MACHINE, among=among).times_ms[NEW] == base
    own = packed_row(12, TARGET, {"x:fast": 3.0, "x:slow": 6.0, NEW: 1.0})
    with_own = profile_with(NEAR + [own])
    assert with_own.predict(TARGET, machine=MACHINE, among=among).relative[NEW][0] == "p12"
    # left out of the neighbours and of the slope's fit alike
    assert with_own.predict(TARGET, machine=MACHINE, among=among, leave_out=True).times_ms[NEW] == pytest.approx(
        base, rel=1e-12)


def test_packed_entries_drop_a_time_no_kernel_runs_at_and_hold_packed_calls_only():
    fastest = 2.0
    rows = [packed_row(0, TARGET, {"x:fast": fastest, NEW: fastest * EAGER_FALLBACK * 1.01, "x:slow": 3.0})]
    entries = packed_entries([{"machine": MACHINE, "rows": rows}], [MACHINE])
    assert entries[0]["times_ms"] == {"x:fast": fastest, "x:slow": 3.0}
    assert entries[0]["log2"]["mean_length"] == round(log2_mean_length(TARGET), 4)
    # a row recorded without fills has them read from its case's lengths
    lengths = (12288, 5000, 40, 700, 2000)
    bare = {**rows[0], "params": {**TARGET.to_dict(), "packed_fill": None, "packed_token_fill": None},
            "case": {"seqlens": list(lengths)}}
    read = packed_entries([{"machine": MACHINE, "rows": [bare]}], [MACHINE])
    assert read[0]["log2"]["mean_length"] == pytest.approx(math.log2(sum(lengths) / len(lengths)), abs=0.2)
    assert read[0]["log2"] == entries[0]["log2"]
    dense = {"label": "d", "params": AttentionParams().to_dict(), "times_ms": {"x:fast": 1.0}}
    with pytest.raises(ValueError, match="not a packed call"):
        packed_entries([{"machine": MACHINE, "rows": [dense]}], [MACHINE])


def test_auto_picks_it_where_it_is_predicted_fastest_and_says_what_it_was_read_off(tmp_path: Path):
    data = build([{"machine": "NVIDIA H200", "rows": dense_rows()}], arch="sm90", stack={}, date="",
                 packed=[{"machine": "NVIDIA H200", "rows": NEAR}])
    (tmp_path / "sm90.json").write_text(json.dumps(data))
    choice = AutoPolicy(directory=tmp_path).choose(TARGET, Platform.parse("h200-cudnn9"), ["x:fast", NEW])
    assert choice.chosen == NEW and set(choice.estimates) == {"x:fast", NEW}
    assert f"{NEW} has no rate in the profile" in choice.reason and "(p3; p0; p1)" in choice.reason
    margin = f"x {COST_MODEL.relative_packed_margin:g} (a pack picks it only where it reads clearly faster)"
    assert margin in choice.reason
