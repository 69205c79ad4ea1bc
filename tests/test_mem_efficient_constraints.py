"""The flex_attention:torch and mem_efficient:torch tables, and where selection puts them: every refusal names the
actual values and a fix; a masked call on a GPU never falls to unfused while one of them qualifies; CPU picks stay."""
from __future__ import annotations

import pytest

from attn_dispatch import AttentionParams, EnvFlags, Platform, explain
from attn_dispatch.constraints import TABLES
from attn_dispatch.policy.order import preference_order, without_last_resort

FLEX, MEM = TABLES["flex_attention:torch"], TABLES["mem_efficient:torch"]
H100 = Platform.parse("h100-cudnn9")
A100 = Platform.parse("a100-cudnn9")
V100 = Platform.parse("v100-cudnn8,torch=2.5.1")
CPU = Platform.parse("cpu")
ENV = EnvFlags.from_environ({})
BASE = AttentionParams(dtype="bf16", batch_size=2, max_seqlen_q=4096, num_heads=16, head_dim_qk=128,
                       attn_mask_type="arbitrary")


def _reasons(table, params, platform=H100, env=ENV):
    return {r.code: r for r in table.evaluate(params, platform, env).reasons}


# (table, params, platform, env, code, words the message must hold: the actual values)
REFUSALS = [
    (FLEX, BASE, Platform.parse("h100-cudnn9,torch=2.4.1"), ENV, "flex_attention.torch_version", ["2.4.1", "2.5"]),
    (FLEX, BASE.replace(device_type="cpu"), CPU, ENV, "flex_attention.device",
     ["does not support backward on CPU", "torch 2.13"]),
    (FLEX, BASE, V100, ENV, "flex_attention.device", ["sm70", "sm80"]),
    (FLEX, BASE, Platform.parse("h100-cudnn9,no-triton"), ENV, "flex_attention.device", ["triton"]),
    (FLEX, BASE.replace(dtype="fp64"), H100, ENV, "flex_attention.dtype", ["float64", "float32"]),
    (FLEX, BASE.replace(head_dim_qk=8), H100, ENV, "flex_attention.head_dim", ["head_dim_qk=8", "16"]),
    (FLEX, BASE.replace(head_dim_qk=512), H100, ENV, "flex_attention.head_dim", ["head_dim_qk=512", "256"]),
    (FLEX, BASE.replace(dropout=0.1), H100, ENV, "flex_attention.dropout", ["0.1"]),
    (FLEX, BASE.replace(bias_type="post_scale_bias", bias_shape="1hss", bias_requires_grad=True),
     Platform.parse("h100-cudnn9,torch=2.5.1"), ENV, "flex_attention.bias_grad", ["2.5.1", "2.6"]),
    (FLEX, BASE.replace(bias_type="post_scale_bias", bias_shape="1hss", bias_requires_grad=True, deterministic=True),
     H100, ENV, "flex_attention.deterministic", ["deterministic=True", "atomic"]),
    (FLEX, BASE.replace(softmax_type="learnable"), H100, ENV, "flex_attention.softmax_type", ["learnable"]),
    (FLEX, BASE.replace(cp_size=2, attn_mask_type="causal"), H100, ENV, "flex_attention.cp_comm_type",
     ["cp_size=2"]),
    (FLEX, BASE.replace(attn_mask_type="causal", dtype="fp32", cp_block=True), H100, ENV,
     "flex_attention.cp_comm_type", ["per-block call", "merged out/lse"]),
    (MEM, BASE.replace(attn_mask_type="causal", dtype="fp32", cp_block=True), H100, ENV,
     "mem_efficient.cp_comm_type", ["per-block call"]),
    (MEM, BASE, Platform.parse("h100-cudnn9,torch=2.4.1"), ENV, "mem_efficient.torch_version", ["2.4.1", "2.5"]),
    (MEM, BASE.replace(device_type="cpu"), CPU, ENV, "mem_efficient.compute_capability", ["CPU"]),
    (MEM, BASE, V100, ENV, "mem_efficient.dtype", ["bfloat16", "sm70"]),
    (MEM, BASE.replace(head_dim_qk=100), H100, ENV, "mem_efficient.head_dim", ["head_dim_qk=100", "8"]),
    (MEM, BASE.replace(dtype="fp32", head_dim_qk=102), H100, ENV, "mem_efficient.head_dim", ["head_dim_qk=102", "4"]),
    (MEM, BASE.replace(attn_mask_type="padding_causal", qkv_format="thd", bias_type="alibi"), H100, ENV,
     "mem_efficient.thd", ["thd", "KV-cache"]),
    (MEM, BASE.replace(attn_mask_type="padding_causal", qkv_format="thd", bias_type="alibi",
                       inference_kv_cache=True, is_training=False), H100, ENV, "mem_efficient.thd", ["alibi", "thd"]),
    (MEM, BASE.replace(attn_mask_type="causal", window_size=(128, 0)), H100, ENV, "mem_efficient.window",
     ["(128, 0)"]),
    (MEM, BASE.replace(softcap=30.0), H100, ENV, "mem_efficient.softcap", ["softcap=30"]),
    (MEM, BASE.replace(mask_mod=True), H100, ENV, "mem_efficient.user_mods", ["mask_mod"]),
    (MEM, BASE.replace(attn_mask_type="causal", bias_type="post_scale_bias", bias_shape="1hss",
                       bias_requires_grad=True), H100, ENV, "mem_efficient.bias_grad_causal", ["'causal'", "0.42"]),
]


@pytest.mark.parametrize("table, params, platform, env, code, words", REFUSALS,
                         ids=[f"{r[4]}-{i}" for i, r in enumerate(REFUSALS)])
