"""KV-cache inference (InferenceParams): a generation loop equals full attention recomputed over each prefix.

Sequences of different lengths join (prompts), decode, take chunked-prefill steps, change batch order and leave;
two layers keep separate caches. Reference: float64 attention of each new query over the sequence's whole
history, bottom-right causal, window applied. Inputs' padding positions hold random values (never zeros), so a
kernel that read them would show.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import pytest
import torch

import attn_dispatch as ad
from attn_dispatch import selection
from attn_dispatch.benchmarking.kv_loop import run_generation
from attn_dispatch.params import AttentionParams
from attn_dispatch.platform import PROFILES

H, HKV, D = 4, 2, 16


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("window_left", [-1, 5], ids=["full", "window5"])
def test_generation_matches_full_attention(fmt, paged, window_left):
    result = run_generation(fmt, paged, window_left, heads=H, kv_heads=HKV, head_dim=D)
    assert result["worst_abs_err"] < 1e-10, result
    assert result["padding_zero"], "padding rows of the output must be zero"
    decision = result["decision"]
    assert decision.chosen == "unfused:pytorch"
    assert decision.params["inference_kv_cache"] and decision.params["kv_cache_paged"] == paged


def test_generation_float32_paged_page_of_one_token_mha():
    result = run_generation("bshd", True, -1, dtype=torch.float32, layers=1, page_size=1, heads=3, kv_heads=3,
                            head_dim=8)
    assert result["worst_abs_err"] < 2e-5, result


# --- bad input: clear errors, nothing written ----------------------------------------------------------------
def _started(paged: bool = False, **kw):
    ip = ad.InferenceParams(2, 16, HKV, D, torch.float32, is_paged=paged, page_size=4 if paged else None,
                            device="cpu", **kw)
    module = ad.DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="bshd", attn_mask_type="padding_causal",
                                    layer_number=3).eval()
    ip.pre_step(OrderedDict(x=6, y=2))
    with torch.no_grad():
        module(torch.randn(2, 6, H, D), torch.randn(2, 6, HKV, D), torch.randn(2, 6, HKV, D), inference_params=ip)
    return ip, module


def _snapshot(ip):
    caches = {layer: tuple(t.clone() for t in kv) for layer, kv in ip._caches.items()}
    table = None if ip.page_table is None else ip.page_table.clone()
    return dict(ip.sequences), caches, table, list(ip._free_pages)


def _assert_unchanged(ip, snap):
    sequences, caches, table, free = snap
    assert dict(ip.sequences) == sequences
    assert list(ip._free_pages) == free
    for layer, kv in caches.items():
        for old, new in zip(kv, ip._caches[layer]):
            assert torch.equal(old, new)
    if table is not None:
        assert torch.equal(table, ip.page_table)


@pytest.mark.parametrize("step, match", [
    (OrderedDict(x=11), "sequence 'x': the cache is full: it holds 6 tokens, the step adds 11, "
                        "max_sequence_length=16"),
    (OrderedDict(z=17), "sequence 'z': a step of 17 tokens is longer than the cache"),
    (OrderedDict(x=1, y=1, z=1), "3 sequences, more than max_batch_size=2"),
    (OrderedDict(x=0), "new tokens 0 must be a positive integer"),
    ({}, "step_dict is empty"),
])
def test_rejected_steps_leave_the_cache_alone(step, match):
    ip, module = _started()
    snap = _snapshot(ip)
    with pytest.raises(ad.KVCacheError, match=match):
        ip.pre_step(step)
    _assert_unchanged(ip, snap)


def test_unknown_sequence_with_joining():
    ip, _ = _started()
    with pytest.raises(ad.KVCacheError, match=r"sequence 'q' is unknown: the cache holds \['x', 'y'\]"):
        ip.pre_step(OrderedDict(x=1, q=1), joining=["w"])
    ip.pre_step(OrderedDict(x=1, w=3), joining=["w"])  # listed: joins
    assert dict(ip.sequences) == {"x": 7, "w": 3}


def test_page_pool_exhausted_names_the_sequence():
    ip, module = _started(paged=True, total_num_pages=4)  # x holds 2 pages, y 1: one left
    snap = _snapshot(ip)
    with pytest.raises(ad.KVCacheError, match=r"sequence 'y': the page pool is exhausted: it needs 2 more pages "
                                              r"of 4 tokens, 1 of total_num_pages=4 are left"):
        ip.pre_step(OrderedDict(x=1, y=7))
    _assert_unchanged(ip, snap)
    ip.pre_step(OrderedDict(y=7))  # x leaves: its 2 pages come back, y fits
    assert dict(ip.sequences) == {"y": 9}


def test_second_append_of_a_layer_in_one_step_is_refused():
    ip, module = _started()
    snap = _snapshot(ip)
    with pytest.raises(ad.KVCacheError, match="layer_number=3 has already appended this step's k/v"):
        with torch.no_grad():
            module(torch.randn(2, 6, H, D), torch.randn(2, 6, HKV, D), torch.randn(2, 6, HKV, D),
                   inference_params=ip)
    _assert_unchanged(ip, snap)


@pytest.mark.parametrize("change, match", [
    (dict(q=torch.randn(3, 1, H, D)), "query_layer has batch 3 but pre_step announced 2 sequences"),
    (dict(k=torch.randn(2, 1, HKV, D, dtype=torch.float64)), "key_layer is torch.float64, the cache is torch.float32"),
    (dict(extra=dict(core_attention_bias_type="post_scale_bias")), "core_attention_bias_type='post_scale_bias' is "
                                                                   "not supported with inference_params"),
    (dict(extra=dict(cu_seqlens_q=torch.tensor([0, 2, 3], dtype=torch.int32))), "cu_seqlens_q=.* disagrees"),
])
def test_rejected_calls_write_nothing(change, match):
    ip, module = _started()
    ip.pre_step(OrderedDict(x=1, y=1))
    snap = _snapshot(ip)
    q, k, v = change.get("q", torch.randn(2, 1, H, D)), change.get("k", torch.randn(2, 1, HKV, D)), \
        torch.randn(2, 1, HKV, D)
    with pytest.raises((ad.KVCacheError, ValueError), match=match):
        with torch.no_grad():
            module(q, k, v, inference_params=ip, **change.get("extra", {}))
    _assert_unchanged(ip, snap)
    with torch.no_grad():  # the step still runs afterwards
        module(torch.randn(2, 1, H, D), torch.randn(2, 1, HKV, D), torch.randn(2, 1, HKV, D), inference_params=ip,
               cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32))


def test_gradients_through_the_cache_are_refused():
    ip, module = _started()
    ip.pre_step(OrderedDict(x=1))
    q = torch.randn(1, 1, H, D, requires_grad=True)
    with pytest.raises(ad.KVCacheError, match="inference only"):
        module(q, torch.randn(1, 1, HKV, D), torch.randn(1, 1, HKV, D), inference_params=ip)


def test_forward_before_pre_step():
    ip = ad.InferenceParams(2, 16, HKV, D, torch.float32, device="cpu")
    module = ad.DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="bshd").eval()
    with pytest.raises(ad.KVCacheError, match="call inference_params.pre_step"):
        with torch.no_grad():
            module(torch.randn(1, 1, H, D), torch.randn(1, 1, HKV, D), torch.randn(1, 1, HKV, D),
                   inference_params=ip)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads_kv=None), "num_heads_kv is required"),
    (dict(is_paged=True), "needs page_size"),
    (dict(is_paged=True, page_size=5), "max_sequence_length=16 must be a multiple of page_size=5"),
    (dict(page_size=4), "page_size=4 given with is_paged=False"),
    (dict(dtype=torch.int8), "dtype=torch.int8 is not supported"),
    (dict(qkv_format="bhsd"), "qkv_format='bhsd' is not supported"),
])
def test_constructor_errors(kwargs, match):
    args = dict(max_batch_size=2, max_sequence_length=16, num_heads_kv=HKV, head_dim_k=D, dtype=torch.float32,
                device="cpu")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ad.InferenceParams(**args)


# --- the tables: what each engine can do for inference -----------------------------------------------------
H100 = dataclasses.replace(PROFILES["h100-cudnn9"], torch_version="2.13.0")


def _decode(paged: bool, page_size: int | None = None, **kw) -> AttentionParams:
    args = dict(dtype="bfloat16", qkv_format="thd", batch_size=32, num_heads=32, num_gqa_groups=8, head_dim_qk=128,
                max_seqlen_q=1, max_seqlen_kv=8192, attn_mask_type="padding_causal_bottom_right", is_training=False,
                inference_kv_cache=True, kv_cache_paged=paged, kv_page_size=page_size)
    return AttentionParams(**{**args, **kw})


def _reasons(decision, provider_id):
    return [r.code for r in decision.verdict(*provider_id.split(":")).reasons]


def test_explain_kv_cache_on_hopper():
    contiguous = selection.explain(_decode(False), platform=H100)
    assert contiguous.verdict("flash_attn_2", "torch").eligible
    assert contiguous.verdict("cudnn_fused", "frontend").eligible
    assert "cudnn_fused.kv_cache" in _reasons(contiguous, "cudnn_fused:torch")
    assert contiguous.verdict("flash_attn_4", "cute").eligible
    paged16 = selection.explain(_decode(True, 16), platform=H100)
    fa2 = paged16.verdict("flash_attn_2", "torch")
    assert not fa2.eligible and "page_size=16 is not a multiple of 256" in str(fa2.reasons[0])
    assert paged16.verdict("cudnn_fused", "frontend").eligible  # cuDNN's page tables: any page size
    assert ("paged KV cache is not supported by cudnn_fused:torch"
            in str(paged16.verdict("cudnn_fused", "torch").reasons))
    assert paged16.verdict("flash_attn_4", "cute").eligible  # any page size with head dims that are multiples of 16
    odd = selection.explain(_decode(True, 16, head_dim_v=72, head_dim_qk=72), platform=H100)
    assert "irregular head dim" in str(odd.verdict("flash_attn_4", "cute").reasons)
    assert odd.chosen == "cudnn_fused:frontend"  # not predicted by the decode model, but the only fused engine
    paged256 = selection.explain(_decode(True, 256), platform=H100)
    assert paged256.verdict("flash_attn_2", "torch").eligible
    old_torch = selection.explain(_decode(True, 256), platform=dataclasses.replace(H100, torch_version="2.11.0"))
    assert "flash_attn_2.kv_cache_pages" in _reasons(old_torch, "flash_attn_2:torch")


def test_module_explain_with_inference_params():
    ip, module = _started()
    ip.pre_step(OrderedDict(x=1, y=1))
    decision = module.explain(torch.randn(2, 1, H, D), torch.randn(2, 1, HKV, D), torch.randn(2, 1, HKV, D),
                              inference_params=ip)
    assert decision.params["inference_kv_cache"]
    assert decision.params["attn_mask_type"] == "padding_causal_bottom_right"
    assert decision.params["max_seqlen_q"] == 1


# --- decode: which engine splits the keys, and what the auto policy predicts ---------------------------------
def _notes(decision, provider_id):
    return " ".join(decision.verdict(*provider_id.split(":")).notes)


def test_small_batch_decode_picks_the_engine_that_splits_the_keys():
    long = selection.explain(_decode(False, batch_size=1, max_seqlen_kv=32768), platform=H100)
    assert long.chosen == "flash_attn_2:torch"
    assert "decode model" in long.policy_reason and "8 blocks split" in long.policy_reason
    fa2, fa4 = long.estimates["flash_attn_2:torch"], long.estimates["flash_attn_4:cute"]
    assert fa4 > 5 * fa2, long.estimates  # 8 of 132 SMs stream the cache without split-KV
    assert "does not split the keys" in _notes(long, "flash_attn_4:cute")
    assert "split-KV" in _notes(long, "flash_attn_2:torch")
    assert "cudnn_fused:frontend" in long.policy_reason.split("not predicted")[1]


def test_a_full_batch_fills_the_gpu_without_split_kv():
    full = selection.explain(_decode(False), platform=H100)  # 32 x 8 kv heads = 256 blocks on 132 SMs
    assert full.estimates["flash_attn_4:cute"] == pytest.approx(full.estimates["flash_attn_2:torch"], rel=0.05)


@pytest.mark.parametrize("change, why", [
    (dict(window_size=(1024, 0)), "a sliding window"),
    (dict(num_gqa_groups=32), "no GQA"),
])
def test_torch_fa2_splits_only_the_grouped_unwindowed_single_query_step(change, why):
    decision = selection.explain(_decode(False, batch_size=1, max_seqlen_kv=32768, **change), platform=H100)
    note = _notes(decision, "flash_attn_2:torch")
    assert why in note and "does not split the keys" in note


def test_flash_attn_4_splits_on_blackwell_and_chunked_prefill_keeps_the_profile_path():
    b200 = dataclasses.replace(H100, compute_capability=(10, 0), device_name="NVIDIA B200")
    decision = selection.explain(_decode(False, batch_size=1, max_seqlen_kv=32768), platform=b200)
    assert "splits the keys" in _notes(decision, "flash_attn_4:cute")
    chunk = selection.explain(_decode(False, max_seqlen_q=128), platform=H100)
    assert "decode model" not in chunk.policy_reason
