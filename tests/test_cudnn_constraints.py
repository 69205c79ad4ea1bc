"""The cuDNN fused-attention tables on what-if platforms (no GPU needed), and the engines' pure helpers."""
from __future__ import annotations

import dataclasses

import math

import pytest
import torch

from attn_dispatch import runtime_facts

from attn_dispatch import AttentionParams, EnvFlags, Platform, explain
from attn_dispatch.constraints import TABLES
from attn_dispatch.constraints import cudnn_fused as cf
from attn_dispatch.backends import cudnn_fused as eng
from attn_dispatch.backends.base import AttnAux, AttnConfig

FRONTEND, TORCH = TABLES["cudnn_fused:frontend"], TABLES["cudnn_fused:torch"]
NO_ENV = EnvFlags()


def plat(spec: str) -> Platform:
    """A GPU with cudnn-frontend 1.32 unless the spec says otherwise."""
    base = Platform.parse(spec)
    if base.package("cudnn-frontend").installed or "no-cudnn-frontend" in spec:
        return base
    return base.with_packages(cudnn_frontend="1.32.0")


def params(**kw) -> AttentionParams:
    base = dict(dtype="bf16", batch_size=2, num_heads=16, head_dim_qk=128, max_seqlen_q=1024)
    base.update(kw)
    return AttentionParams(**base)


def codes(table, p, platform, env=NO_ENV) -> set[str]:
    return {r.code for r in table.evaluate(p, platform, env).reasons}


def reason(table, p, platform, code, env=NO_ENV):
    for r in table.evaluate(p, platform, env).reasons:
        if r.code == code:
            return r
    raise AssertionError(f"{code} not among {codes(table, p, platform, env)}")


# --- the scenario users hit with Transformer Engine ----------------------------------------------
def test_te_scenario_a100_cudnn897_seqlen_16534():
    p = AttentionParams(dtype="bf16", batch_size=48, max_seqlen_q=16534, num_heads=18, head_dim_qk=128,
                        cp_size=2, cp_comm_type="p2p")
    for table in (FRONTEND, TORCH):
        r = reason(table, p, plat("a100-cudnn8"), "cudnn_fused.seqlen_multiple_of_64")
        assert "16534" in r.message and "not a multiple of 64 (remainder 22)" in r.message
        assert "cuDNN >= 9.0" in r.fix and "pad to 16576" in r.fix
        assert "fused_attn.cpp" in r.source
    d = explain(p, plat("h100-cudnn9"), NO_ENV, policy="order")  # Transformer Engine's pick
    assert d.chosen == "cudnn_fused:frontend"
    assert d.verdict("cudnn_fused", "frontend").detail == {"sub_backend": "F16_arbitrary_seqlen"}


def test_seqlen_rule_names_each_length_and_vanishes_with_cudnn9():
    p = params(max_seqlen_q=1000, max_seqlen_kv=2048)
    r = reason(FRONTEND, p, plat("sm80,cudnn=8.9.7"), "cudnn_fused.seqlen_multiple_of_64")
    assert "max_seqlen_q=1000" in r.message and "remainder 40" in r.message and "max_seqlen_kv" not in r.message
    assert "pad to 1024" in r.fix
    assert "cudnn_fused.seqlen_multiple_of_64" not in codes(FRONTEND, p, plat("sm80,cudnn=9.0.0"))


# --- platform, package, runtime -----------------------------------------------------------------------
@pytest.mark.parametrize("spec, eligible", [
    ("sm70,cudnn=9.19.0", False), ("sm80,cudnn=8.9.0", True), ("sm86,cudnn=8.9.2", False),
    ("sm86,cudnn=8.9.3", True), ("sm100,cudnn=9.5.0", False), ("sm100,cudnn=9.7.0", True),
    ("sm90,cudnn=9.10.0", False), ("sm90,cudnn=9.10.2", True),
])
def test_architecture_and_version(spec, eligible):
    p = params(max_seqlen_q=1024)
    found = codes(FRONTEND, p, plat(spec)) & {"cudnn_fused.compute_capability", "cudnn_fused.arch_version",
                                               "cudnn_fused.cudnn_known_bad"}
    assert (not found) == eligible, found


def test_blackwell_message_names_the_version():
    r = reason(FRONTEND, params(), plat("sm100,cudnn=9.5.0"), "cudnn_fused.arch_version")
    assert "9.7.0" in r.message and "9.5.0" in r.message


def test_package_and_runtime():
    p = params()
    assert "cudnn_fused.package" in codes(FRONTEND, p, Platform.parse("h100-cudnn9,no-cudnn-frontend"))
    assert "cudnn_fused.package" not in codes(TORCH, p, Platform.parse("h100-cudnn9,no-cudnn-frontend"))
    r = reason(FRONTEND, p, plat("h100-cudnn9,no-cudnn"), "cudnn_fused.cudnn_runtime")
    assert "no cuDNN runtime" in r.message
    assert "cudnn_fused.torch_cudnn_sdpa" in codes(TORCH, p, Platform.parse("sm80,cudnn=8.9.7"))
    assert "cudnn_fused.compute_capability" in codes(FRONTEND, params(device_type="cpu"), Platform.parse("cpu"))


