"""The FlashAttention constraint tables, asked about other machines (what-if platforms) on the CPU."""
from __future__ import annotations

import dataclasses

import pytest

from attn_dispatch import AttentionParams, EnvFlags, Platform, explain
from attn_dispatch.constraints import TABLES
from attn_dispatch.platform import PackageStatus

NO_ENV = EnvFlags.from_environ({})
FA_IDS = ("flash_attn_2:package", "flash_attn_2:torch", "flash_attn_3:interface", "flash_attn_4:cute")
H100 = Platform.parse("h100-cudnn9")                       # torch 2.11, flash-attn-4 4.0.0b36, no FA2/FA3 packages
H100_ALL = Platform.parse("h100-cudnn9,flash-attn=2.8.3,flash-attn-3=3.0.0b1")
A100 = Platform.parse("a100-cudnn9")                       # flash-attn 2.7.4, torch 2.7.1
RTX4090 = Platform.parse("rtx4090-cudnn9")                 # sm89
B200 = Platform.parse("b200-cudnn9")
BASE = AttentionParams(dtype="bf16", batch_size=2, num_heads=16, head_dim_qk=128, max_seqlen_q=1024)


def verdict(provider: str, params: AttentionParams, platform: Platform, env: EnvFlags = NO_ENV):
    return TABLES[provider].evaluate(params, platform, env)


def codes(provider: str, params: AttentionParams, platform: Platform, env: EnvFlags = NO_ENV) -> set[str]:
    return {r.code for r in verdict(provider, params, platform, env).reasons}


def text(provider: str, params: AttentionParams, platform: Platform, env: EnvFlags = NO_ENV) -> str:
    return " ".join(f"{r.message} {r.fix or ''}" for r in verdict(provider, params, platform, env).reasons)


def test_every_flash_provider_is_declared_in_preference_order():
    assert [t for t in TABLES if t.startswith("flash_attn_2")] == ["flash_attn_2:package", "flash_attn_2:torch"]
    for provider in FA_IDS:
        table = TABLES[provider]
        assert all(c.source for c in table.checks), f"{provider} has a check without a source"
        assert len({c.code for c in table.checks}) == len(table.checks)


def test_every_provider_runs_the_plain_case_where_installed():
    for provider in FA_IDS:
        assert verdict(provider, BASE, H100_ALL).eligible, text(provider, BASE, H100_ALL)


def test_h100_explain_names_each_flash_family_and_why_it_is_out():
    decision = explain(BASE, H100, NO_ENV)
    by_id = {v.id: v for v in decision.verdicts}
    assert by_id["flash_attn_4:cute"].eligible and by_id["flash_attn_2:torch"].eligible
    assert "flash-attn-3 is not available" in by_id["flash_attn_3:interface"].reasons[0].message
    assert any("untested" in note for note in by_id["flash_attn_3:interface"].notes)
    assert "flash-attn is not available" in by_id["flash_attn_2:package"].reasons[0].message
    notes = " ".join(by_id["flash_attn_4:cute"].notes)
    assert "JIT" in notes and "2-3 s" in notes and "activate_flash_attention_impl" in notes


# --- package versions --------------------------------------------------------------------------------------
def test_flash_attn_newer_than_the_tested_window_says_what_was_found_and_how_to_allow_it():
    newer = Platform.parse("a100-cudnn9,flash-attn=2.9.0")
    v = verdict("flash_attn_2:package", BASE, newer)
    assert not v.eligible and v.has("flash_attn_2.package")
    message = text("flash_attn_2:package", BASE, newer)
    assert "2.9.0" in message and "2.8.3" in message and "ATTN_DISPATCH_ALLOW_UNTESTED_VERSIONS=1" in message
    allowed = EnvFlags.from_environ({"ATTN_DISPATCH_ALLOW_UNTESTED_VERSIONS": "1"})
    assert verdict("flash_attn_2:package", BASE, newer, allowed).eligible
    assert verdict("flash_attn_2:package", BASE, Platform.parse("a100-cudnn9,flash-attn=2.8.3")).eligible


def test_flash_attn_older_than_2_1_1_is_refused_with_the_minimum():
    old = Platform.parse("a100-cudnn9,flash-attn=2.0.9")
    assert "flash_attn_2.package" in codes("flash_attn_2:package", BASE, old)
    assert "2.1.1" in text("flash_attn_2:package", BASE, old)


