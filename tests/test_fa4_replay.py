"""flash-attn-4's replay (backends/_fa4_replay.py) against a stand-in interface built as flash_attn.cute's is: Python
preambles that allocate results and buffers, a compile cache per launching function, one launch a forward and three
to five a backward. Values and gradients against the unfused engine in float64; the stand-in counts preambles and
launches."""
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
    monkeypatch.setenv(_fa4_replay.ENV_SWITCH, "1")  # the default, whatever the shell running the tests set


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
    """flash_attn.cute.interface in miniature. Forward: a preamble that allocates out and lse, one launch. Backward:
    a preamble that allocates dq, dk, dv and float32 buffers (dq_accum uninitialised, which the first launch zeroes;
    with GQA dk/dv accumulators in zeros), then three launches (preprocess, main, postprocess), as 4.0.0b36 does.
    Flags add what a replay reproduces (a zeroed scheduler buffer and a second launch: scheduler), what it refuses
    to record (an argument object it cannot vouch for: object_arg; one buffer in two layouts: two_views; lse made
    by a torch op, no launch: torch_result), and what only its check catches (out changed after the launch:
    post_process; kernels that work only from inside the interface: context_only)."""

    def __init__(self, **flags):
        names = ("scheduler", "object_arg", "two_views", "torch_result", "post_process", "context_only",
                 "zeroed_scratch")
        assert set(flags) <= set(names)
        self.flags = {name: flags.get(name, False) for name in names}
        self.preambles = {"fwd": 0, "bwd": 0}
        self.launches = {"fwd": 0, "bwd": 0}
        self.inside = False
        iface = self

        def launch(owner, key, fn, *args):
            cache = owner.compile_cache
            if key not in cache:
                cache[key] = fn
            iface.inside = True
            try:
                cache[key](*args)
            finally:
                iface.inside = False

        def _flash_attn_fwd(q, k, v, softmax_scale=None, causal=False, softcap=None, window_size_left=None,
                            window_size_right=None, learnable_sink=None, num_splits=1, return_lse=False, out=None,
                            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
            assert cu_seqlens_q is None and learnable_sink is None and not causal
            iface.preambles["fwd"] += 1
            b, sq, h, _ = q.shape
            out = torch.empty(b, sq, h, v.shape[-1], dtype=q.dtype) if out is None else out
            lse = torch.empty(b, h, sq, dtype=torch.float32)
            scheduler = torch.zeros(4, dtype=torch.int32) if iface.flags["scheduler"] else None
            if iface.flags["scheduler"]:  # a launch that reads the zeroed buffer first
                launch(_compute_tile_cumsum, "scan", iface.scan, scheduler)
            if iface.flags["two_views"]:
                launch(_compute_tile_cumsum, "scan2", iface.scan, lse.view(-1))
            extra = object() if iface.flags["object_arg"] else None
            launch(_flash_attn_fwd, (q.shape, k.shape, v.shape, q.dtype, window_size_left, window_size_right),
                   iface.fwd_kernel, q.detach(), k.detach(), v.detach(), out.detach(), lse, softmax_scale, None,
                   None, None, None, None, window_size_left, window_size_right, None, None, _AuxData(), scheduler,
                   extra)
            if iface.flags["torch_result"]:
                lse = lse.clone()
            if iface.flags["post_process"]:
                out.mul_(1.0 + 1e-3)
            return out, lse, None, None, None

        def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left=None,
                            window_size_right=None, deterministic=False, **kwargs):
            assert not kwargs and not causal
            iface.preambles["bwd"] += 1
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            b, sq, h, d = q.shape
            # zeroed by the preprocess launch (fp32 there); zeroed_scratch: fresh memory that happens to hold zeros
            dq_accum = (torch.zeros if iface.flags["zeroed_scratch"] else torch.empty)(b, h, sq * d, dtype=q.dtype)
            dpsum = torch.empty(b, h, sq, dtype=torch.float32)
            lse_log2 = torch.empty(b, h, sq, dtype=torch.float32)
            gqa = k.shape[2] != h
            dk_target = torch.zeros(k.shape, dtype=q.dtype) if gqa else dk  # accumulators (fp32 there)
            dv_target = torch.zeros(v.shape, dtype=q.dtype) if gqa else dv
            launch(_bwd_preprocess, "pre", iface.bwd_preprocess, out, dout, dpsum, lse, lse_log2, dq_accum, None,
                   None, None, None, None, 1.0, None, None)
            launch(_flash_attn_bwd, (q.shape, k.shape, window_size_left, window_size_right), iface.bwd_kernel,
                   q.detach(), k.detach(), v.detach(), dout, lse_log2, dpsum, dq_accum, dk_target, dv_target,
                   softmax_scale, None, None, None, None, window_size_left, window_size_right, gqa, None, None,
                   _AuxData(), None, None)
            launch(_bwd_postprocess_convert, "post-dq", iface.bwd_postprocess, dq_accum, dq, softmax_scale, None,
                   None, None, None)
            if gqa:
                launch(_bwd_postprocess_convert, "post-dk", iface.bwd_postprocess, dk_target, dk, 1.0, None, None,
                       None, None)
                launch(_bwd_postprocess_convert, "post-dv", iface.bwd_postprocess, dv_target, dv, 1.0, None, None,
                       None, None)
            return dq, dk, dv

        def _compute_tile_cumsum():  # pragma: no cover - only its compile cache is used
            raise AssertionError

        _bwd_preprocess = _bwd_postprocess_convert = None  # the launchers' owners: functions with caches

        def _bwd_preprocess():  # noqa: F811 - pragma: no cover
            raise AssertionError

        def _bwd_postprocess_convert():  # noqa: F811 - pragma: no cover
            raise AssertionError

        for fn in (_flash_attn_fwd, _flash_attn_bwd, _compute_tile_cumsum, _bwd_preprocess, _bwd_postprocess_convert):
            fn.compile_cache = _JitCache()
            setattr(self, fn.__name__, fn)

    @staticmethod
    def _get_device_arch():
        return 90

    def _count(self, kind):
        if self.flags["context_only"] and not self.inside:
            raise RuntimeError("launched outside the interface")
        self.launches[kind] += 1

    def scan(self, buffer):
        assert buffer.dim() == 1 and not (buffer.dtype == torch.int32 and buffer.any()), "not zeroed"
        if buffer.dtype == torch.int32:
            buffer.add_(1)

    def fwd_kernel(self, q, k, v, out, lse, scale, cu_q, cu_k, used_q, used_k, page_table, left, right, sink,
                   sparse, aux, scheduler, extra):
        self._count("fwd")
        assert scheduler is None or scheduler.tolist() == [1, 1, 1, 1]
        o, s = _attend(q, k, v, scale, left, right)
        out.copy_(o)
        lse.copy_(s)

    def bwd_preprocess(self, out, dout, dpsum, lse, lse_log2, dq_accum, *rest):
        self._count("bwd")
        dpsum.copy_((out.double() * dout.double()).sum(-1).transpose(1, 2))
        lse_log2.copy_(lse * 1.4426950408889634)
        dq_accum.zero_()

    def bwd_kernel(self, q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, scale, cu_q, cu_k, used_q, used_k, left,
                   right, accumulate, *rest):
        self._count("bwd")
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            o, _ = _attend(*leaves, scale, left, right)
            gq, gk, gv = torch.autograd.grad(o, leaves, dout)
        dq_accum.add_(gq.transpose(1, 2).reshape(dq_accum.shape))  # accumulates: needs the zeroing above
        for target, grad in ((dk, gk), (dv, gv)):
            target.add_(grad) if accumulate else target.copy_(grad)  # GQA: into the zeroed accumulators

    def bwd_postprocess(self, accum, output, scale, *rest):
        self._count("bwd")
        if accum.dim() == 3:  # dq_accum [b, h, s * d]
            b, s, h, d = output.shape
            output.copy_(accum.view(b, h, s, d).transpose(1, 2))
        else:
            output.copy_(accum)


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
def test_repeat_calls_replay_the_launches_after_one_checked_call(train, window, hk):
    iface = StandInInterface()
    engine = _engine(iface)
    mask = "causal" if window else "no_mask"
    q, k, v, aux, cfg = make_case(hk=hk, d=32, dv=32, window=window, mask=mask)
    caches = {name: getattr(iface, name).compile_cache for name in _fa4_replay.compile_cache_owners(iface)}
    for _ in range(4):
        _check_values(engine, q, k, v, aux, cfg, train)
    # call 1: the interface, recorded; call 2: the replay checked against the interface; calls 3-4: replays
    per_call = {"fwd": 1, "bwd": 5 if hk != 4 else 3}  # the backward's launches (GQA: two more postprocesses)
    kinds = ("fwd", "bwd") if train else ("fwd",)
    for kind in kinds:  # the check may replay once or twice more with a poisoned buffer (dq_accum if it held zeros)
        poisoned, rest = divmod(iface.launches[kind] - 5 * per_call[kind], per_call[kind])
        assert iface.preambles[kind] == 2 and rest == 0 and 0 <= poisoned <= 2, kind
    assert {name: getattr(iface, name).compile_cache for name in caches} == caches  # the proxies were swapped back
    if train and hk != 4:  # the GQA accumulators were zeros at first use: the replay allocates zeros
        replay = next(iter(engine._replays("bwd").entries.values()))
        assert [a.zeros for a in replay.buffers].count(True) >= 2
    q2, k2, v2, aux2, cfg2 = make_case(hk=hk, d=32, dv=32, sq=7, skv=7, window=window, mask=mask, seed=3)
    _check_values(engine, q2, k2, v2, aux2, cfg2, train)  # another signature: the interface again, recorded
    assert all(iface.preambles[kind] == 3 for kind in kinds)