def test_env_disables_the_family():
    env = EnvFlags.from_environ({"NVTE_FUSED_ATTN": "0"})
    for table in (FRONTEND, TORCH):
        assert "cudnn_fused.env_disabled" in codes(table, params(), plat("h100-cudnn9"), env)


# --- head dims per architecture and version -------------------------------------------------------------
@pytest.mark.parametrize("spec, dqk, dv, training, ok", [
    ("sm90,cudnn=9.4.0", 256, 256, True, False),
    ("sm90,cudnn=9.5.0", 256, 256, True, True),
    ("sm90,cudnn=9.0.0", 256, 256, False, False),
    ("sm90,cudnn=9.1.0", 256, 256, False, True),
    ("sm80,cudnn=9.10.2", 256, 256, True, False),
    ("sm80,cudnn=9.10.2", 256, 256, False, True),   # 9.10.2: any head dim, any arch, forward
    ("sm80,cudnn=9.9.0", 160, 160, False, False),
    ("sm100,cudnn=9.19.0", 192, 128, True, True),   # 9.11: (192, 128) backward on Blackwell
    ("sm100,cudnn=9.10.2", 192, 128, True, False),
    ("sm100,cudnn=9.9.0", 512, 512, False, True),   # 9.9: any head dim, Blackwell forward
    ("sm80,cudnn=9.19.0", 128, 64, True, True),
])
def test_head_dim_limits(spec, dqk, dv, training, ok):
    p = params(head_dim_qk=dqk, head_dim_v=dv, is_training=training)
    assert ("cudnn_fused.head_dim_limit" not in codes(FRONTEND, p, plat(spec))) == ok


def test_head_dim_messages_say_what_would_work():
    r = reason(FRONTEND, params(head_dim_qk=256), plat("sm80,cudnn=9.10.2"), "cudnn_fused.head_dim_limit")
    assert "sm90" in r.message and "9.5.0" in r.message and "sm80" in r.message
    r = reason(FRONTEND, params(head_dim_qk=100), plat("h100-cudnn9"), "cudnn_fused.head_dim_multiple_of_8")
    assert "head_dim_qk=100" in r.message and "multiple of 8" in r.fix


def test_hopper_mla_backward_bug_window():
    p = params(head_dim_qk=256, head_dim_v=128)
    assert "cudnn_fused.head_dim_hopper_mla_bwd" in codes(FRONTEND, p, plat("sm90,cudnn=9.11.0"))
    assert "cudnn_fused.head_dim_hopper_mla_bwd" not in codes(FRONTEND, params(head_dim_qk=192, head_dim_v=128),
                                                              plat("sm90,cudnn=9.11.0"))
    assert "cudnn_fused.head_dim_hopper_mla_bwd" not in codes(FRONTEND, p.replace(is_training=False),
                                                              plat("sm90,cudnn=9.11.0"))


def test_gqa_and_dqk_ne_dv_versions():
    p = params(num_gqa_groups=4)
    assert "cudnn_fused.gqa" in codes(FRONTEND, p, plat("sm90,cudnn=8.9.6"))
    assert "cudnn_fused.gqa" not in codes(FRONTEND, p, plat("sm90,cudnn=8.9.7"))
    p = params(head_dim_qk=128, head_dim_v=64)
    assert "cudnn_fused.head_dim_qk_ne_v" in codes(FRONTEND, p, plat("sm90,cudnn=8.9.5"))


# --- masks, windows -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, sq, skv, mask, ok", [
    ("sm90,cudnn=9.2.0", 128, 256, "causal_bottom_right", False),
    ("sm90,cudnn=9.3.0", 128, 256, "causal_bottom_right", True),
    ("sm90,cudnn=9.3.0", 100, 200, "causal_bottom_right", False),    # < 9.7: multiples of 64
    ("sm90,cudnn=9.7.0", 100, 200, "causal_bottom_right", True),
    ("sm90,cudnn=9.19.0", 256, 128, "causal_bottom_right", False),   # sq > skv never
    ("sm90,cudnn=9.2.0", 256, 256, "causal_bottom_right", True),     # equal lengths: it is plain causal
    ("sm90,cudnn=9.5.0", 128, 256, "padding_causal_bottom_right", False),
    ("sm90,cudnn=9.6.0", 128, 256, "padding_causal_bottom_right", True),
    ("sm90,cudnn=8.9.5", 128, 128, "padding", False),
    ("sm90,cudnn=8.9.6", 128, 128, "padding", True),
    ("sm90,cudnn=8.9.5", 128, 128, "no_mask", False),
    ("sm90,cudnn=8.9.5", 128, 128, "causal", True),
    ("sm90,cudnn=9.19.0", 128, 128, "arbitrary", False),
])
def test_mask_versions(spec, sq, skv, mask, ok):
    p = params(max_seqlen_q=sq, max_seqlen_kv=skv, attn_mask_type=mask)
    assert ("cudnn_fused.mask_type" not in codes(FRONTEND, p, plat(spec))) == ok