@pytest.mark.parametrize("feature, params, below, at", [
    ("sliding_window_version", BASE.replace(attn_mask_type="causal_bottom_right", window_size=(128, 0)),
     "2.2.1", "2.3.0"),
    ("alibi_version", BASE.replace(bias_type="alibi"), "2.3.6", "2.4.0"),
    ("deterministic_version", BASE.replace(deterministic=True), "2.4.0", "2.4.1"),
])
def test_feature_arrives_with_its_flash_attn_release(feature, params, below, at):
    old = Platform.parse(f"sm80,flash-attn={below}")
    assert f"flash_attn_2.{feature}" in codes("flash_attn_2:package", params, old)
    assert below in text("flash_attn_2:package", params, old)
    assert verdict("flash_attn_2:package", params, Platform.parse(f"sm80,flash-attn={at}")).eligible


def test_determinism_demanded_through_the_environment():
    env = EnvFlags.from_environ({"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"})
    old = Platform.parse("sm80,flash-attn=2.4.0")
    assert "flash_attn_2.deterministic_version" in codes("flash_attn_2:package", BASE, old, env)
    assert verdict("flash_attn_2:package", BASE.replace(is_training=False), old, env).eligible  # no backward


def test_flash_attn_4_namespace_without_fa2_is_not_the_fa2_package():
    status = PackageStatus("flash-attn", "unknown")  # what the probe reports when only flash_attn.cute exists
    platform = dataclasses.replace(H100, packages=H100.packages + (status,))
    assert "flash_attn_2.distribution" in codes("flash_attn_2:package", BASE, platform)


def test_blackwell_needs_flash_attn_2_7_3():
    old = Platform.parse("b200-cudnn9,flash-attn=2.6.3")
    assert "flash_attn_2.blackwell_version" in codes("flash_attn_2:package", BASE, old)
    assert verdict("flash_attn_2:package", BASE, Platform.parse("b200-cudnn9,flash-attn=2.7.3")).eligible


def test_flash_attn_4_versions_count_betas():
    for version, allowed in (("4.0.0b20", False), ("4.0.0b36", True), ("4.0.0b37", False), ("4.0.0", False)):
        platform = Platform.parse(f"h100-cudnn9,flash-attn-4={version}")
        assert verdict("flash_attn_4:cute", BASE, platform).eligible == allowed, version
    newer = Platform.parse("h100-cudnn9,flash-attn-4=4.0.0b37")
    assert "4.0.0b36" in text("flash_attn_4:cute", BASE, newer)
    assert verdict("flash_attn_4:cute", BASE, newer,
                   EnvFlags.from_environ({"ATTN_DISPATCH_ALLOW_UNTESTED_VERSIONS": "1"})).eligible
    assert "4.0.0b36" in text("flash_attn_4:cute", BASE, Platform.parse("h100-cudnn9,flash-attn-4=4.0.0b20"))


def test_torch_provider_needs_torch_2_4_and_a_flash_build():
    assert "flash_attn_2.torch_version" in codes("flash_attn_2:torch", BASE, Platform.parse("a100-cudnn8"))
    assert "flash_attn_2.torch_build" in codes("flash_attn_2:torch", BASE, Platform.parse("h100-cudnn9,torch-flash=0"))


# --- devices -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, fa2, fa3, fa4", [
    ("sm80,flash-attn=2.8.3,flash-attn-3=3.0.0b1,flash-attn-4=4.0.0b36,torch=2.11.0", True, False, False),
    ("sm89,flash-attn=2.8.3,flash-attn-3=3.0.0b1,flash-attn-4=4.0.0b36,torch=2.11.0", True, False, False),
    ("sm90,flash-attn=2.8.3,flash-attn-3=3.0.0b1,flash-attn-4=4.0.0b36,torch=2.11.0", True, True, True),
    ("sm100,flash-attn=2.8.3,flash-attn-3=3.0.0b1,flash-attn-4=4.0.0b36,torch=2.11.0", True, False, True),
    ("sm120,flash-attn=2.8.3,flash-attn-3=3.0.0b1,flash-attn-4=4.0.0b36,torch=2.11.0", True, False, False),
    ("sm75,flash-attn=2.8.3,flash-attn-3=3.0.0b1,flash-attn-4=4.0.0b36,torch=2.11.0", False, False, False),
])
def test_compute_capability(spec, fa2, fa3, fa4):
    platform = Platform.parse(spec)
    assert verdict("flash_attn_2:package", BASE, platform).eligible == fa2
    assert verdict("flash_attn_2:torch", BASE, platform).eligible == fa2
    assert verdict("flash_attn_3:interface", BASE, platform).eligible == fa3
    assert verdict("flash_attn_4:cute", BASE, platform).eligible == fa4
    if not fa3:
        assert "flash_attn_3.compute_capability" in codes("flash_attn_3:interface", BASE, platform)