def test_a_zeroed_buffer_and_a_second_launch_are_replayed():
    iface = StandInInterface(scheduler=True)
    engine = _engine(iface)
    q, k, v, aux, cfg = make_case()
    for _ in range(4):
        _check_values(engine, q, k, v, aux, cfg, train=False)  # the forward kernel asserts the scan ran first
    assert iface.preambles["fwd"] == 2
    replay = next(iter(engine._replays("fwd").entries.values()))
    assert replay.checked and len(replay.launches) == 2 and [a.zeros for a in replay.buffers] == [True]


@pytest.mark.parametrize("flag", ["object_arg", "two_views", "torch_result"])
def test_a_call_the_replay_cannot_reproduce_keeps_the_interface(flag):
    iface = StandInInterface(**{flag: True})
    engine = _engine(iface)
    q, k, v, aux, cfg = make_case()
    for _ in range(3):
        _check_values(engine, q, k, v, aux, cfg, train=False)
    assert iface.preambles["fwd"] == 3 and iface.launches["fwd"] == 3
    assert list(engine._replays("fwd").entries.values()) == [None]


@pytest.mark.parametrize("flag", ["post_process", "context_only"])
def test_a_replay_that_fails_its_check_keeps_the_interface_with_a_warning(flag, caplog):
    iface = StandInInterface(**{flag: True})
    engine = _engine(iface)
    q, k, v, aux, cfg = make_case()
    with caplog.at_level(logging.WARNING, logger="attn_dispatch.backends"):
        outs = [engine(q.detach(), k.detach(), v.detach(), aux, cfg)[0] for _ in range(4)]
    assert "flash-attn-4 replay" in caplog.text
    for out in outs[1:]:  # what the interface gives, every call (its post-processing included)
        assert torch.equal(out, outs[0])
    if flag == "context_only":
        torch.testing.assert_close(outs[0], UnfusedEngine()(q.detach(), k.detach(), v.detach(), aux, cfg)[0])
    assert iface.preambles["fwd"] == 4  # the failed check's call, and every call after it