def test_bottom_right_before_97_excludes_bias_and_dropout():
    p = params(max_seqlen_q=128, max_seqlen_kv=256, attn_mask_type="causal_bottom_right", dropout=0.1)
    r = reason(FRONTEND, p, plat("sm90,cudnn=9.5.0"), "cudnn_fused.mask_type")
    assert "no dropout" in r.message and "9.7.0" in r.fix


@pytest.mark.parametrize("spec, mask, window, extra, ok", [
    ("sm90,cudnn=9.1.0", "causal", (16, 0), {}, False),
    ("sm90,cudnn=9.2.0", "causal", (16, 0), {}, True),
    ("sm90,cudnn=9.2.0", "causal", (16, 0), {"dropout": 0.1}, False),
    ("sm90,cudnn=9.5.0", "padding", (8, 8), {}, False),
    ("sm90,cudnn=9.6.0", "padding", (8, 8), {}, True),
    ("sm90,cudnn=9.19.0,cudnn-frontend=1.12.0", "no_mask", (8, 8), {}, False),  # TE: two-sided needs padding/br
    ("sm90,cudnn=9.19.0", "no_mask", (8, 8), {}, True),              # probed stack: a diagonal band
    ("sm90,cudnn=9.19.0", "no_mask", (8, 8), {"max_seqlen_kv": 512}, False),  # sq > skv still excluded
    ("sm90,cudnn=9.19.0", "no_mask", (-1, 8), {}, False),            # right bound only: not probed
    ("sm90,cudnn=9.19.0", "causal", (16, 0), {"max_seqlen_kv": 512}, False),  # sq > skv
    ("sm90,cudnn=9.14.0", "padding", (64, 0), {"max_seqlen_q": 2048}, False),  # 9.14.0 bug
])
def test_sliding_window_versions(spec, mask, window, extra, ok):
    p = params(attn_mask_type=mask, window_size=window, **extra)
    assert ("cudnn_fused.sliding_window" not in codes(FRONTEND, p, plat(spec))) == ok


# --- bias and ALiBi -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, kw, ok", [
    ("sm80,cudnn=8.9.7", dict(bias_type="post_scale_bias", bias_shape="1hss"), False),
    ("sm90,cudnn=8.9.7", dict(bias_type="post_scale_bias", bias_shape="1hss"), True),
    ("sm80,cudnn=9.0.0", dict(bias_type="post_scale_bias", bias_shape="bhss"), True),
    ("sm90,cudnn=9.19.0", dict(bias_type="pre_scale_bias", bias_shape="1hss"), False),
    ("sm80,cudnn=9.19.0", dict(bias_type="alibi", attn_mask_type="causal"), False),
    ("sm90,cudnn=9.19.0", dict(bias_type="alibi", attn_mask_type="causal"), True),
    ("sm90,cudnn=9.18.1", dict(bias_type="alibi"), False),                       # built-in ALiBi is causal
    ("sm90,cudnn=9.19.0", dict(bias_type="alibi"), True),                        # probed: a bias tensor
    ("sm100,cudnn=9.19.0", dict(bias_type="alibi"), False),                      # not probed on Blackwell
    ("sm80,cudnn=9.19.0", dict(bias_type="alibi", max_seqlen_kv=2048), True),    # sq != skv: a bias tensor
])
def test_bias_types(spec, kw, ok):
    assert ("cudnn_fused.bias_type" not in codes(FRONTEND, params(**kw), plat(spec))) == ok


def test_bias_with_padding_and_bias_grad_shape():
    p = params(bias_type="post_scale_bias", bias_shape="1hss", attn_mask_type="padding")
    assert "cudnn_fused.bias_with_padding" in codes(FRONTEND, p, plat("h100-cudnn9"))
    p = params(bias_type="post_scale_bias", bias_shape="bhss", bias_requires_grad=True)
    r = reason(FRONTEND, p, plat("h100-cudnn9"), "cudnn_fused.bias_grad_shape")
    assert "[1, h, sq, skv]" in r.message
    assert "cudnn_fused.bias_grad_shape" not in codes(FRONTEND, p.replace(bias_shape="1hss"), plat("h100-cudnn9"))
    assert "cudnn_fused.torch_bias" in codes(TORCH, p.replace(bias_shape="1hss"), plat("h100-cudnn9"))
    assert "cudnn_fused.torch_bias" not in codes(TORCH, p.replace(bias_requires_grad=False), plat("h100-cudnn9"))


# --- formats -------------------------------------------------------------------------------------------
def test_thd_rules():
    p = params(qkv_format="thd", attn_mask_type="padding_causal")
    assert "cudnn_fused.qkv_format" in codes(FRONTEND, p, plat("sm80,cudnn=9.19.0"))
    found = codes(FRONTEND, p, plat("sm90,cudnn=9.1.0"))
    assert "cudnn_fused.qkv_format" not in found and "cudnn_fused.thd_ragged_stats" in found
    assert "cudnn_fused.qkv_format" in codes(FRONTEND, p.replace(num_gqa_groups=4), plat("sm90,cudnn=9.5.0"))
    assert not codes(FRONTEND, p.replace(num_gqa_groups=4), plat("h100-cudnn9"))
    assert "cudnn_fused.torch_format" in codes(TORCH, p, plat("h100-cudnn9"))