def test_the_cpu_is_refused_by_every_flash_provider():
    for provider in FA_IDS:
        assert f"{provider.split(':')[0]}.compute_capability" in codes(provider, BASE.replace(device_type="cpu"),
                                                                      Platform.parse("cpu"))


# --- masks and alignment -------------------------------------------------------------------------------------
@pytest.mark.parametrize("provider", FA_IDS)
def test_top_left_causal_needs_equal_lengths_bottom_right_does_not(provider):
    cross = BASE.replace(max_seqlen_q=512, max_seqlen_kv=1024)
    for mask in ("causal", "padding_causal"):
        v = verdict(provider, cross.replace(attn_mask_type=mask), H100_ALL)
        assert v.has(f"{provider.split(':')[0]}.causal_alignment")
        assert "512" in text(provider, cross.replace(attn_mask_type=mask), H100_ALL)
        assert "_bottom_right" in (v.reasons[0].fix or "")
    for mask in ("causal_bottom_right", "padding_causal_bottom_right", "no_mask", "padding"):
        assert verdict(provider, cross.replace(attn_mask_type=mask), H100_ALL).eligible, mask
    assert verdict(provider, BASE.replace(attn_mask_type="causal"), H100_ALL).eligible
    # a window is aligned bottom-right unless the mask type says top-left
    assert verdict(provider, cross.replace(window_size=(64, 64)), H100_ALL).eligible
    assert not verdict(provider, cross.replace(attn_mask_type="causal", window_size=(64, 0)), H100_ALL).eligible


@pytest.mark.parametrize("provider", FA_IDS)
def test_no_arbitrary_mask_no_bias_tensor_no_padding_between_sequences(provider):
    family = provider.split(":")[0]
    assert f"{family}.mask_type" in codes(provider, BASE.replace(attn_mask_type="arbitrary"), H100_ALL)
    biased = BASE.replace(bias_type="post_scale_bias", bias_shape="1hss")
    assert f"{family}.bias_type" in codes(provider, biased, H100_ALL)
    packed = BASE.replace(qkv_format="thd", attn_mask_type="padding", pad_between_seqs=True)
    assert f"{family}.pad_between_seqs" in codes(provider, packed, H100_ALL)
    for fmt in ("bshd", "sbhd", "thd"):
        mask = "padding_causal" if fmt == "thd" else "causal"
        assert verdict(provider, BASE.replace(qkv_format=fmt, attn_mask_type=mask), H100_ALL).eligible


