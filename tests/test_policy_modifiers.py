"""Calls with a modifier (softcap, a bias or ALiBi, an arbitrary mask, a mask_mod / score_mod, dropout, ...) under
`auto`: never predicted from the profile's rows, which have none; ranked by the nearest masked call bench_masks.py
measured with the same modifiers (the profile's masked entries, built from the manifest's sources), else the
preference order, and the reason says which."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from attn_dispatch import AttentionParams, DotProductAttention, Platform, explain, selection
from attn_dispatch.policy import AutoPolicy, Profile, profile_for
from attn_dispatch.policy.auto import PREDICTED
from attn_dispatch.policy.cost_model import features, modifiers
from attn_dispatch.policy.profile_build import build

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_masks  # noqa: E402
import build_profile  # noqa: E402

H200 = Platform.profile("h200-cudnn9")
SOFTCAP_PADDING = AttentionParams(dtype="bf16", batch_size=2, num_heads=16, head_dim_qk=128, max_seqlen_q=4096,
                                  attn_mask_type="padding_causal", softcap=50.0, is_training=True)


@pytest.fixture(autouse=True)
def no_local_tuning(tmp_path, monkeypatch):
    for name in ("ATTN_DISPATCH_POLICY", "ATTN_DISPATCH_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ATTN_DISPATCH_CACHE_DIR", str(tmp_path / "cache"))
    selection.clear_cache()
    yield
    selection.clear_cache()


def _row(label: str, times: dict, **kw) -> dict:
    return {"label": label, "params": AttentionParams(**kw).to_dict(), "times_ms": times}


def _profile(tmp_path: Path, plain: list[tuple[dict, dict]], masked: list[dict] = ()) -> Path:
    """A profile of plain rows (params keywords, times) and masked rows on the H200, as build() writes it."""
    runs = [{"machine": H200.device_name, "rows": [_row(f"row{i}", t, **kw) for i, (kw, t) in enumerate(plain)]}]
    runs_masked = [{"machine": H200.device_name, "rows": list(masked)}] if masked else []
    data = build(runs, arch="sm90", stack={"torch": "2.11.0"}, date="2026-11-28", masked=runs_masked)
    (tmp_path / "sm90.json").write_text(json.dumps(data))
    return tmp_path


PLAIN = [(dict(max_seqlen_q=s, attn_mask_type="causal"), {"x:a": 0.01 * s / 64, "x:b": 0.02 * s / 64})
         for s in (1024, 2048, 4096)]


@pytest.mark.parametrize("change, named", [
    (dict(attn_mask_type="arbitrary"), "an arbitrary mask"), (dict(mask_mod=True), "a mask_mod"),
    (dict(bias_type="alibi"), "ALiBi"), (dict(bias_type="post_scale_bias", bias_shape="1hss"), "a post-scale bias"),
    (dict(softcap=30.0), "softcap"), (dict(score_mod=True), "a score_mod"), (dict(dropout=0.1), "dropout"),
    (dict(deterministic=True), "a deterministic backward"),
    (dict(dtype="float32"), "float32")])
def test_each_modifier_is_named_and_makes_a_kind_of_its_own(change, named):
    plain = AttentionParams(max_seqlen_q=1024, attn_mask_type="causal" if "attn_mask_type" not in change else
                            "no_mask")
    call = plain.replace(**change)
    assert modifiers(plain) == () and modifiers(call) == (named,)
    assert features(call)[0] == features(plain)[0][:3] + (named,) and features(call)[0] != features(plain)[0]
    assert modifiers(plain.replace(dtype="float16")) == () and modifiers(plain.replace(return_max_logit=True)) == ()
    # a sink adds one logit per row, not per score: predicted from the plain rows
    assert modifiers(plain.replace(softmax_type="learnable")) == () and modifiers(
        plain.replace(softmax_type="off-by-one")) == ()
    assert modifiers(plain.replace(deterministic=True, is_training=False)) == ()  # no backward to order


def test_a_modifier_call_is_never_predicted_from_rows_without_it(tmp_path):
    profile = Profile(json.loads((_profile(tmp_path, PLAIN) / "sm90.json").read_text()))
    causal = AttentionParams(max_seqlen_q=2048, attn_mask_type="causal")
    assert set(profile.predict(causal).times_ms) == {"x:a", "x:b"}
    assert profile.predict(causal.replace(softcap=30.0)).times_ms == {}
    choice = AutoPolicy(tmp_path).choose(causal.replace(softcap=30.0), H200, ["x:b", "x:a"])
    assert choice.chosen == "x:b" and choice.unit == "" and not choice.estimates  # the order, no claimed time
    assert "no measured call with softcap" in choice.reason and "preference order decides" in choice.reason


def test_the_nearest_measured_call_with_the_same_modifiers_ranks_and_the_reason_names_it(tmp_path):
    masked = [_row("capped", {"x:a": 3.0, "x:b": 2.0, "x:c": 9.0}, max_seqlen_q=4096, attn_mask_type="causal",
                   softcap=50.0),
              _row("biased", {"x:a": 1.0, "x:b": 5.0}, max_seqlen_q=4096, attn_mask_type="causal",
                   bias_type="alibi")]
    policy = AutoPolicy(_profile(tmp_path, PLAIN, masked))
    call = AttentionParams(max_seqlen_q=2048, attn_mask_type="causal", softcap=20.0)
    choice = policy.choose(call, H200, ["x:a", "x:b", "x:c"])
    assert choice.chosen == "x:b" and "capped" in choice.reason and "biased" not in choice.reason
    assert "x:b 2.000 ms, x:a 3.000 ms (1.50x), x:c 9.000 ms (4.50x)" in choice.reason
    assert policy.choose(call.replace(softcap=0.0, bias_type="alibi"), H200, ["x:b", "x:a"]).chosen == "x:a"
    # another modifier set, or the other pass, is not the same kind of call: the order decides
    both = policy.choose(call.replace(bias_type="alibi"), H200, ["x:b", "x:a"])
    assert both.chosen == "x:b" and "no measured call with ALiBi and softcap" in both.reason
    assert "no measured call" in policy.choose(call.replace(is_training=False), H200, ["x:a", "x:b"]).reason


def test_a_provider_the_measured_call_did_not_time_is_not_passed_over_for_want_of_a_row(tmp_path):
    masked = [_row("capped", {"x:a": 3.0, "x:b": 2.0}, max_seqlen_q=4096, attn_mask_type="causal", softcap=50.0)]
    policy = AutoPolicy(_profile(tmp_path, PLAIN, masked))
    call = AttentionParams(max_seqlen_q=4096, attn_mask_type="causal", softcap=50.0)
    first = policy.choose(call, H200, ["x:new", "x:a", "x:b"])  # the order puts the untimed one first
    assert first.chosen == "x:new" and "not timed there: x:new" in first.reason
    after = policy.choose(call, H200, ["x:a", "x:b", "x:new"])  # x:a is ruled out by x:b, x:new by the order
    assert after.chosen == "x:b" and "puts x:b first" in after.reason
    one = policy.choose(call, H200, ["x:a", "x:new"])  # one timed provider ranks nothing
    assert one.chosen == "x:a" and "timed two or more" in one.reason


def test_on_the_h200_the_padded_softcap_call_picks_flex_by_its_measurement():
    decision = explain(SOFTCAP_PADDING, H200)
    measured = next(c for c in profile_for(H200).masked
                    if c.machine == H200.device_name and "softcap_padding" in c.label)
    assert measured.times_ms["flex_attention:torch"] < measured.times_ms["flash_attn_4:cute"]
    assert decision.chosen == "flex_attention:torch"
    for named in ("softcap_padding", "NVIDIA H200", "bench_masks.py",
                  f"flex_attention:torch {measured.times_ms['flex_attention:torch']:.3f} ms",
                  f"flash_attn_4:cute {measured.times_ms['flash_attn_4:cute']:.3f} ms"):
        assert named in decision.policy_reason, named
    assert decision.estimate_unit != PREDICTED and not decision.estimates  # another call's times, not this one's


def test_the_masked_entries_hold_their_source_runs_times():
    """One source of truth: the shipped masked entries are the manifest's bench_masks.py runs, as recorded."""
    runs, _ = build_profile.load_masked_runs(build_profile.shipped_sources(masked=True))
    recorded = [row["times_ms"] for run in runs if run["machine"] == H200.device_name for row in run["rows"]
                if row["label"] == "softcap_padding" and row["params"]["is_training"]]
    entry = next(c for c in profile_for(H200).masked
                 if c.machine == H200.device_name and "softcap_padding" in c.label and c.kind[0])
    assert len(recorded) == 1  # the one H200 training run of this call: its times, as recorded
    assert entry.runs == 1 and entry.times_ms == {p: float(f"{t:.5g}") for p, t in recorded[0].items()}


