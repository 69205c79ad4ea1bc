"""A packed (thd) call's predicted cost: its dense twin's GPU time x its share of the work x the engine's varlen
factor, and the packed calls' host time (policy/profile.py; policy/cost_model.py, CostModel.packed_twin); checked on
synthetic profiles whose engines have known rates, and on the packed held-out run the terms were fitted with."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from attn_dispatch import AttentionParams
from attn_dispatch.params import packed_fills
from attn_dispatch.policy.cost_model import COST_MODEL, dense_twin, packed_gpu_factor, unwindowed_work, work
from attn_dispatch.policy.profile import PROFILE_DIR, Profile
from attn_dispatch.policy.profile_build import build

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
RATE = {"x:fast": 4e11, "x:slow": 2e11}  # flops per ms of GPU time (400 and 200 TFLOP/s), at every size
HOST = {"x:fast": 0.9, "x:slow": 0.4}  # ms per packed training call (the slow kernel's launch is cheaper)


def call(**kw) -> AttentionParams:
    base = dict(dtype="bf16", batch_size=4, num_heads=8, head_dim_qk=128, max_seqlen_q=2048,
                attn_mask_type="causal", is_training=True)
    return AttentionParams(**{**base, **kw})


def packed(**kw) -> AttentionParams:
    return call(**{"qkv_format": "thd", "attn_mask_type": "padding_causal", **kw})


def row(i: int, p: AttentionParams, rate: dict[str, float], host: dict[str, float]) -> dict:
    """A measured row of a split run: each provider's GPU time its rate's, its host time given."""
    gpu = {n: work(p) / r for n, r in rate.items()}
    return {"label": f"r{i}", "params": p.to_dict(),
            "times_ms": {n: max(host[n], g) for n, g in gpu.items()},
            "split": {n: {"host_ms": host[n], "gpu_ms": gpu[n], "covered": 1} for n in rate}}


def profile_of(rows: list[dict], model=COST_MODEL) -> Profile:
    return Profile(build([{"machine": "test GPU", "rows": rows}], arch="sm90", stack={}, date="", model=model),
                   model=model)


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    """Dense calls at d128 and d192, with and without a causal window, where x:fast runs at twice x:slow's rate;
    packed calls at d128 without a window only, with the host times HOST (dense calls: 0.05 ms)."""
    dense_host = {n: 0.05 for n in RATE}
    rows = [row(i, call(max_seqlen_q=s, head_dim_qk=d, head_dim_v=128, window_size=w), RATE, dense_host)
            for i, (s, d, w) in enumerate((s, d, w) for s in (1024, 2048, 4096, 8192) for d in (128, 192)
                                          for w in (None, (1024, 0)))]
    rows += [row(100 + i, packed(max_seqlen_q=s), {n: r / 1.1 for n, r in RATE.items()}, HOST)
             for i, s in enumerate((1024, 2048, 4096, 8192))]
    return rows


def test_a_pack_costs_its_twins_gpu_time_times_its_share_and_the_varlen_factor_and_the_packed_host_time(measured):
    model = dataclasses.replace(COST_MODEL, varlen_factor=(("x:fast", 1.1), ("x:slow", 1.1)))
    profile = profile_of(measured, model)
    fill, tokens = packed_fills((3000, 40, 500, 1200), (3000, 40, 500, 1200), 3000, 3000, "padding_causal")
    pack = packed(max_seqlen_q=3000, packed_fill=fill, packed_token_fill=tokens)
    parts = profile.parts(pack)
    for name, rate in RATE.items():
        # the twin: 4 sequences of 3000 tokens, dense, at the provider's rate; the pack: its fill of that work
        # (the profile keeps 4 significant digits of a split)
        assert parts.gpus[name] == pytest.approx(work(dense_twin(pack)) / rate * fill * 1.1, rel=1e-3)
        assert parts.hosts[name] == pytest.approx(HOST[name] * model.host_scale, rel=1e-9)
    assert profile.predict(pack).times_ms.keys() == RATE.keys()


def test_a_machines_varlen_factor_scales_its_packed_gpu_time_and_no_other_machines_nor_dense_calls(measured):
    base = dataclasses.replace(COST_MODEL, varlen_factor=(("x:fast", 1.1),), machine_varlen_factor=())
    model = dataclasses.replace(base, machine_varlen_factor=(("x:fast@test GPU", 1.25), ("x:slow@other GPU", 0.5)))
    fill, tokens = packed_fills((3000, 40, 500, 1200), (3000, 40, 500, 1200), 3000, 3000, "padding_causal")
    pack = packed(max_seqlen_q=3000, packed_fill=fill, packed_token_fill=tokens)
    plain, scaled = profile_of(measured, base), profile_of(measured, model)
    for machine, factors in (("test GPU", {"x:fast": 1.25, "x:slow": 1.0}), ("other GPU", {"x:fast": 1.0,
                                                                                          "x:slow": 0.5})):
        before, after = plain.parts(pack, machine=machine), scaled.parts(pack, machine=machine)
        for name in RATE:
            assert after.gpus[name] == pytest.approx(before.gpus[name] * factors[name], rel=1e-12)
            assert after.hosts[name] == before.hosts[name]
    assert scaled.parts(pack).gpus == plain.parts(pack).gpus  # no machine named: none of them
    dense = dense_twin(pack)
    assert scaled.parts(dense, machine="test GPU").gpus == plain.parts(dense, machine="test GPU").gpus


def test_a_packed_head_dim_no_packed_call_was_measured_at_is_read_off_the_dense_calls(measured):
    # d192: the dense calls say x:fast takes half x:slow's GPU time; a large pack is GPU-bound
    pack = packed(max_seqlen_q=8192, batch_size=8, head_dim_qk=192, head_dim_v=128)
    times = profile_of(measured).predict(pack).times_ms
    assert times["x:slow"] / times["x:fast"] == pytest.approx(2.0, rel=0.05)
    # and under a window, which no packed call had: predicted, the window's share of the work counted
    windowed = profile_of(measured).parts(dataclasses.replace(pack, window_size=(1024, 0)))
    assert windowed.gpus and windowed.gpus["x:fast"] < 0.5 * profile_of(measured).parts(pack).gpus["x:fast"]
    without_twin = dataclasses.replace(COST_MODEL, packed_twin=False)
    assert profile_of(measured, without_twin).predict(dataclasses.replace(pack, window_size=(1024, 0))).times_ms == {}


def test_a_ragged_pack_goes_to_the_engine_with_the_cheaper_host_and_a_full_one_to_the_faster_kernel(measured):
    profile = profile_of(measured)
    lengths = (2048,) + (64,) * 15  # one long document among short ones: 7% of the full-length tiles
    ragged = packed(batch_size=16, packed_fill=packed_fills(lengths, lengths, 2048, 2048, "padding_causal")[0],
                    packed_token_fill=packed_fills(lengths, lengths, 2048, 2048, "padding_causal")[1])
    full = packed(batch_size=16, packed_fill=1.0, packed_token_fill=1.0)
    assert profile.predict(ragged).best(list(RATE)) == "x:slow"
    assert profile.predict(full).best(list(RATE)) == "x:fast"


def test_a_two_sided_window_charges_an_unwindowed_backward_its_unwindowed_share():
    lengths = (4096, 300, 2000, 900)
    fill, tokens = packed_fills(lengths, lengths, 4096, 4096, "padding")
    pack = packed(max_seqlen_q=4096, attn_mask_type="padding", window_size=(128, 128), packed_fill=fill,
                  packed_token_fill=tokens)
    model = dataclasses.replace(COST_MODEL, varlen_factor=(), unwindowed_backward=("x:full",))
    skipping = packed_gpu_factor("x:skip", pack, model)
    full = packed_gpu_factor("x:full", pack, model)
    assert skipping == pytest.approx(work(pack, model) / work(dense_twin(pack), model), rel=1e-12)
    # x:full's backward (2.5 of 3.5 parts) computes every tile of the twin, of which the pack holds its fill
    twin = dense_twin(pack)
    want = (work(pack, model) + 2.5 * unwindowed_work(pack, model)) / (work(twin, model) + 2.5 * unwindowed_work(
        twin, model))
    assert full == pytest.approx(want, rel=1e-12) and not math.isclose(full, skipping, rel_tol=0.05)


def test_a_windowed_forward_takes_its_machines_windowed_varlen_factor_at_its_head_dim_only():
    lengths = (4096, 300, 2000, 900)
    fill, tokens = packed_fills(lengths, lengths, 4096, 4096, "padding_causal")
    pack = packed(max_seqlen_q=4096, window_size=(192, 0), packed_fill=fill, packed_token_fill=tokens,
                  is_training=False)
    model = dataclasses.replace(COST_MODEL, windowed_varlen_forward=(("x:a@GPU B", 128, 1.25),))
    plain = packed_gpu_factor("x:a", pack, model, "GPU A")
    assert packed_gpu_factor("x:a", pack, model, "GPU B") == pytest.approx(1.25 * plain, rel=1e-12)
    assert packed_gpu_factor("x:b", pack, model, "GPU B") == pytest.approx(plain, rel=1e-12)  # another engine
    assert packed_gpu_factor("x:a", pack, model) == pytest.approx(plain, rel=1e-12)  # no machine named
    for other in (pack.replace(is_training=True), pack.replace(window_size=(-1, 0)),
                  pack.replace(head_dim_qk=96, head_dim_v=96)):  # training, no window, another head dim
        assert packed_gpu_factor("x:a", other, model, "GPU B") == pytest.approx(
            packed_gpu_factor("x:a", other, model, "GPU A"), rel=1e-12)
    assert ("flash_attn_4:cute@NVIDIA H200", 128, 1.2) in COST_MODEL.windowed_varlen_forward


def clear_rows() -> list[tuple[str, str, dict]]:
    """(label, the engine that was fastest by 1.2x or more over every other, its call) on the packed held-out run."""
    sys.path.insert(0, str(RESULTS.parent))
    from evaluate_profile import call_of  # benchmarks/: a case's own lengths become its fills
    from attn_dispatch.benchmarking.results import read_results

    out = []
    for r in read_results(RESULTS / "held_out" / "eval_blind_packed_h200_full.json.gz")["rows"]:
        times = sorted((t, n) for n, t in r["times_ms"].items() if ":" in n and not n.startswith("flex"))
        if len(times) > 1 and times[1][0] >= 1.2 * times[0][0]:
            out.append((r["label"], times[0][1], call_of(r["params"], r["case"]), [n for _, n in times]))
    return out


def test_where_one_engine_was_clearly_fastest_on_a_measured_pack_the_shipped_profile_picks_it():
    """The packed run the terms were fitted on (H200): ragged d64/d128 training packs where torch's FA2 won, d192
    forwards and windowed packs where flash-attn-4 won."""
    data = json.loads((PROFILE_DIR / "sm90.json").read_text())
    rows = clear_rows()
    assert len(rows) >= 8 and {"flash_attn_2:torch", "flash_attn_4:cute"} <= {fastest for _, fastest, _, _ in rows}
    shipped = Profile(data)
    missed = [label for label, fastest, p, timed in rows
              if shipped.predict(p, machine="NVIDIA H200").best(timed) != fastest]
    assert not missed, missed
    nearest_pack = Profile(data, model=dataclasses.replace(COST_MODEL, packed_twin=False))
    assert any(nearest_pack.predict(p, machine="NVIDIA H200").best(timed) != fastest
               for _, fastest, p, timed in rows)  # what the packed neighbours alone got wrong