@pytest.mark.parametrize("provider", FA_IDS)
def test_environment_and_out_of_scope_features(provider):
    family = provider.split(":")[0]
    off = EnvFlags.from_environ({"NVTE_FLASH_ATTN": "0"})
    assert f"{family}.env_disabled" in codes(provider, BASE, H100_ALL, off)
    assert f"{family}.return_max_logit" in codes(provider, BASE.replace(return_max_logit=True), H100_ALL)
    kv = BASE.replace(inference_kv_cache=True, is_training=False)
    paged = kv.replace(kv_cache_paged=True, kv_page_size=64)
    if provider == "flash_attn_2:torch":  # reads a contiguous cache in place; pages of 256 only
        assert f"{family}.kv_cache" not in codes(provider, kv, H100_ALL)
        assert f"{family}.kv_cache" in codes(provider, paged, H100_ALL)
    elif provider == "flash_attn_4:cute":  # reads both in place; odd head dims only with pages of one key tile
        assert f"{family}.kv_cache" not in codes(provider, kv, H100_ALL)
        assert f"{family}.kv_cache" not in codes(provider, paged, H100_ALL)
        odd = paged.replace(head_dim_qk=72, head_dim_v=72)
        assert f"{family}.kv_cache_page_loader" in codes(provider, odd, H100_ALL)
        tile = 144  # sm90 forward tile for head dim 72 without a causal mask: 192 x 144
        assert f"{family}.kv_cache_page_loader" not in codes(provider, odd.replace(kv_page_size=tile), H100_ALL)
    else:
        assert f"{family}.kv_cache" in codes(provider, kv, H100_ALL)
    assert f"{family}.fp8" in codes(provider, BASE.replace(fp8=True), H100_ALL)
    for comm in ("p2p", "all_gather", "a2a", "a2a+p2p"):
        assert verdict(provider, BASE.replace(cp_size=2, cp_comm_type=comm), H100_ALL).eligible
    gqa = BASE.replace(num_heads=16, num_gqa_groups=2)
    assert verdict(provider, gqa, H100_ALL).eligible
    assert verdict(provider, gqa.replace(num_gqa_groups=1), H100_ALL).eligible


# --- dropout, bias, sinks, head dims --------------------------------------------------------------------------
def test_dropout_only_in_flash_attn_2():
    dropped = BASE.replace(dropout=0.1)
    assert verdict("flash_attn_2:package", dropped, H100_ALL).eligible
    assert verdict("flash_attn_2:torch", dropped, H100_ALL).eligible
    assert "flash_attn_3.dropout" in codes("flash_attn_3:interface", dropped, H100_ALL)
    assert "flash_attn_4.dropout" in codes("flash_attn_4:cute", dropped, H100_ALL)
    assert verdict("flash_attn_4:cute", dropped.replace(is_training=False), H100_ALL).eligible  # eval: no dropout


def test_alibi_only_in_the_flash_attn_2_package():
    alibi = BASE.replace(bias_type="alibi", alibi_slopes_shape="bh")
    assert verdict("flash_attn_2:package", alibi, H100_ALL).eligible
    # torch compiles its FA2 without ALiBi (observed on torch 2.11): refused for training and inference alike
    for training in (True, False):
        call = alibi.replace(is_training=training)
        assert codes("flash_attn_2:torch", call, H100_ALL) == {"flash_attn_2.bias_type"}
        assert "does not support alibi" in text("flash_attn_2:torch", call, H100_ALL)
        assert "flash_attn_2:package" in text("flash_attn_2:torch", call, H100_ALL)
    assert "no bias tensor" in text("flash_attn_2:torch", BASE.replace(bias_type="post_scale_bias",
                                                                       bias_shape="1hss"), H100_ALL)
    assert "flash_attn_3.bias_type" in codes("flash_attn_3:interface", alibi, H100_ALL)
    assert "flash_attn_4.bias_type" in codes("flash_attn_4:cute", alibi, H100_ALL)


def test_softmax_sinks_only_in_flash_attn_4():
    for softmax in ("off-by-one", "learnable"):
        sink = BASE.replace(softmax_type=softmax)
        assert verdict("flash_attn_4:cute", sink, H100_ALL).eligible
        assert verdict("flash_attn_4:cute", sink.replace(qkv_format="thd", attn_mask_type="padding"), H100_ALL).eligible
        for provider in ("flash_attn_2:package", "flash_attn_2:torch", "flash_attn_3:interface"):
            assert f"{provider.split(':')[0]}.softmax_type" in codes(provider, sink, H100_ALL)
    hd256 = BASE.replace(softmax_type="learnable", head_dim_qk=256, head_dim_v=256)
    assert "flash_attn_4.sink_backward" in codes("flash_attn_4:cute", hd256, B200)
    assert verdict("flash_attn_4:cute", hd256.replace(is_training=False), B200).eligible
    assert verdict("flash_attn_4:cute", hd256, H100).eligible