def test_torch_provider_is_narrower():
    h100 = plat("h100-cudnn9")
    assert not codes(TORCH, params(attn_mask_type="causal"), h100)
    assert "cudnn_fused.torch_mask" in codes(TORCH, params(attn_mask_type="padding"), h100)
    assert "cudnn_fused.torch_mask" in codes(TORCH, params(attn_mask_type="causal", window_size=(64, 0)), h100)
    assert "cudnn_fused.torch_mask" in codes(TORCH, params(attn_mask_type="causal_bottom_right",
                                                            max_seqlen_kv=2048), h100)
    assert "cudnn_fused.torch_softmax" in codes(TORCH, params(softmax_type="learnable"), h100)
    assert "cudnn_fused.torch_dropout" in codes(TORCH, params(dropout=0.1), plat("sm90,cudnn=9.12.0"))
    assert "cudnn_fused.torch_shape_limits" in codes(TORCH, params(max_seqlen_kv=1, is_training=False),
                                                     plat("sm90,cudnn=9.10.2,torch=2.7.1"))
    assert "cudnn_fused.torch_shape_limits" in codes(TORCH, params(batch_size=70000), h100)


# --- determinism ------------------------------------------------------------------------------------------
def test_determinism_per_arch_and_version():
    strict = EnvFlags.from_environ({"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"})
    p = params()
    r = reason(FRONTEND, p, plat("sm100,cudnn=9.18.0"), "cudnn_fused.determinism", strict)
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0" in r.message and "9.18.1" in r.message
    assert "cudnn_fused.determinism" not in codes(FRONTEND, p, plat("sm100,cudnn=9.18.1"), strict)
    assert "cudnn_fused.determinism" in codes(FRONTEND, p.replace(dropout=0.1), plat("sm100,cudnn=9.18.1"), strict)
    assert "cudnn_fused.determinism" in codes(FRONTEND, p, plat("sm80,cudnn=8.9.7"), strict)
    assert "cudnn_fused.determinism" not in codes(FRONTEND, p, plat("h100-cudnn9"), strict)
    assert "cudnn_fused.determinism" not in codes(FRONTEND, p.replace(is_training=False), plat("sm80,cudnn=8.9.7"),
                                                  strict)
    assert "cudnn_fused.torch_deterministic" in codes(TORCH, p.replace(deterministic=True), plat("h100-cudnn9"))


# --- softmax sinks, CP, FP8, the rest ------------------------------------------------------------------------
def test_softmax_sinks():
    p = params(softmax_type="off-by-one")
    assert "cudnn_fused.softmax_type" in codes(FRONTEND, p, plat("sm90,cudnn=9.13.0"))
    assert not codes(FRONTEND, p, plat("sm90,cudnn=9.13.1"))
    assert "cudnn_fused.frontend_sink" in codes(FRONTEND, p, Platform.parse("sm90,cudnn=9.19.0,cudnn-frontend=1.14.0"))
    # our context parallelism merges the sink once over vanilla blocks: any comm type serves a sink
    for comm in ("p2p", "all_gather", "a2a"):
        assert not codes(FRONTEND, p.replace(cp_size=2, cp_comm_type=comm, attn_mask_type="causal"),
                         plat("h100-cudnn9"))


def test_context_parallel_fp8_kv_cache_max_logit():
    h100 = plat("h100-cudnn9")
    for comm in ("p2p", "all_gather", "a2a"):
        assert not codes(FRONTEND, params(cp_size=2, cp_comm_type=comm), h100)
    assert not codes(FRONTEND, params(cp_size=4, cp_comm_type="a2a+p2p"), h100)
    # sliding windows under CP: not with thd under p2p (our rule, as Transformer Engine's); bshd windows are ours
    thd_window = params(cp_size=2, qkv_format="thd", attn_mask_type="padding", window_size=(64, 64))
    assert "cudnn_fused.cp_support" in codes(FRONTEND, thd_window, h100)
    assert "cudnn_fused.cp_support" not in codes(FRONTEND, params(cp_size=2, window_size=(64, 64)), h100)
    assert "cudnn_fused.fp8" in codes(FRONTEND, params(fp8=True), h100)
    assert "cudnn_fused.dtype" in codes(FRONTEND, params(dtype="float32"), h100)
    assert "cudnn_fused.kv_cache" not in codes(FRONTEND, params(inference_kv_cache=True, is_training=False), h100)
    paged = params(inference_kv_cache=True, kv_cache_paged=True, kv_page_size=64, is_training=False)
    assert not codes(FRONTEND, paged, h100)  # cuDNN 9.19: page tables (>= 9.5), any head dim
    old = plat("h100-cudnn9")
    old = dataclasses.replace(old, cudnn_version="9.4.0")
    assert "cudnn_fused.kv_cache_paged" in codes(FRONTEND, paged, old)
    wide = params(inference_kv_cache=True, kv_cache_paged=True, kv_page_size=64, is_training=False, head_dim_qk=192,
                  head_dim_v=192)
    assert "cudnn_fused.kv_cache_paged" in codes(FRONTEND, wide, dataclasses.replace(old, cudnn_version="9.8.0"))
    assert "cudnn_fused.return_max_logit" in codes(FRONTEND, params(return_max_logit=True), h100)


