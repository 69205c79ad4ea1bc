"""flash-attn-4's forward replay (backends/_fa4_replay.py) against a stand-in interface built as flash_attn.cute's
is: a Python preamble that allocates out and lse, a compile cache per kernel-launching function, and one compiled
call. Values and gradients against the unfused engine in float64; the stand-in counts preambles and launches."""
from __future__ import annotations

import logging
from typing import NamedTuple

import pytest
import torch

from attn_dispatch.backends import _fa4_replay
from attn_dispatch.backends.flash_attn_4 import FlashAttn4Engine
from attn_dispatch.backends.unfused import UnfusedEngine
from test_flash_plumbing import make_case


@pytest.fixture(autouse=True)
def _replay_on(monkeypatch):
    monkeypatch.setenv(_fa4_replay.ENV_SWITCH, "1")  # off by default until it has run on a GPU


class _AuxData(NamedTuple):  # the interface passes its score_mod data as a NamedTuple of Nones
    tensors: tuple | None = None
    scalars: tuple | None = None


class _JitCache:
    def __init__(self):
        self.cache = {}

    def __contains__(self, key):
        return key in self.cache

    def __getitem__(self, key):
        return self.cache[key]

    def __setitem__(self, key, fn):
        self.cache[key] = fn


def _attend(q, k, v, scale, left, right):
    """Dense attention on bshd float64 tensors with a bottom-right aligned window (None: unbounded)."""
    sq, skv = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    rows = torch.arange(sq).unsqueeze(1) + (skv - sq)
    cols = torch.arange(skv).unsqueeze(0)
    keep = torch.ones(sq, skv, dtype=torch.bool)
    if left is not None:
        keep &= cols >= rows - left
    if right is not None:
        keep &= cols <= rows + right
    s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v), torch.logsumexp(s, dim=-1)


class StandInInterface:
    """flash_attn.cute.interface in miniature. Flags make it do what a replay must not copy: pass a tensor the
    replay would not have (extra_tensor), launch a second compiled function (second_launch), change out after the
    launch (post_process), or launch kernels that only work when called from inside the interface (context_only)."""

    def __init__(self, extra_tensor=False, second_launch=False, post_process=False, context_only=False):
        self.flags = dict(extra_tensor=extra_tensor, second_launch=second_launch, post_process=post_process,
                          context_only=context_only)
        self.preambles = self.launches = 0
        self.inside = False
        iface = self

        def _flash_attn_fwd(q, k, v, softmax_scale=None, causal=False, softcap=None, window_size_left=None,
                            window_size_right=None, learnable_sink=None, num_splits=1, return_lse=False, out=None,
                            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
            assert cu_seqlens_q is None and learnable_sink is None and not causal
            iface.preambles += 1
            b, sq, h, _ = q.shape
            out = torch.empty(b, sq, h, v.shape[-1], dtype=q.dtype) if out is None else out
            lse = torch.empty(b, h, sq, dtype=torch.float32)
            key = (q.shape, k.shape, v.shape, q.dtype, window_size_left, window_size_right)
            if key not in _flash_attn_fwd.compile_cache:
                _flash_attn_fwd.compile_cache[key] = iface.compiled
            scheduler = torch.zeros(1, dtype=torch.int32) if iface.flags["extra_tensor"] else None
            if iface.flags["second_launch"]:
                if "scan" not in _compute_tile_cumsum.compile_cache:
                    _compute_tile_cumsum.compile_cache["scan"] = lambda: None
                _compute_tile_cumsum.compile_cache["scan"]()
            iface.inside = True
            try:
                _flash_attn_fwd.compile_cache[key](q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                                   softmax_scale, None, None, None, None, None, window_size_left,
                                                   window_size_right, None, None, _AuxData(), scheduler, None)
            finally:
                iface.inside = False
            if iface.flags["post_process"]:
                out.mul_(1.0 + 1e-3)
            return out, lse, None, None, None

        def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left=None,
                            window_size_right=None, deterministic=False, **kwargs):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            with torch.enable_grad():
                o, _ = _attend(*leaves, softmax_scale, window_size_left, window_size_right)
                return torch.autograd.grad(o, leaves, dout)

        def _compute_tile_cumsum():  # pragma: no cover - only its compile cache is used
            raise AssertionError

        _flash_attn_fwd.compile_cache = _JitCache()
        _compute_tile_cumsum.compile_cache = _JitCache()
        self._flash_attn_fwd, self._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
        self._compute_tile_cumsum = _compute_tile_cumsum

    @staticmethod
    def _get_device_arch():
        return 90

    def compiled(self, q, k, v, out, lse, scale, cu_q, cu_k, used_q, used_k, page_table, left, right, sink,
                 sparse, aux, scheduler, splits):
        if self.flags["context_only"] and not self.inside:
            raise RuntimeError("launched outside the interface")
        self.launches += 1
        o, s = _attend(q, k, v, scale, left, right)
        out.copy_(o)
        lse.copy_(s)


def _engine(iface):
    engine = FlashAttn4Engine.__new__(FlashAttn4Engine)  # no flash_attn.cute on the CPU machine
    engine._iface, engine.jit_events = iface, []
    return engine


