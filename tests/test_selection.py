"""Selection, explanations, forcing and errors (issue 2's must-show)."""
import logging

import pytest

from attn_dispatch import AttentionParams, EnvFlags, NoBackendAvailableError, Platform, explain, select
from attn_dispatch.constraints import TABLES

CPU = Platform.parse("cpu")
H100 = Platform.parse("h100-cudnn9")
A100_CUDNN8 = Platform.parse("sm80,cudnn=8.9.7,flash-attn=2.4.2,torch=2.1.2")
NO_ENV = EnvFlags.from_environ({})

# The shape Transformer Engine users hit: bf16 [48, 16534, 18, 128], causal, context parallel.
TE_CASE = AttentionParams(dtype="bf16", qkv_format="bshd", batch_size=48, max_seqlen_q=16534, num_heads=18,
                          head_dim_qk=128, attn_mask_type="causal", cp_size=2, cp_comm_type="p2p")


def test_every_family_is_declared():
    families = {t.family for t in TABLES.values()}
    assert families == {"flash_attn_2", "flash_attn_3", "flash_attn_4", "cudnn_fused", "flex_attention",
                        "mem_efficient", "unfused"}


def test_cpu_call_picks_unfused_and_explains_the_rest():
    d = explain(AttentionParams(device_type="cpu"), CPU, NO_ENV)
    assert d.chosen == "unfused:pytorch"
    for v in d.verdicts:
        assert v.eligible == (v.backend == "unfused")
        if not v.eligible:
            assert v.reasons, f"{v.id} rejected without a reason"


def test_te_scenario_on_a100_cudnn8_names_the_cudnn_seqlen_rule():
    d = explain(TE_CASE, A100_CUDNN8, NO_ENV)
    cudnn = " ".join(r.message + " " + (r.fix or "") for r in d.reasons("cudnn_fused"))
    assert "16534" in cudnn and "22" in cudnn and "64" in cudnn
    assert "9.0" in cudnn and "16576" in cudnn
    for v in d.verdicts:
        assert v.eligible or v.reasons


def test_te_scenario_with_nothing_else_allowed_raises_with_every_reason():
    env = EnvFlags.from_environ({"NVTE_FLASH_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"})
    with pytest.raises(NoBackendAvailableError) as info:
        select(TE_CASE, A100_CUDNN8, env)
    message = str(info.value)
    for table in TABLES.values():
        assert table.id in message
    assert "16534" in message and "NVTE_FLASH_ATTN=0" in message and "NVTE_UNFUSED_ATTN=0" in message
    assert info.value.decision.chosen is None


def test_te_scenario_on_hopper_cudnn9_picks_a_fused_backend():
    d = select(TE_CASE, H100, NO_ENV)
    assert d.backend in ("cudnn_fused", "flash_attn_4")


def test_forcing_an_ineligible_backend_raises_its_reasons_and_never_falls_back():
    params = AttentionParams(device_type="cpu")
    with pytest.raises(NoBackendAvailableError) as info:
        select(params, CPU, EnvFlags.from_environ({"ATTN_DISPATCH_BACKEND": "cudnn_fused"}))
    message = str(info.value)
    assert "ATTN_DISPATCH_BACKEND" in message and "cudnn_fused" in message and "CUDA" in message
    with pytest.raises(NoBackendAvailableError):
        select(params, CPU, NO_ENV, force="flash_attn_4")


def test_forcing_an_eligible_backend_picks_it():
    params = AttentionParams(max_seqlen_q=4096, attn_mask_type="causal")
    d = select(params, H100, NO_ENV, force="unfused")
    assert d.chosen == "unfused:pytorch" and d.forced == "unfused"
    d = select(params, H100, EnvFlags.from_environ({"ATTN_DISPATCH_BACKEND": "flash_attn_4"}))
    assert d.chosen == "flash_attn_4:cute"


def test_forcing_an_unknown_provider_is_a_value_error():
    with pytest.raises(ValueError, match="names no provider"):
        select(AttentionParams(), H100, NO_ENV, force="cudnn_fused:nope")


def test_env_disables_families_with_a_reason_and_fix():
    env = EnvFlags.from_environ({"NVTE_FUSED_ATTN": "0"})
    d = explain(AttentionParams(), H100, env)
    reasons = d.reasons("cudnn_fused")
    assert any(r.code == "cudnn_fused.env_disabled" and "NVTE_FUSED_ATTN=0" in r.message and r.fix for r in reasons)
    assert d.backend != "cudnn_fused"


def test_hopper_order_prefers_cudnn_like_transformer_engine():
    d = select(AttentionParams(max_seqlen_q=4096), H100, NO_ENV, policy="order")
    assert d.order[0] == "cudnn_fused" and d.backend == "cudnn_fused"


def test_ampere_order_prefers_flash_attention_2():
    d = select(AttentionParams(max_seqlen_q=4096), Platform.parse("a100-cudnn9"), NO_ENV)
    assert d.order[0] == "flash_attn_2" and d.backend == "flash_attn_2"


def test_decision_is_cached_and_identical_without_cache():
    params = AttentionParams(max_seqlen_q=2048, attn_mask_type="causal")
    first = explain(params, H100, NO_ENV)
    assert explain(params, H100, NO_ENV) is first
    assert explain(params, H100, NO_ENV, use_cache=False) == first


def test_summary_and_json_render_the_same_decision():
    d = explain(TE_CASE, A100_CUDNN8, NO_ENV)
    text = d.summary()
    assert "cudnn_fused" in text and "16534" in text
    from attn_dispatch.decision import Decision

    again = Decision.model_validate_json(d.model_dump_json())
    assert again.model_dump(mode="json") == d.model_dump(mode="json")
    assert again.summary() == text


def test_debug_logging_levels(caplog):
    env1 = EnvFlags.from_environ({"NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "1"})
    env2 = EnvFlags.from_environ({"NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "2"})
    params = AttentionParams(device_type="cpu", max_seqlen_q=77)
    with caplog.at_level(logging.DEBUG, logger="attn_dispatch"):
        explain(params, CPU, env1)
        explain(params, CPU, env1)  # once per new signature
    assert sum("selected unfused:pytorch" in r.message for r in caplog.records) == 1
    assert not any(r.levelno == logging.DEBUG for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="attn_dispatch"):
        explain(params, CPU, env2)
    assert any("cudnn_fused" in r.message and r.levelno == logging.DEBUG for r in caplog.records)