# --- NVTE_FUSED_ATTN_BACKEND: pinning a sub-backend -----------------------------------------------------------
def test_pinning_max512_reports_its_limits():
    env = EnvFlags.from_environ({"NVTE_FUSED_ATTN_BACKEND": "0"})
    r = reason(FRONTEND, params(max_seqlen_q=1000), plat("h100-cudnn9"), "cudnn_fused.sub_backend_pin", env)
    assert "F16_max512_seqlen" in r.message and "max_seqlen_q <= 512 and a multiple of 64 (got 1000)" in r.message
    assert "head dims of exactly 64 (got 128/128)" in r.message and "NVTE_FUSED_ATTN_BACKEND" in r.fix
    ok = params(max_seqlen_q=512, head_dim_qk=64, attn_mask_type="causal")
    v = FRONTEND.evaluate(ok, plat("h100-cudnn9"), env)
    assert v.eligible and v.detail == {"sub_backend": "F16_max512_seqlen"}
    for kw, words in ((dict(num_gqa_groups=4), "no GQA"), (dict(window_size=(64, 0)), "no sliding window"),
                      (dict(attn_mask_type="causal_bottom_right", max_seqlen_kv=448), "no_mask, causal, padding"),
                      (dict(qkv_format="sbhd"), "bshd")):
        assert words in reason(FRONTEND, ok.replace(**kw), plat("h100-cudnn9"), "cudnn_fused.sub_backend_pin",
                               env).message
    assert "sm80 or sm90 exactly" in reason(FRONTEND, ok, plat("sm100,cudnn=9.19.0"), "cudnn_fused.sub_backend_pin",
                                            env).message
    assert "cudnn_fused.torch_sub_backend_pin" in codes(TORCH, ok, plat("h100-cudnn9"), env)


def test_pinning_fp8_or_arbitrary():
    fp8 = EnvFlags.from_environ({"NVTE_FUSED_ATTN_BACKEND": "2"})
    assert "FP8" in reason(FRONTEND, params(), plat("h100-cudnn9"), "cudnn_fused.sub_backend_pin", fp8).message
    arb = EnvFlags.from_environ({"NVTE_FUSED_ATTN_BACKEND": "1"})
    v = FRONTEND.evaluate(params(), plat("h100-cudnn9"), arb)
    assert v.eligible and v.detail == {"sub_backend": "F16_arbitrary_seqlen"}


# --- run-time rejections reach explain() on the live platform only ---------------------------------------------
def test_runtime_rejection_is_reported_on_live_platform_only(monkeypatch):
    monkeypatch.setattr(runtime_facts, "_CURRENT", [runtime_facts.RuntimeFacts()])
    p = params(attn_mask_type="causal")
    runtime_facts.record_rejection(cf.rejection_signature(p, False, "bwd"), "cudnnGraphNotSupportedError: no engine")
    live = dataclasses.replace(plat("h100-cudnn9"), facts=runtime_facts.current(), name="live")
    r = reason(FRONTEND, p, live, "cudnn_fused.cudnn_rejected")
    assert "bwd graph" in r.message and "no engine" in r.message
    assert "cudnn_fused.cudnn_rejected" not in codes(FRONTEND, p.replace(is_training=False), live)
    assert "cudnn_fused.cudnn_rejected" not in codes(FRONTEND, p, plat("h100-cudnn9"))


def test_every_check_declares_a_source_and_requirement():
    for table in (FRONTEND, TORCH):
        assert table.family == "cudnn_fused"
        for c in table.checks:
            assert c.code.startswith("cudnn_fused.") and c.source and c.requires and c.topic


# --- engine helpers (pure torch, CPU) --------------------------------------------------------------------------
def test_engine_module_imports_without_cudnn_and_construction_says_why():
    import importlib.util

    if importlib.util.find_spec("cudnn") is not None:
        pytest.skip("cudnn-frontend is installed here")
    with pytest.raises(ImportError):
        eng.CudnnFrontendEngine()


def test_default_alibi_slopes_match_the_standard_formula():
    for h in (8, 12, 16):
        n = 2 ** math.floor(math.log2(h))
        expected = [2 ** (-8 * (i + 1) / n) for i in range(n)] + [2 ** (-4 * (2 * i + 1) / n) for i in range(h - n)]
        assert torch.allclose(eng.alibi_default_slopes(h), torch.tensor(expected))


def test_alibi_bias_alignment():
    slopes = torch.tensor([0.5, 0.25])
    top = eng.alibi_bias(slopes, 2, 4, top_left=True, dtype=torch.float32)
    bottom = eng.alibi_bias(slopes, 2, 4, top_left=False, dtype=torch.float32)
    assert top.shape == (1, 2, 2, 4)
    assert top[0, 0, 1].tolist() == [-0.5, 0.0, -0.5, -1.0]            # |i - j| for row 1
    assert bottom[0, 1, 0].tolist() == [-0.5, -0.25, 0.0, -0.25]       # |i + 2 - j| for row 0