def test_every_refusal_names_the_values_and_a_fix(table, params, platform, env, code, words):
    reasons = _reasons(table, params, platform, env)
    assert code in reasons, f"{code} not among {sorted(reasons)}"
    reason = reasons[code]
    for word in words:
        assert word in reason.message, reason.message
    assert reason.fix, f"{code} gives no fix"
    assert reason.source


def test_every_check_of_both_tables_is_exercised_or_never_fails():
    """Each refusing check appears above; the others are declarations of support that pass (the matrix reads them)."""
    refused = {r[4] for r in REFUSALS}
    always_pass = {"flex_attention.softcap", "flex_attention.user_mods", "mem_efficient.deterministic",
                   "flex_attention.torch_loads", "mem_efficient.torch_loads"}
    codes = {c.code for t in (FLEX, MEM) for c in t.checks}
    untested = codes - refused - always_pass
    # the remaining shared checks (fp8, formats, masks, bias types, return_max_logit, KV cache, CP support) are the
    # common factories every table uses, tested with the other tables
    shared = {f"{f}.{n}" for f in ("flex_attention", "mem_efficient") for n in
              ("fp8", "qkv_format", "mask_type", "bias_type", "return_max_logit", "kv_cache", "cp_support",
               "cp_comm_type", "softmax_type", "dropout")}
    assert untested <= shared, sorted(untested - shared)


@pytest.mark.parametrize("params", [
    BASE,
    BASE.replace(attn_mask_type="padding_causal", bias_type="alibi"),
    BASE.replace(attn_mask_type="padding_causal", bias_type="post_scale_bias", bias_shape="b1ss"),
    BASE.replace(softcap=50.0),
    BASE.replace(attn_mask_type="padding_causal", qkv_format="thd", bias_type="alibi"),
])
def test_flex_takes_what_unfused_took_on_a_gpu(params):
    assert FLEX.evaluate(params, H100, ENV).eligible, _reasons(FLEX, params)
    d = explain(params, H100, ENV, policy="order")
    # training: a mask alone runs on flex's FLASH lowering; a score_mod (bias, ALiBi, softcap) on its Triton kernels
    plain = params.bias_type == "no_bias" and not params.softcap
    assert d.chosen == ("flex_attention:flash_attn_4" if plain else "flex_attention:torch"), d.chosen


@pytest.mark.parametrize("params, why", [
    (BASE.replace(dropout=0.1), "dropout"),
    (BASE.replace(head_dim_qk=512), "head dim 512 in training"),
    (BASE.replace(dtype="fp16"), "fp16 on a V100"),
])
def test_mem_efficient_takes_what_flex_cannot(params, why):
    platform = V100 if why.endswith("V100") else H100
    d = explain(params, platform, ENV, policy="order")
    assert d.chosen == "mem_efficient:torch", (why, d.chosen)


def test_a_user_modifier_runs_only_in_flex():
    params = BASE.replace(attn_mask_type="causal", mask_mod=True, score_mod=True)
    d = explain(params, H100, ENV)
    assert d.chosen == "flex_attention:torch"
    for v in d.verdicts:
        if v.id == "flex_attention:flash_attn_4":  # runs a user's mask_mod, but no score_mod in training
            assert v.has("flex_attention.score_mod_grad") and not v.has("flex_attention.user_mods")
        elif v.id != "flex_attention:torch":
            assert v.has(f"{v.backend}.user_mods"), v.id
    inference = params.replace(score_mod=False, is_training=False)
    assert explain(inference, H100, ENV).chosen == "flex_attention:flash_attn_4"
    cpu = explain(params.replace(device_type="cpu", is_training=False), CPU, ENV)
    assert cpu.chosen == "flex_attention:torch"


def test_cpu_picks_stay_with_unfused():
    for params in (BASE.replace(device_type="cpu"), BASE.replace(device_type="cpu", is_training=False),
                   AttentionParams(device_type="cpu", attn_mask_type="causal", is_training=False)):
        assert explain(params, CPU, ENV).chosen == "unfused:pytorch"
    order, _ = preference_order(BASE.replace(device_type="cpu"), CPU)
    assert order[0] == "unfused"


def test_unfused_stays_last_on_a_gpu():
    order, _ = preference_order(BASE, H100)
    assert order[-1] == "unfused" and order.index("flex_attention") < order.index("mem_efficient")
    eligible = ["flex_attention:torch", "mem_efficient:torch", "unfused:pytorch"]
    assert without_last_resort(eligible, BASE, H100) == eligible[:2]
    assert without_last_resort(["unfused:pytorch"], BASE, H100) == ["unfused:pytorch"]
    cpu = BASE.replace(device_type="cpu")
    assert without_last_resort(eligible, cpu, CPU) == eligible


def test_forcing_flex_with_dropout_raises_its_reason():
    from attn_dispatch import NoBackendAvailableError, select

    with pytest.raises(NoBackendAvailableError) as info:
        select(BASE.replace(dropout=0.1), H100, ENV, force="flex_attention")
    assert "attention_dropout=0.1" in str(info.value) and "flex_attention" in str(info.value)


def test_the_new_structure_cost_is_explained():
    verdict = FLEX.evaluate(BASE, H100, ENV)
    assert any("BlockMask build" in n and "torch.compile" in n for n in verdict.notes)


def test_a_packed_batch_is_refused_outside_a_kv_cache_step_as_the_engine_takes_bshd_or_sbhd():
    packed = BASE.replace(attn_mask_type="padding_causal", qkv_format="thd", is_training=False)
    assert not MEM.evaluate(packed, H100, ENV).eligible
    assert not explain(packed, H100, ENV).verdict("mem_efficient", "torch").eligible
    step = packed.replace(inference_kv_cache=True)
    assert "mem_efficient.thd" not in _reasons(MEM, step)