@pytest.mark.parametrize("dims, fa2, fa3, fa4_sm90, fa4_sm100", [
    ((64, 64), True, True, True, True),
    ((256, 256), True, True, True, True),
    ((264, 264), False, False, False, False),
    ((100, 100), False, False, False, False),        # not a multiple of 8
    ((192, 128), False, True, True, True),            # DeepSeek shape
    ((128, 64), False, False, True, True),
    ((256, 128), False, False, True, False),
    ((64, 512), False, True, False, False),           # FA3: forward only (checked below)
])
def test_head_dims(dims, fa2, fa3, fa4_sm90, fa4_sm100):
    params = BASE.replace(head_dim_qk=dims[0], head_dim_v=dims[1], is_training=dims != (64, 512))
    assert verdict("flash_attn_2:package", params, H100_ALL).eligible == fa2
    assert verdict("flash_attn_2:torch", params, H100_ALL).eligible == fa2
    assert verdict("flash_attn_3:interface", params, H100_ALL).eligible == fa3
    assert verdict("flash_attn_4:cute", params, H100).eligible == fa4_sm90
    assert verdict("flash_attn_4:cute", params, B200).eligible == fa4_sm100
    if not fa2:
        assert str(dims[0]) in text("flash_attn_2:torch", params, H100_ALL)


# (head_dim_qk, head_dim_v, mask, training) -> fits on sm90. Backward tiles are chosen by head_dim_qk alone; the
# shared memory they need (flash_attn_4_sm90.bwd_smem_bytes) must stay within 232448 bytes.
@pytest.mark.parametrize("d, dv, mask, training, fits", [
    (64, 128, "no_mask", True, False),      # 248832 bytes: the launch failure seen on the H100
    (64, 128, "causal", True, False),       # d <= 64 has one tile, causal or not
    (64, 128, "no_mask", False, True),      # its forward fits
    (64, 96, "no_mask", True, False),       # fits, but dO (96 wide) cannot take head_dim_qk's 64-column swizzle
    (96, 64, "no_mask", True, True),        # 32-column swizzle for 96: 64 divides
    (128, 64, "no_mask", True, True),       # ran on the H100
    (192, 128, "causal", True, True),       # ran on the H100
    (128, 128, "no_mask", True, True),      # 232448 bytes: an exact fit, trains on the H100
    (256, 128, "no_mask", True, True),
    (128, 256, "no_mask", True, False),
    (128, 256, "causal", True, False),
    (128, 256, "no_mask", False, True),
    (128, 192, "no_mask", True, False),     # the 80-row non-causal tile does not fit ...
    (128, 192, "causal", True, True),       # ... the 64-row causal tile does
    (128, 80, "no_mask", True, False),      # dO swizzle: 80 columns under head_dim_qk's 64-column atom
    (256, 192, "no_mask", True, False),     # swapped dK/dV: 192 on an M axis tiled by 128
    (160, 256, "no_mask", True, False),     # 242688 bytes
    (64, 256, "no_mask", False, False),     # forward: the 192x256 output tile overruns sQ's storage
])
def test_flash_attn_4_sm90_shared_memory(d, dv, mask, training, fits):
    params = BASE.replace(head_dim_qk=d, head_dim_v=dv, attn_mask_type=mask, is_training=training)
    found = codes("flash_attn_4:cute", params, H100)
    assert (not found) == fits, text("flash_attn_4:cute", params, H100)
    if not fits:
        assert found <= {"flash_attn_4.sm90_backward", "flash_attn_4.sm90_forward_smem"}
        assert any(w in text("flash_attn_4:cute", params, H100) for w in ("232448", "sQ", "swizzle", "M axis"))
    assert verdict("flash_attn_4:cute", params, B200).eligible == ((d <= 128 and dv <= 128) or (d, dv) == (192, 128))


def test_flash_attn_4_sm90_equal_head_dims_always_fit():
    from attn_dispatch.constraints import flash_attn_4_sm90 as sm90

    assert sm90.bwd_smem_bytes(64, 128, False) == 248832  # the byte count the failed launch reported
    for d in range(8, 257, 8):
        for window in ((-1, -1), (-1, 0), (16, 16)):
            assert sm90.forward_problem(d, d, window) is None
            assert sm90.bwd_smem_bytes(d, d, window != (-1, -1)) <= sm90.SM90_MAX_SMEM
            assert (sm90.backward_problem(d, d, window, 4) is None) == (not sm90.dq_accumulator_mismatch(d))


@pytest.mark.parametrize("d, wrong", [(8, True), (16, True), (32, False), (40, True), (64, False), (72, True),
                                      (80, True), (96, False), (104, True), (128, False), (136, False),
                                      (160, False), (200, False)])