def test_a_backward_whose_replay_fails_its_check_still_gives_the_interfaces_gradients(caplog):
    iface = StandInInterface(context_only=True)
    engine = _engine(iface)
    q, k, v, aux, cfg = make_case(d=32, dv=32)
    with caplog.at_level(logging.WARNING, logger="attn_dispatch.backends"):
        for _ in range(3):
            _check_values(engine, q, k, v, aux, cfg, train=True)
    assert "flash-attn-4 replay failed its check" in caplog.text
    assert iface.preambles["bwd"] == 3


def test_an_unaligned_input_and_the_switch_off_keep_the_interface(monkeypatch):
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
    assert iface.preambles["fwd"] == 3
    monkeypatch.setenv(_fa4_replay.ENV_SWITCH, "0")  # switched off
    iface = StandInInterface()
    engine = _engine(iface)
    for _ in range(3):
        torch.testing.assert_close(engine(q, k, v, aux, cfg)[0], want, rtol=1e-10, atol=1e-10)
    assert iface.preambles["fwd"] == 3


def test_a_replay_allocates_its_results_and_holds_no_tensor():
    iface = StandInInterface()
    replays = _fa4_replay.Replays(iface, "_flash_attn_fwd", ("out", "lse"))
    q, k, v, _, cfg = make_case()
    q, k, v = q.detach(), k.detach(), v.detach()

    def interface(tensors):
        return iface._flash_attn_fwd(q, k, v, softmax_scale=cfg.softmax_scale, return_lse=True,
                                     out=tensors.get("out"))[:2]

    results = [replays((cfg.softmax_scale,), {"q": q, "k": k, "v": v}, interface) for _ in range(3)]
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    assert results[2][0].data_ptr() != results[1][0].data_ptr()  # each replay allocates its own out
    replay, = replays.entries.values()
    assert replay.checked and set(replay.allocs) == {"out", "lse"} and not replay.buffers
    assert replay.allocs["out"].shape == tuple(q.shape[:-1]) + (v.shape[-1],)
    (fn, args), = replay.launches
    assert not any(isinstance(a, torch.Tensor) for a in args)
    assert [a.name for a in args if isinstance(a, _fa4_replay._Tensor)] == ["q", "k", "v", "out", "lse"]


