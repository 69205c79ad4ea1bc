"""The profile's local fit of a provider's GPU rate (CostModel.rate_fit): its arithmetic against numpy's least
squares, and what it buys over the nearest entry's rate on a provider whose rate follows the call's sizes."""
from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from attn_dispatch import AttentionParams
from attn_dispatch.policy.profile import _FEATURES, COST_MODEL, Profile, _local_log_rate, build
from attn_dispatch.policy.profile import work as profile_work

FIT = COST_MODEL  # the shipped model fits (rate_fit 12)
NEAREST = dataclasses.replace(COST_MODEL, rate_fit=0)


def _numpy_fit(found, sizes, here, model):
    columns = [_FEATURES.index(name) for name in model.rate_fit_slopes]
    weights = np.array([1.0 / (d + 0.25) for d, _ in found])
    design = np.array([[1.0] + [s[c] - here[c] for c in columns] for s in sizes])
    y = np.array([lr for _, lr in found])
    ridge = np.diag([0.0] + [model.rate_fit_ridge * weights.sum()] * len(columns))
    solved = np.linalg.solve(design.T @ (weights[:, None] * design) + ridge, design.T @ (weights * y))
    return float(np.clip(solved[0], y.min() - model.rate_fit_clamp, y.max() + model.rate_fit_clamp))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ridge,clamp", [(0.0, 50.0), (0.3, 50.0), (0.3, 0.01)])
def test_the_fit_is_the_weighted_ridge_least_squares_solution_clamped(seed, ridge, clamp):
    rng = random.Random(seed)
    model = dataclasses.replace(FIT, rate_fit_ridge=ridge, rate_fit_clamp=clamp)
    here = tuple(rng.uniform(5, 14) for _ in _FEATURES)
    sizes = [tuple(h + rng.uniform(-2, 2) for h in here) for _ in range(12)]
    found = [(rng.uniform(0, 5), rng.uniform(20, 27)) for _ in sizes]
    assert _local_log_rate(found, sizes, here, model) == pytest.approx(_numpy_fit(found, sizes, here, model),
                                                                      rel=1e-7)


def test_the_clamp_keeps_an_extrapolation_near_the_neighbours_rates():
    # log rate rises by 1 per doubling of sq; a call 8 doublings past the neighbours would extrapolate to +8
    model = dataclasses.replace(FIT, rate_fit_ridge=0.0, rate_fit_clamp=0.1)
    sizes = [(7.0, 7.0, sq, sq, sq, 4.0, 0.0) for sq in (8.0, 9.0, 10.0, 11.0)]
    found = [(1.0, 20.0 + s[2] - 8.0) for s in sizes]
    here = (7.0, 7.0, 19.0, 19.0, 19.0, 4.0, 0.0)
    assert _local_log_rate(found, sizes, here, model) == pytest.approx(23.1)


def _rate(sq: int, bh: int) -> float:
    """A kernel whose rate (work per ms) grows with the length and the batch x heads until the GPU fills."""
    return 4e8 * sq ** 0.4 * bh ** 0.2


def _split_profile(lengths, batches) -> dict:
    rows = []
    for s in lengths:
        for b in batches:
            p = AttentionParams(max_seqlen_q=s, batch_size=b, num_heads=16, attn_mask_type="causal")
            gpu = profile_work(p) / _rate(s, b * 16)
            rows.append({"label": f"s{s} b{b}", "params": p.to_dict(), "times_ms": {},
                         "split": {"x:a": {"step_ms": gpu, "host_ms": 0.001, "gpu_ms": gpu, "covered": 1.0}}})
    return build([{"machine": "m", "rows": rows}], arch="sm90", stack={}, date="")


def test_the_fit_interpolates_a_rate_that_the_nearest_entry_alone_misses():
    data = _split_profile((512, 1024, 2048, 4096, 8192), (1, 2, 4))
    call = AttentionParams(max_seqlen_q=3000, batch_size=3, num_heads=16, attn_mask_type="causal")
    truth = profile_work(call) / _rate(3000, 48)
    exact = dataclasses.replace(FIT, rate_fit_ridge=0.0)
    fitted = Profile(data, model=exact).predict(call, machine="m").times_ms["x:a"]
    shrunk = Profile(data, model=FIT).predict(call, machine="m").times_ms["x:a"]  # session 18's ridge
    nearest = Profile(data, model=NEAREST).predict(call, machine="m")
    nearest_error = abs(math.log(nearest.times_ms["x:a"] / truth))
    assert fitted == pytest.approx(truth, rel=0.01)  # log rate is linear in the log sizes here: recovered
    assert nearest_error > 0.08  # the nearest entry's rate is its own length's
    assert abs(math.log(shrunk / truth)) < nearest_error / 2


def test_with_fewer_split_entries_than_the_fit_needs_the_nearest_rate_is_used():
    data = _split_profile((512, 1024, 2048, 4096), (1, 2))  # 8 entries, rate_fit 12
    call = AttentionParams(max_seqlen_q=3000, batch_size=2, num_heads=16, attn_mask_type="causal")
    assert FIT.rate_fit > 8
    nearest = Profile(data, model=NEAREST).predict(call, machine="m")
    assert Profile(data, model=FIT).predict(call, machine="m").times_ms == nearest.times_ms


def test_a_window_takes_the_nearest_rate_unless_windows_are_fitted_too():
    """A window's rate follows its span, which a fit over neighbours of other spans averages away."""
    rows = []
    for s in (2048, 4096, 8192):
        for w in (128, 1024, 2048):
            for b in (1, 2):
                p = AttentionParams(max_seqlen_q=s, batch_size=b, num_heads=16, attn_mask_type="causal",
                                    window_size=(w, 0))
                gpu = profile_work(p) / (4e8 * w ** 0.5)  # narrow windows run at a lower rate
                rows.append({"label": f"s{s} w{w} b{b}", "params": p.to_dict(), "times_ms": {},
                             "split": {"x:a": {"step_ms": gpu, "host_ms": 0.001, "gpu_ms": gpu, "covered": 1.0}}})
    data = build([{"machine": "m", "rows": rows}], arch="sm90", stack={}, date="")
    call = AttentionParams(max_seqlen_q=3000, batch_size=2, num_heads=16, attn_mask_type="causal",
                           window_size=(128, 0))
    nearest = Profile(data, model=NEAREST).predict(call, machine="m").times_ms
    assert Profile(data, model=FIT).predict(call, machine="m").times_ms == nearest
    fitted = Profile(data, model=dataclasses.replace(FIT, rate_fit_windows=True)).predict(call, machine="m")
    assert fitted.times_ms != nearest