def test_flash_attn_4_sm90_backward_with_dq_padding_mismatch_is_refused(d, wrong):
    params = BASE.replace(head_dim_qk=d, head_dim_v=d)
    assert ("flash_attn_4.sm90_backward" in codes("flash_attn_4:cute", params, H100)) == wrong
    assert verdict("flash_attn_4:cute", params.replace(is_training=False), H100).eligible
    if wrong:
        assert "silently wrong" in text("flash_attn_4:cute", params, H100)
        assert "PR #2896" in text("flash_attn_4:cute", params, H100)
    assert "flash_attn_4.sm90_backward" not in codes("flash_attn_4:cute", params, B200)


def test_flash_attn_4_sm90_gqa_backward_needs_equal_head_dims():
    gqa = BASE.replace(head_dim_qk=128, head_dim_v=64, num_heads=16, num_gqa_groups=4)
    assert codes("flash_attn_4:cute", gqa, H100) == {"flash_attn_4.sm90_backward"}
    assert "GQA backward requires head_dim == head_dim_v" in text("flash_attn_4:cute", gqa, H100)
    assert verdict("flash_attn_4:cute", gqa.replace(is_training=False), H100).eligible
    assert verdict("flash_attn_4:cute", gqa.replace(num_gqa_groups=16), H100).eligible


def test_fa3_wide_value_head_has_no_backward():
    wide = BASE.replace(head_dim_qk=64, head_dim_v=512)
    assert "flash_attn_3.head_dim" in codes("flash_attn_3:interface", wide, H100_ALL)
    assert "no backward" in text("flash_attn_3:interface", wide, H100_ALL)


def test_consumer_gpu_head_dim_above_192_backward():
    hd = BASE.replace(head_dim_qk=256, head_dim_v=256)
    # torch (sdp_utils): head_dim > 224 trains without dropout; (192, 224] never
    assert verdict("flash_attn_2:torch", hd, RTX4090).eligible
    assert "flash_attn_2.head_dim_backward" in codes("flash_attn_2:torch", hd.replace(dropout=0.1), RTX4090)
    hd208 = hd.replace(head_dim_qk=208, head_dim_v=208)
    assert "flash_attn_2.head_dim_backward" in codes("flash_attn_2:torch", hd208, RTX4090)
    assert verdict("flash_attn_2:torch", hd208.replace(is_training=False), RTX4090).eligible
    # the package: >= 2.5.5 and no dropout
    assert verdict("flash_attn_2:package", hd, RTX4090).eligible
    assert "flash_attn_2.head_dim_backward" in codes("flash_attn_2:package", hd.replace(dropout=0.1), RTX4090)
    older = Platform.parse("rtx4090-cudnn9,flash-attn=2.5.0")
    assert "2.5.5" in text("flash_attn_2:package", hd, older)
    # A100/H100 have the shared memory for it
    assert verdict("flash_attn_2:package", hd.replace(dropout=0.1), A100).eligible
    assert verdict("flash_attn_2:torch", hd.replace(dropout=0.1), A100).eligible


def test_fp8_is_refused_with_a_reason_not_implemented_here():
    fp8 = BASE.replace(dtype="fp8", fp8=True, is_training=False)
    assert "does not implement FP8" in text("flash_attn_3:interface", fp8, H100_ALL)
    assert "does not implement FP8" in text("flash_attn_4:cute", fp8, H100_ALL)


def test_dtypes():
    for provider in FA_IDS:
        family = provider.split(":")[0]
        assert f"{family}.dtype" in codes(provider, BASE.replace(dtype="float32"), H100_ALL)
        assert verdict(provider, BASE.replace(dtype="float16"), H100_ALL).eligible


def test_determinism_notes_and_support():
    deterministic = BASE.replace(deterministic=True)
    for provider in FA_IDS:
        assert verdict(provider, deterministic, H100_ALL).eligible, text(provider, deterministic, H100_ALL)
    assert any("use_deterministic_algorithms" in n for n in verdict("flash_attn_2:torch", deterministic, H100).notes)
    assert any("semaphores" in n for n in verdict("flash_attn_4:cute", deterministic, H100).notes)