@pytest.mark.parametrize("mask, window, sq, skv, padding, expected", [
    ("no_mask", (-1, -1), 128, 128, False, (None, None, None)),
    ("causal", (-1, 0), 64, 128, False, ("top_left", None, 0)),
    ("causal_bottom_right", (-1, 0), 64, 128, False, ("bottom_right", None, 0)),
    ("causal_bottom_right", (-1, 0), 128, 128, False, ("top_left", None, 0)),
    ("causal", (16, 0), 128, 128, False, ("top_left", 17, 0)),           # left_bound = window_left + 1
    ("padding", (8, 8), 128, 128, True, ("bottom_right", 9, 8)),
    ("padding_causal", (4, 0), 128, 128, True, ("top_left", 5, 0)),
])
def test_window_to_cudnn_band(mask, window, sq, skv, padding, expected):
    call = eng._Call("bshd", 2, 4, 4, sq, skv, 64, 64, padding)
    assert eng._mask_args(AttnConfig(attn_mask_type=mask, window_size=window), call) == expected


def test_layout_strides_and_buckets():
    x = torch.empty(2, 100, 4, 64)                                        # bshd
    assert eng._describe(x, "bshd", 100) == ((100 * 256, 64, 256, 1), None)
    assert eng._describe(x.transpose(0, 1).contiguous(), "sbhd", 2) == ((256, 64, 2 * 256, 1), None)
    t = torch.empty(300, 4, 64)
    assert eng._describe(t, "thd", 128) == ((128 * 256, 64, 256, 1), 256)
    packed = torch.empty(300, 3, 4, 64)[:, 1]                             # q from a packed qkv
    assert eng._describe(packed, "thd", 128)[1] == 3 * 256
    assert [eng._bucket(n) for n in (1, 64, 65, 1000, 4096)] == [64, 64, 128, 1024, 4096]


def test_lengths_from_padding_masks():
    m = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    m[0, ..., :4] = False
    m[1, ..., :6] = False
    q, kv = eng._lens_from_mask(m, 2, 6, 6)
    assert q.tolist() == [4, 6] and kv.tolist() == [4, 6]
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        eng._lens_from_mask(m, 2, 5, 6)