def test_the_nondeterministic_check_tolerates_rounding_not_a_missed_initialisation():
    b = torch.randn(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rounded = b + 1e-3 * b.abs().max() * torch.sign(torch.randn(64, generator=torch.Generator().manual_seed(1),
                                                                 dtype=torch.float64))
    assert _fa4_replay._close(b.clone(), b, exact=True) and not _fa4_replay._close(rounded, b, exact=True)
    assert _fa4_replay._close(rounded, b, exact=False)
    assert not _fa4_replay._close(2 * b, b, exact=False)  # an accumulator not zeroed: twice the gradient
    assert not _fa4_replay._close(b.float(), b, exact=False)  # another dtype


def test_inputs_that_share_memory_are_not_recorded_and_a_later_distinct_call_is():
    iface = StandInInterface()
    engine = _engine(iface)
    q, k, v, aux, cfg = make_case(d=8, dv=8)
    q, k = q.detach(), k.detach()
    want_same = UnfusedEngine()(q, k, k, aux, cfg)[0]
    for _ in range(2):  # k passed as v too: told apart by position only, so not recorded
        torch.testing.assert_close(engine(q, k, k, aux, cfg)[0], want_same, rtol=1e-10, atol=1e-10)
    assert not engine._replays("fwd").entries and iface.preambles["fwd"] == 2
    v = k.clone()  # the same values in their own memory: the same signature, now recorded, then replayed
    for _ in range(3):
        torch.testing.assert_close(engine(q, k, v, aux, cfg)[0], want_same, rtol=1e-10, atol=1e-10)
    assert iface.preambles["fwd"] == 4
    torch.testing.assert_close(engine(q, k, k, aux, cfg)[0], want_same, rtol=1e-10, atol=1e-10)  # replayed
    assert iface.preambles["fwd"] == 4


def test_past_the_signature_limit_the_least_recently_used_is_dropped_and_new_ones_still_replay(monkeypatch):
    monkeypatch.setattr(_fa4_replay, "MAX_SIGNATURES", 2)
    iface = StandInInterface()
    engine = _engine(iface)
    calls = {n: make_case(d=8, dv=8, sq=n, skv=n, seed=n) for n in (5, 6, 7)}

    def run(n, times):
        q, k, v, aux, cfg = calls[n]
        want = UnfusedEngine()(q.detach(), k.detach(), v.detach(), aux, cfg)[0]
        for _ in range(times):
            torch.testing.assert_close(engine(q.detach(), k.detach(), v.detach(), aux, cfg)[0], want,
                                       rtol=1e-10, atol=1e-10)

    run(5, 3)  # recorded, checked, replayed: 2 preambles
    run(6, 3)
    run(5, 1)  # replayed: now the most recently used
    assert iface.preambles["fwd"] == 4
    run(7, 3)  # a third signature past the limit: recorded, checked, replayed; 6 (least recent) dropped
    assert iface.preambles["fwd"] == 6 and len(engine._replays("fwd").entries) == 2
    run(5, 2)  # still kept: replayed
    assert iface.preambles["fwd"] == 6
    run(6, 3)  # dropped: recorded and checked again, then replayed
    assert iface.preambles["fwd"] == 8


def test_the_replay_is_on_unless_the_switch_says_0(monkeypatch):
    monkeypatch.delenv(_fa4_replay.ENV_SWITCH)
    assert _fa4_replay.replay_enabled()
    monkeypatch.setenv(_fa4_replay.ENV_SWITCH, "0")
    assert not _fa4_replay.replay_enabled()


@pytest.mark.parametrize("hk", [4, 2])
def test_a_buffer_its_first_launch_overwrites_is_not_zeroed_and_an_accumulator_is(hk):
    iface = StandInInterface(zeroed_scratch=True)  # dq_accum holds zeros when recorded, and the preprocess zeroes it
    engine = _engine(iface)
    q, k, v, aux, cfg = make_case(hk=hk, d=32, dv=32)
    for _ in range(4):
        _check_values(engine, q, k, v, aux, cfg, train=True)
    replay, = engine._replays("bwd").entries.values()
    dq_accum = [a for a in replay.buffers if a.shape == (q.shape[0], q.shape[2], q.shape[1] * q.shape[3])]
    assert replay.checked and len(dq_accum) == 1
    if hk == 4:  # nothing else needs zeros: the poisoned check passed and the memset is gone
        assert not dq_accum[0].zeros and not any(a.zeros for a in replay.buffers)
    else:  # the GQA accumulators need theirs: the poisoned check failed, every zeroing stays
        assert dq_accum[0].zeros and [a.zeros for a in replay.buffers].count(True) >= 3
    assert all(a.fill is None for a in replay.buffers)
    _check_values(engine, q, k, v, aux, cfg, train=True)  # and still right