def test_a_plain_call_is_predicted_as_before(tmp_path):
    shipped = json.loads((Path(profile_for(H200).source)).read_text())
    assert shipped["masked"]
    (tmp_path / "sm90.json").write_text(json.dumps({k: v for k, v in shipped.items() if k != "masked"}))
    plain = SOFTCAP_PADDING.replace(softcap=0.0)
    eligible = [v.id for v in explain(plain, H200).verdicts if v.eligible]
    with_masked, without = AutoPolicy().choose(plain, H200, eligible), AutoPolicy(tmp_path).choose(plain, H200,
                                                                                                   eligible)
    assert with_masked.unit == PREDICTED and with_masked.chosen == without.chosen
    assert with_masked.estimates == without.estimates


def test_the_benchmark_states_its_calls_as_the_module_takes_them():
    """bench_masks.call_params (what the profile files each measured call under) against the params the module
    builds for the same call with a forced engine (the mask as given), at a small size on the CPU."""
    for name, (make, _) in bench_masks.CASES.items():
        call = make(64, torch.device("cpu"))
        q, k, v = (torch.randn(call.b, 64, 16, 128, dtype=torch.bfloat16) for _ in range(3))
        module = DotProductAttention(16, 128, qkv_format="bshd", attn_mask_type=call.mask_type, softcap=call.softcap,
                                     backend="flex_attention").eval()
        taken = AttentionParams(**module.explain(q, k, v, **call.module_kwargs).params)
        stated = bench_masks.call_params(call, 16, 128, False)
        assert features(stated) == features(taken) and modifiers(stated), name
        row = {"call": name, "b": call.b, "s": 64, "h": 16, "d": 128}
        assert features(AttentionParams(**bench_masks.row_params(row, False))) == features(taken), name