def test_prepare_rejects_bad_inputs_with_the_argument_named():
    q = torch.randn(2, 8, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        eng._prepare(q, q, q, AttnAux(), AttnConfig())
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        eng._prepare(q.float(), q.float(), q.float(), AttnAux(), AttnConfig())
    with pytest.raises(ValueError, match="qkv_format='thd' needs 3 dims"):
        eng._prepare(q, q, q, AttnAux(), AttnConfig(qkv_format="thd"))


def test_torch_engine_validation_names_what_is_unsupported():
    q = torch.randn(2, 8, 4, 64)
    for cfg, words in ((AttnConfig(qkv_format="thd"), "bshd or sbhd"),
                       (AttnConfig(attn_mask_type="padding"), "no_mask"),
                       (AttnConfig(attn_mask_type="causal", window_size=(8, 0)), "sliding window"),
                       (AttnConfig(softmax_type="learnable"), "sink"), (AttnConfig(bias_type="alibi"), "post-scale")):
        with pytest.raises(ValueError, match=words):
            eng.TorchCudnnEngine._validate(q, AttnAux(), cfg)


def test_alibi_with_padding_is_not_offered_by_the_frontend_engine():
    p = params(bias_type="alibi", attn_mask_type="padding_causal_bottom_right", max_seqlen_kv=2048)
    assert "cudnn_fused.alibi_padding" in codes(FRONTEND, p, plat("h100-cudnn9"))
    assert "cudnn_fused.alibi_padding" not in codes(FRONTEND, params(bias_type="alibi", attn_mask_type="causal"),
                                                    plat("h100-cudnn9"))


# --- cuDNN's own graph validation (cudnn-frontend 1.32 _sdpa_validate.py / sdpa_support_surface.h) ---------------
@pytest.mark.parametrize("kw, ok", [
    (dict(attn_mask_type="causal_bottom_right", max_seqlen_kv=2048, bias_type="post_scale_bias", bias_shape="1hss"),
     False),
    (dict(attn_mask_type="causal_bottom_right", bias_type="post_scale_bias", bias_shape="1hss"), True),  # sq == skv
    (dict(attn_mask_type="causal_bottom_right", max_seqlen_kv=2048, bias_type="alibi", alibi_slopes_shape="bh"),
     False),
    (dict(attn_mask_type="causal", max_seqlen_kv=2048, bias_type="alibi", alibi_slopes_shape="bh"), True),
    (dict(attn_mask_type="padding_causal_bottom_right", dropout=0.1), False),        # padded: bottom-right always
    (dict(attn_mask_type="padding_causal_bottom_right", dropout=0.1, is_training=False), True),
    (dict(attn_mask_type="no_mask", window_size=(-1, 0), max_seqlen_kv=2048, dropout=0.1), False),
    (dict(attn_mask_type="padding_causal", dropout=0.1), True),                        # top-left
])
def test_bottom_right_bands_exclude_bias_alibi_dropout(kw, ok):
    found = codes(FRONTEND, params(**kw), plat("h100-cudnn9"))
    assert ("cudnn_fused.diagonal_band" not in found) == ok, found


def test_diagonal_band_message_and_source():
    p = params(attn_mask_type="causal_bottom_right", max_seqlen_kv=2048, bias_type="alibi", alibi_slopes_shape="bh")
    r = reason(FRONTEND, p, plat("h100-cudnn9"), "cudnn_fused.diagonal_band")
    assert "bottom_right" in r.message and "ALiBi (as a bias tensor)" in r.message and "top-left" in r.fix
    assert "_sdpa_validate.py" in r.source
    assert cf.graph_band(p) == ("bottom_right", None, 0)
    assert cf.graph_band(p.replace(attn_mask_type="causal")) == ("top_left", None, 0)
    assert cf.graph_band(params(attn_mask_type="padding", window_size=(8, 8))) == ("bottom_right", 9, 8)


def test_single_token_backward_and_decode_sink():
    h100 = plat("h100-cudnn9")
    one = params(max_seqlen_q=1, max_seqlen_kv=1)
    assert "cudnn_fused.backward_single_token" in codes(FRONTEND, one, h100)
    assert "cudnn_fused.backward_single_token" not in codes(FRONTEND, one.replace(is_training=False), h100)
    thd = one.replace(qkv_format="thd", attn_mask_type="padding")              # the thd graph is bucketed to 64
    assert "cudnn_fused.backward_single_token" not in codes(FRONTEND, thd, h100)
    sink = params(softmax_type="off-by-one", max_seqlen_q=1, max_seqlen_kv=512, is_training=False)
    assert "cudnn_fused.decode_sink" in codes(FRONTEND, sink, h100)
    assert "cudnn_fused.decode_sink" not in codes(FRONTEND, sink.replace(max_seqlen_q=2), h100)


def test_hopper_911_backward_head_dim_pairs():
    p = params(head_dim_qk=160, head_dim_v=96)
    assert "cudnn_fused.head_dim_hopper_mla_bwd" in codes(FRONTEND, p, plat("sm90,cudnn=9.11.0"))
    assert "cudnn_fused.head_dim_hopper_mla_bwd" not in codes(FRONTEND, p, plat("sm90,cudnn=9.13.0"))
    assert "cudnn_fused.head_dim_hopper_mla_bwd" not in codes(FRONTEND, p.replace(head_dim_qk=192),
                                                              plat("sm90,cudnn=9.11.0"))


# --- relaxations observed by the H100 probe (cuDNN 9.19.0, cudnn-frontend 1.32.0, torch 2.11) ----------------
def probe_case(**kw) -> AttentionParams:
    """A configuration as the probe ran it (bf16, b=2, h=4, d=64, s=128, training)."""
    base = dict(dtype="bf16", batch_size=2, num_heads=4, head_dim_qk=64, max_seqlen_q=128, max_seqlen_kv=128)
    base.update(kw)
    return AttentionParams(**base)


OLD_FRONTEND = "sm90,cudnn=9.10.2,cudnn-frontend=1.12.0"
OLD_TORCH = "sm90,cudnn=9.10.2,torch=2.7.1"

PROBE_TOO_STRICT = [  # (provider, params, check it relaxes, older specs that keep Transformer Engine's rule)
    ("frontend", probe_case(head_dim_qk=128, head_dim_v=256), "head_dim_hopper_mla_bwd",
     ("sm90,cudnn=9.18.1", "sm90,cudnn=9.19.0,cudnn-frontend=1.31.0")),
    ("frontend", probe_case(head_dim_qk=256, head_dim_v=128), "head_dim_hopper_mla_bwd",
     ("sm90,cudnn=9.18.1", "sm90,cudnn=9.19.0,cudnn-frontend=1.31.0")),
    ("torch", probe_case(head_dim_qk=128, head_dim_v=256), "head_dim_hopper_mla_bwd",
     ("sm90,cudnn=9.18.1", "sm90,cudnn=9.19.0,torch=2.10.0")),
    ("torch", probe_case(head_dim_qk=256, head_dim_v=128), "head_dim_hopper_mla_bwd",
     ("sm90,cudnn=9.18.1", "sm90,cudnn=9.19.0,torch=2.10.0")),
    ("frontend", probe_case(window_size=(32, 32)), "sliding_window", (OLD_FRONTEND, "sm90,cudnn=9.18.1")),
    ("frontend", probe_case(window_size=(32, 32), max_seqlen_q=96, max_seqlen_kv=160), "sliding_window",
     (OLD_FRONTEND, "sm90,cudnn=9.18.1")),
    ("frontend", probe_case(window_size=(64, -1)), "sliding_window", (OLD_FRONTEND, "sm90,cudnn=9.18.1")),
    ("frontend", probe_case(window_size=(64, -1), max_seqlen_q=96, max_seqlen_kv=160), "sliding_window",
     (OLD_FRONTEND, "sm90,cudnn=9.18.1")),
    ("frontend", probe_case(bias_type="alibi", alibi_slopes_shape="h"), "bias_type",
     (OLD_FRONTEND, "sm90,cudnn=9.19.0,cudnn-frontend=1.31.0")),
    ("torch", probe_case(max_seqlen_q=512, max_seqlen_kv=1), "torch_shape_limits",
     (OLD_TORCH, "sm90,cudnn=9.19.0,torch=2.10.0", "sm90,cudnn=9.18.1")),
]


@pytest.mark.parametrize("provider, p, check, older", PROBE_TOO_STRICT)
def test_probe_too_strict_cases_are_accepted_on_the_probed_stack_only(provider, p, check, older):
    table = TABLES[f"cudnn_fused:{provider}"]
    assert not codes(table, p, plat("h100-cudnn9")), "the probe saw this run and match the reference"
    for spec in older:
        r = reason(table, p, plat(spec), f"cudnn_fused.{check}")
        assert "9.19.0" in r.message or "9.19.0" in (r.fix or ""), r.message  # says where it is verified
    source = next(c.source for c in table.checks if c.code == f"cudnn_fused.{check}")
    assert cf.PROBE_H100 in source and "benchmarks/results/probe_h100.json" in source


def test_probe_relaxations_need_the_probed_architecture():
    """The probe ran on sm90: Blackwell keeps Transformer Engine's rules even with the same versions."""
    b200 = plat("b200-cudnn9")
    assert "cudnn_fused.sliding_window" in codes(FRONTEND, probe_case(window_size=(32, 32)), b200)
    assert "cudnn_fused.bias_type" in codes(FRONTEND, probe_case(bias_type="alibi"), b200)
    assert "cudnn_fused.torch_shape_limits" in codes(TORCH, probe_case(max_seqlen_q=512, max_seqlen_kv=1), b200)
    assert not cf.probed(plat("cpu"), "frontend")


def test_probe_relaxations_stay_as_narrow_as_observed():
    h100 = plat("h100-cudnn9")
    # MLA backward: only the probed head-dim pairs; the rest of TE's exclusion stands
    r = reason(FRONTEND, probe_case(head_dim_qk=160, head_dim_v=224), h100, "cudnn_fused.head_dim_hopper_mla_bwd")
    assert "(128, 256) and (256, 128)" in r.message
    # windows without a mask: still no bias, no dropout, s_q <= s_kv; never through torch's op
    for kw in (dict(dropout=0.1), dict(bias_type="post_scale_bias", bias_shape="1hss"),
               dict(max_seqlen_q=160, max_seqlen_kv=96)):
        assert "cudnn_fused.sliding_window" in codes(FRONTEND, probe_case(window_size=(32, 32), **kw), h100), kw
    assert "cudnn_fused.torch_mask" in codes(TORCH, probe_case(window_size=(32, 32)), h100)
    # ALiBi without a mask: frontend only (torch's op takes no ALiBi), not with padding
    assert "cudnn_fused.bias_type" in codes(TORCH, probe_case(bias_type="alibi"), h100)
    assert "cudnn_fused.alibi_padding" in codes(FRONTEND, probe_case(bias_type="alibi", attn_mask_type="padding"),
                                                h100)
    # s_kv = 1 through torch's op: with s_q > 1, as probed
    assert "cudnn_fused.torch_shape_limits" in codes(TORCH, probe_case(max_seqlen_q=1, max_seqlen_kv=1,
                                                                       is_training=False), h100)


def test_probe_relaxed_windows_are_the_bands_the_engine_declares():
    """The engine turns a no_mask window into cuDNN's diagonal band (left + 1, right): what the probe ran."""
    for (sq, skv), align in (((128, 128), "top_left"), ((96, 160), "bottom_right")):
        call = eng._Call("bshd", 2, 4, 4, sq, skv, 64, 64, False)
        assert eng._mask_args(AttnConfig(window_size=(32, 32)), call) == (align, 33, 32)
        assert eng._mask_args(AttnConfig(window_size=(64, -1)), call) == (align, 65, None)
        p = probe_case(window_size=(32, 32), max_seqlen_q=sq, max_seqlen_kv=skv)
        assert cf.graph_band(p) == (align, 33, 32) and not cf.band_problems(p, plat("h100-cudnn9"))


def test_torch_deterministic_stays_and_says_why():
    p = probe_case(deterministic=True)
    for spec in ("h100-cudnn9", OLD_TORCH):
        r = reason(TORCH, p, plat(spec), "cudnn_fused.torch_deterministic")
        assert "deterministic=True" in r.message and "no such flag" in r.message
        assert "bitwise" in r.message and "cudnn_fused:frontend" in r.fix
    r = reason(TORCH, probe_case(), plat("h100-cudnn9"), "cudnn_fused.torch_deterministic",
               EnvFlags(allow_nondeterministic=False))
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0" in r.message
    assert not codes(FRONTEND, p, plat("h100-cudnn9"))
