"""Engines reading a KV cache in place, on the CPU: what each hands its kernel for a contiguous and a paged cache.

The kernels only run on a GPU (tests/gpu/test_kv_cache_gpu.py); here a stand-in with the kernel's documented
contract computes in float64 from exactly the tensors the engine passed (a contiguous cache's rows with
seqused_k live tokens, or the page pool through the page table), and the result is compared with full attention
recomputed over each sequence's history (benchmarking/kv_loop.reference). A stand-in that read a row past
seqused_k, or a page the table does not list, would see the random values the cache holds there.
"""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

import attn_dispatch as ad
from attn_dispatch.backends.base import AttnConfig
from attn_dispatch.benchmarking.kv_loop import reference
from test_cudnn_engine_cpu import engine as cudnn_engine  # noqa: F401 - the stand-in cudnn fixture

H, HKV, D = 8, 2, 32


def _filled_cache(paged: bool, page_size: int = 8, lens=(13, 5, 21), step=(1, 3, 1), d: int = D, seed: int = 0,
                  dtype=torch.float64):
    """An InferenceParams holding random history for len(lens) sequences, a step of `step` new tokens appended
    (layer 1), its view, the step's queries and the per-sequence (keys, values) histories. The unused cache
    rows/pages hold random values too."""
    torch.manual_seed(seed)
    ip = ad.InferenceParams(4, 32, HKV, d, dtype, is_paged=paged, page_size=page_size if paged else None,
                            total_num_pages=16 if paged else None, qkv_format="thd", device="cpu")
    ip.allocate_memory(1)
    for cache in ip._caches[1]:
        cache.normal_()
    prompt = OrderedDict((f"s{i}", n - s) for i, (n, s) in enumerate(zip(lens, step)))
    ip.pre_step(prompt)
    history = [(torch.randn(n, HKV, d, dtype=dtype), torch.randn(n, HKV, d, dtype=dtype)) for n in prompt.values()]
    ip.append(1, torch.cat([k for k, _ in history]), torch.cat([v for _, v in history]))
    ip.pre_step(OrderedDict((s, n) for s, n in zip(prompt, step)))
    new = [(torch.randn(n, HKV, d, dtype=dtype), torch.randn(n, HKV, d, dtype=dtype)) for n in step]
    view = ip.append(1, torch.cat([k for k, _ in new]), torch.cat([v for _, v in new]))
    history = [(torch.cat([hk, nk]), torch.cat([hv, nv])) for (hk, hv), (nk, nv) in zip(history, new)]
    q = torch.randn(sum(step), H, d, dtype=dtype)
    return ip, view, q, history


def _expected(q, history, step, window_left=-1):
    out, start = [], 0
    for (keys, values), n in zip(history, step):
        out.append(reference(q[start:start + n], keys, values, window_left))
        start += n
    return torch.cat(out)


def _cfg(window=(-1, 0)) -> AttnConfig:
    return AttnConfig(qkv_format="thd", attn_mask_type="padding_causal_bottom_right", window_size=window,
                      softmax_scale=D ** -0.5)