def _check_values(engine, q, k, v, aux, cfg, train):
    inputs = [t.detach().clone().requires_grad_(train) for t in (q, k, v)]
    out, lse, _ = engine(*inputs, aux, cfg)
    want_inputs = [t.detach().clone().requires_grad_(train) for t in (q, k, v)]
    want, want_lse, _ = UnfusedEngine()(*want_inputs, aux, cfg)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), want_lse.double(), rtol=1e-6, atol=1e-6)
    if train:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
        got = torch.autograd.grad(out, inputs, dout)
        expected = torch.autograd.grad(want, want_inputs, dout)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("window, hk", [(None, 4), ((3, 0), 2)])
def test_repeat_forwards_replay_the_compiled_call_after_one_checked_call(train, window, hk):
    iface = StandInInterface()
    engine = _engine(iface)
    q, k, v, aux, cfg = make_case(hk=hk, d=32, dv=32, window=window, mask="causal" if window else "no_mask")
    fwd_cache = iface._flash_attn_fwd.compile_cache
    for _ in range(4):
        _check_values(engine, q, k, v, aux, cfg, train)
    # call 1: the interface, recorded; call 2: the replay checked against the interface; calls 3-4: replays
    assert iface.preambles == 2 and iface.launches == 5
    assert iface._flash_attn_fwd.compile_cache is fwd_cache  # the proxies were swapped back
    assert iface._compute_tile_cumsum.compile_cache.__class__ is _JitCache
    q2, k2, v2, aux2, cfg2 = make_case(hk=hk, d=32, dv=32, sq=7, skv=7, window=window,
                                       mask="causal" if window else "no_mask", seed=3)
    _check_values(engine, q2, k2, v2, aux2, cfg2, train)  # another signature: the interface again, recorded
    assert iface.preambles == 3


@pytest.mark.parametrize("flag", ["extra_tensor", "second_launch"])
def test_a_call_with_more_than_the_kernel_launch_keeps_the_interface(flag):
    iface = StandInInterface(**{flag: True})
    engine = _engine(iface)
    q, k, v, aux, cfg = make_case()
    for _ in range(3):
        _check_values(engine, q, k, v, aux, cfg, train=False)
    assert iface.preambles == 3 and iface.launches == 3


@pytest.mark.parametrize("flag", ["post_process", "context_only"])
def test_a_replay_that_fails_its_check_keeps_the_interface_with_a_warning(flag, caplog):
    iface = StandInInterface(**{flag: True})
    engine = _engine(iface)
    q, k, v, aux, cfg = make_case()
    with caplog.at_level(logging.WARNING, logger="attn_dispatch.backends"):
        outs = [engine(q.detach(), k.detach(), v.detach(), aux, cfg)[0] for _ in range(4)]
    assert "flash-attn-4 forward replay" in caplog.text
    for out in outs[1:]:  # what the interface gives, every call (its post-processing included)
        assert torch.equal(out, outs[0])
    if flag == "context_only":
        torch.testing.assert_close(outs[0], UnfusedEngine()(q.detach(), k.detach(), v.detach(), aux, cfg)[0])
    assert iface.preambles == 4  # the failed check's call, and every call after it


def test_an_unaligned_input_and_the_default_keep_the_interface(monkeypatch):
    q, k, v, aux, cfg = make_case()
    q, k, v = q.detach(), k.detach(), v.detach()
    storage = torch.empty(q.numel() + 1, dtype=q.dtype)
    unaligned = storage[1:].view(q.shape).copy_(q)  # 8 bytes past a 16-byte boundary (the interface would copy it)
    assert unaligned.data_ptr() % 16 == 8
    want = UnfusedEngine()(q, k, v, aux, cfg)[0]
    iface = StandInInterface()
    engine = _engine(iface)
    for _ in range(3):
        torch.testing.assert_close(engine(unaligned, k, v, aux, cfg)[0], want, rtol=1e-10, atol=1e-10)
    assert iface.preambles == 3
    monkeypatch.delenv(_fa4_replay.ENV_SWITCH)  # the default: off
    iface = StandInInterface()
    engine = _engine(iface)
    for _ in range(3):
        torch.testing.assert_close(engine(q, k, v, aux, cfg)[0], want, rtol=1e-10, atol=1e-10)
    assert iface.preambles == 3


def test_replays_take_no_output_buffer_and_hold_no_tensor():
    iface = StandInInterface()
    replays = _fa4_replay.ForwardReplays(iface)
    q, k, v, _, cfg = make_case()
    q, k, v = q.detach(), k.detach(), v.detach()

    def interface(out):
        return iface._flash_attn_fwd(q, k, v, softmax_scale=cfg.softmax_scale, return_lse=True, out=out)[:2]

    results = [replays(("sig",), q, k, v, None, interface) for _ in range(3)]
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    assert results[2][0].data_ptr() != results[1][0].data_ptr()  # each replay allocates its own out
    replay = replays.entries[("sig",)]
    assert replay.checked and replay.out_layout == (tuple(q.shape[:-1]) + (v.shape[-1],), results[0][0].stride(),
                                                     q.dtype)
    assert not any(isinstance(a, torch.Tensor) for a in replay.args)
    assert [a.name for a in replay.args if isinstance(a, _fa4_replay._Slot)] == ["q", "k", "v", "out", "lse"]
