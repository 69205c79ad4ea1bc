"""benchmarks/evaluate_profile.py's --model settings and --summary line (how a cost-model setting is compared)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import evaluate_profile  # noqa: E402
from attn_dispatch.policy.cost_model import COST_MODEL  # noqa: E402
from attn_dispatch.policy.profile import PROFILE_DIR, Profile  # noqa: E402

HELD_OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "held_out"


def test_model_settings_parse_to_their_fields_types_and_refuse_unknown_keys():
    model = evaluate_profile.model_with(["host_scale=0.9", "use_split=false", "k=3", "weights=1,2,3,4,5,6,7"])
    assert model.host_scale == 0.9 and model.use_split is False and model.k == 3
    assert model.weights == (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0)
    assert model.split_combine == COST_MODEL.split_combine  # the rest as shipped
    assert evaluate_profile.model_with(["unwindowed_backward=x:a,x:b"]).unwindowed_backward == ("x:a", "x:b")
    assert evaluate_profile.model_with(["unwindowed_backward=none"]).unwindowed_backward == ()  # provider names
    varlen = evaluate_profile.model_with(["varlen_factor=x:a=1.5,y:b=0.5"]).varlen_factor
    assert varlen == (("x:a", 1.5), ("y:b", 0.5))  # (provider, number) pairs
    assert evaluate_profile.model_with(["varlen_factor=none"]).varlen_factor == ()
    with pytest.raises(SystemExit, match="NAME=NUMBER"):
        evaluate_profile.model_with(["varlen_factor=x:a"])
    windowed = evaluate_profile.model_with(["windowed_varlen_forward=x:a@M 1#64=1.2,x:a@M 1#256=1.1"])
    assert windowed.windowed_varlen_forward == (("x:a@M 1", 64, 1.2), ("x:a@M 1", 256, 1.1))  # per head dim
    with pytest.raises(SystemExit, match="NAME#DIM=NUMBER"):
        evaluate_profile.model_with(["windowed_varlen_forward=x:a=1.2"])
    for bad in (["hostscale=0.9"], ["host_scale="], ["host_scale"]):
        with pytest.raises(SystemExit, match="CostModel field"):
            evaluate_profile.model_with(bad)


def test_the_summary_reads_every_row_of_every_file():
    import json

    profile = Profile(json.loads((PROFILE_DIR / "sm90.json").read_text()))
    paths = [str(HELD_OUT / "blind10_stock_h100_from0.json.gz"), str(HELD_OUT / "blind10_h100_from0.json.gz")]
    line = evaluate_profile.summary_line(profile, paths)
    assert line.startswith("96 rows in 2 files: mean ")
    mean = float(line.split("mean ")[1].split(",")[0])
    assert 1.0 <= mean < 1.1


def test_a_row_is_picked_as_the_policy_picks_the_last_resort_out_while_another_provider_was_timed():
    import json

    profile = Profile(json.loads((PROFILE_DIR / "sm90.json").read_text()))
    params = {**profile_params(), "qkv_format": "thd", "attn_mask_type": "padding_causal", "head_dim_qk": 192,
              "head_dim_v": 128}
    # only flex and unfused timed (a d192/128 pack on stock torch): the profile predicts unfused alone
    times = {"flex_attention:torch": 2.0, "unfused:pytorch": 100.0}
    assert "flex_attention:torch" not in profile.predict(evaluate_profile.call_of(params)).times_ms
    found = evaluate_profile.score(profile, "r", params, times, "NVIDIA H200", leave_out=False, stock=False)
    assert found["pick"] == "flex_attention:torch" and found["ratio"] == 1.0
    alone = evaluate_profile.score(profile, "r", params, {"unfused:pytorch": 100.0}, "NVIDIA H200", leave_out=False,
                                   stock=False)
    assert alone["pick"] == "unfused:pytorch"
    assert {"flex_attention:torch", "mem_efficient:torch"} <= set(evaluate_profile.TORCH_PROVIDERS)


def profile_params() -> dict:
    from attn_dispatch import AttentionParams

    return AttentionParams(batch_size=8, num_heads=8, max_seqlen_q=1280, is_training=False).to_dict()