# --- flash-attn-4 -------------------------------------------------------------------------------------------
class _Fa4KernelStandIn:
    """flash_attn.cute.interface with _flash_attn_fwd's cache contract (4.0.0b36): k/v [b, s_k, h_k, d] with
    seqused_k, or a (num_pages, page_size, h_k, d) pool with page_table [b, pages] and seqused_k; no cu_seqlens_k
    with a page table; sm90 asserts num_splits == 1 ('SplitKV not supported on SM 9.0')."""

    def __init__(self, arch: int):
        self.arch, self.calls = arch, []

    def _get_device_arch(self):
        return self.arch

    def _flash_attn_fwd(self, q, k, v, *, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale,
                        causal, window_size_left, window_size_right, num_splits, page_table=None, **rest):
        assert not rest and not causal and "cu_seqlens_k" not in rest
        assert seqused_k.dtype == torch.int32 and seqused_k.shape == (cu_seqlens_q.numel() - 1,)
        if self.arch // 10 == 9:
            assert num_splits == 1, "SplitKV not supported on SM 9.0"
        self.calls.append(dict(k=k, v=v, page_table=page_table, num_splits=num_splits, max_seqlen_k=max_seqlen_k))
        out, cu = [], cu_seqlens_q.tolist()
        for i, used in enumerate(seqused_k.tolist()):
            if page_table is None:
                keys, values = k[i, :used], v[i, :used]
            else:
                page = k.shape[1]
                pages = page_table[i, :-(-used // page)].long()
                keys, values = k[pages].flatten(0, 1)[:used], v[pages].flatten(0, 1)[:used]
            left = -1 if window_size_left is None else window_size_left
            assert window_size_right in (None, 0)
            out.append(reference(q[cu[i]:cu[i + 1]], keys, values, left) * 1.0)
        return torch.cat(out), None, None, None, None


def _fa4(arch: int):
    from attn_dispatch.backends.flash_attn_4 import FlashAttn4Engine

    engine = FlashAttn4Engine.__new__(FlashAttn4Engine)  # no flash_attn.cute on the CPU machine
    engine._iface, engine.jit_events = _Fa4KernelStandIn(arch), []
    return engine


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("arch, splits", [(90, 1), (100, 0)])
@pytest.mark.parametrize("window", [(-1, 0), (6, 0)])
def test_flash_attn_4_reads_the_cache_in_place(paged, arch, splits, window):
    step = (1, 3, 1)
    ip, view, q, history = _filled_cache(paged, step=step)
    engine = _fa4(arch)
    out = engine.forward_kv_cache(q, view, ip.current_step.cu_q, max(step), _cfg(window))
    torch.testing.assert_close(out, _expected(q, history, step, window[0]), rtol=1e-12, atol=1e-12)
    call = engine._iface.calls[-1]
    k_cache = ip._caches[1][0]
    assert call["k"].data_ptr() == k_cache.data_ptr(), "the cache must be read where it lies, not copied"
    assert call["num_splits"] == splits and call["max_seqlen_k"] == max(n for n in ip.sequences.values())
    if paged:
        assert call["page_table"] is ip.page_table[:3] or torch.equal(call["page_table"], ip.page_table[:3])
        assert call["k"].shape == k_cache.shape
    else:
        assert call["page_table"] is None and call["k"].shape == (3,) + tuple(k_cache.shape[1:])


def test_flash_attn_4_refuses_pages_its_row_loader_cannot_take_before_the_kernel():
    ip, view, q, _ = _filled_cache(True, page_size=8, d=40)
    engine = _fa4(90)
    cfg = AttnConfig(qkv_format="thd", attn_mask_type="padding_causal_bottom_right", window_size=(-1, 0),
                     softmax_scale=40 ** -0.5)
    with pytest.raises(ValueError, match="irregular head dim"):
        engine.forward_kv_cache(q, view, ip.current_step.cu_q, 3, cfg)
    assert not engine._iface.calls


# --- cuDNN (cudnn-frontend graphs) -------------------------------------------------------------------------
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("window", [(-1, 0), (6, 0)])
def test_cudnn_frontend_attends_the_cache_in_place(cudnn_engine, paged, window):  # noqa: F811
    step = (1, 3, 1)
    ip, view, q, history = _filled_cache(paged, step=step, dtype=torch.float32)
    out = cudnn_engine.forward_kv_cache(q, view, ip.current_step.cu_q, max(step), _cfg(window))
    torch.testing.assert_close(out.double(), _expected(q, history, step, window[0]), rtol=1e-5, atol=1e-5)
    (key,) = [k for k in cudnn_engine._graphs]
    strides = dict(key.strides)
    k_cache = ip._caches[1][0]
    if paged:  # the pool itself, described as cuDNN's container [pages, h_kv, page, d]
        assert key.paged == (k_cache.shape[0], 8, 4, ip.page_table.stride(0)) and key.skv == 32
        assert strides["k"] == (k_cache.stride(0), k_cache.stride(2), k_cache.stride(1), 1)
    else:  # the cache rows, up to the next power of two of the longest sequence
        assert not key.paged and key.skv == 32 and strides["k"][0] == k_cache.stride(0)


def test_a_cudnn_decode_loop_reuses_its_graphs(cudnn_engine):  # noqa: F811
    ip, view, q, history = _filled_cache(False, lens=(9, 5, 10), step=(1, 1, 1), dtype=torch.float32)
    for _ in range(6):  # the longest sequence grows from 10 to 16 tokens: one graph for the whole range
        ip.pre_step(OrderedDict((s, 1) for s in ip.sequences))
        new = torch.randn(3, HKV, D)
        view = ip.append(1, new, torch.randn(3, HKV, D))
        cudnn_engine.forward_kv_cache(torch.randn(3, H, D), view, ip.current_step.cu_q, 1, _cfg())
    assert cudnn_engine.stats["builds"] == 1 and max(ip.sequences.values()) == 16
