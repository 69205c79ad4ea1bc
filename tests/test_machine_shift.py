"""A rate read off another machine's entry is put on the asked machine's scale (policy/profile.py, machine_shifts and
CostModel.machine_shift): checked on synthetic two-machine profiles whose engines have known rates."""
from __future__ import annotations

import dataclasses
import math

from attn_dispatch import AttentionParams
from attn_dispatch.policy.cost_model import COST_MODEL, work
from attn_dispatch.policy.profile import Profile, machine_shifts
from attn_dispatch.policy.profile_build import build

SLOW, FAST = "GPU slow", "GPU fast"


def call(**kw) -> AttentionParams:
    base = dict(dtype="bf16", batch_size=4, num_heads=8, head_dim_qk=256, max_seqlen_q=4096,
                attn_mask_type="causal", is_training=True)
    return AttentionParams(**{**base, **kw})


def row(i: int, p: AttentionParams, rates: dict[str, float]) -> dict:
    return {"label": f"r{i}", "params": p.to_dict(), "times_ms": {n: work(p) / r for n, r in rates.items()}}


def profile(speedup: float, pairs: int, model=COST_MODEL) -> Profile:
    """SLOW timed many calls of d256 training; FAST timed `pairs` of them (the largest), where engine a runs
    `speedup` x faster than on SLOW and engine b as fast."""
    slow = {"e:a": 3e11, "e:b": 3e11}
    fast = {"e:a": 3e11 * speedup, "e:b": 3e11}
    lengths = (2048, 3072, 4096, 6144, 8192, 12288)
    runs = [{"machine": SLOW, "rows": [row(i, call(max_seqlen_q=s), slow) for i, s in enumerate(lengths)]},
            {"machine": FAST, "rows": [row(i, call(max_seqlen_q=s), fast) for i, s in enumerate(lengths[-pairs:])]}]
    return Profile(build(runs, arch="sm90", stack={}, date=""), model=model)


def test_the_shift_is_the_median_log_time_ratio_of_the_calls_both_machines_timed():
    p = profile(1.25, pairs=3)
    shifts = machine_shifts(p.entries)
    assert math.isclose(shifts[("e:a", True, 256, FAST)][SLOW], math.log(1 / 1.25), rel_tol=1e-3)  # 5-digit times
    assert math.isclose(shifts[("e:a", True, 256, SLOW)][FAST], math.log(1.25), rel_tol=1e-3)
    assert ("e:b", True, 256, FAST) not in shifts  # the same speed: under machine_shift_min, no shift


def test_a_call_on_a_machine_without_enough_entries_of_its_own_is_predicted_on_its_scale():
    call_asked = call(max_seqlen_q=5000, batch_size=3)  # measured on neither machine
    shifted = profile(1.25, pairs=3).parts(call_asked, machine=FAST)
    plain = profile(1.25, pairs=3, model=dataclasses.replace(COST_MODEL, machine_shift=False)).parts(
        call_asked, machine=FAST)
    expected = work(call_asked) / (3e11 * 1.25)  # a's rate on FAST
    assert shifted.own is None  # FAST has too few entries: every machine's predict it, SLOW's nearest
    assert math.isclose(shifted.gpus["e:a"], expected, rel_tol=0.02)
    assert plain.gpus["e:a"] > 1.2 * expected  # SLOW's rate unscaled
    assert math.isclose(shifted.gpus["e:b"], plain.gpus["e:b"], rel_tol=1e-9)
    on_slow = profile(1.25, pairs=3).parts(call_asked, machine=SLOW)  # its own entries: no shift
    assert math.isclose(on_slow.gpus["e:a"], work(call_asked) / 3e11, rel_tol=0.02)


def test_a_single_shared_call_shifts_nothing():
    assert not machine_shifts(profile(1.25, pairs=1).entries)
