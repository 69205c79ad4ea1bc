"""The module's cached path for torch's providers: the native call bound to a tensor signature (bind_fast). On the
CPU the two aten ops are stood in for by torch's CPU flash op (same autograd, same [b, h, s, d] views), wrapped
to record what each call passed; values and gradients are checked against the float64 reference."""
from __future__ import annotations

import pytest
import torch

from attn_dispatch import backends
from attn_dispatch.backends import _torch_native
from attn_dispatch.backends.base import Engine
from attn_dispatch.module import DotProductAttention
from tests.reference import reference_attention

_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class Recorder:
    """Stands in for the CUDA-only op: records each call's (query strides, compute_log_sumexp)."""

    def __init__(self):
        self.calls = []

    def cudnn(self, q, k, v, bias, compute_lse, dropout_p, is_causal, debug, scale=None):
        assert bias is None and dropout_p == 0.0 and not debug
        self.calls.append(("cudnn", q.stride(), compute_lse))
        out, lse = _CPU_FLASH(q, k, v, dropout_p, is_causal, scale=scale)
        return out, (lse.unsqueeze(-1) if compute_lse else None)

    def flash(self, q, k, v, dropout_p, is_causal, debug, scale=None):
        self.calls.append(("flash", q.stride(), True))
        return _CPU_FLASH(q, k, v, dropout_p, is_causal, scale=scale)


@pytest.fixture(params=["cudnn", "flash"])
def native(request, monkeypatch):
    """A NativeOpPath engine in the unfused provider's place (the only one selection allows on the CPU)."""
    recorder = Recorder()
    monkeypatch.setattr(_torch_native, "_CUDNN", recorder.cudnn)
    monkeypatch.setattr(_torch_native, "_FLASH", recorder.flash)
    call = _torch_native.cudnn_call if request.param == "cudnn" else _torch_native.flash_call

    class StandIn(_torch_native.NativeOpPath, Engine):
        family, provider = "unfused", "pytorch"
        native_call = staticmethod(call)

        def forward(self, *args):  # the general path must not run in these tests
            raise AssertionError("general path taken")

    monkeypatch.setitem(backends._INSTANCES, "unfused:pytorch", StandIn())
    recorder.kind = request.param
    return recorder


def _check(module, q, k, v, fmt, mask):
    dout = torch.randn(*module(q, k, v).shape, dtype=q.dtype)
    out = module(q, k, v)
    ref_out, _ = reference_attention(q.double(), k.double(), v.double(), qkv_format=fmt, attn_mask_type=mask)
    torch.testing.assert_close(out.double(), ref_out.flatten(-2), atol=2e-5, rtol=1e-5)
    if q.requires_grad and torch.is_grad_enabled():
        grads = torch.autograd.grad(out, (q, k, v), dout)
        leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
        ref, _ = reference_attention(*leaves, qkv_format=fmt, attn_mask_type=mask)
        expected = torch.autograd.grad(ref.flatten(-2), leaves, dout.double())
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.private_torch
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_bound_call_matches_the_reference_with_gradients(native, fmt, mask):
    torch.manual_seed(0)
    b, s, h, hkv, d = 2, 24, 4, 4, 16
    shape = (b, s) if fmt == "bshd" else (s, b)
    q, k, v = (torch.randn(*shape, n, d).requires_grad_() for n in (h, hkv, hkv))
    module = DotProductAttention(h, d, qkv_format=fmt, attn_mask_type=mask, backend="unfused")
    module(q, k, v)  # plans; the next calls take the cached path
    hit = module._plans.last[2]
    assert hit.call is not None and module.last_decision.chosen == "unfused:pytorch"
    before = len(native.calls)
    _check(module, q, k, v, fmt, mask)
    assert len(native.calls) > before and all(c[2] for c in native.calls[before:])  # lse for the backward


def test_no_grad_then_training_keeps_a_bound_call_each_with_the_right_lse_flag(native):
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 16, 2, 8) for _ in range(3))
    module = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal", backend="unfused")
    with torch.no_grad():
        module(q, k, v)
        module(q, k, v)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    module(*leaves)
    native.calls.clear()
    _check(module, *leaves, "bshd", "causal")  # the lse flag comes from the leaves, not the no_grad plan
    assert native.calls and all(flag for _, _, flag in native.calls)
    native.calls.clear()
    with torch.no_grad():
        module(q, k, v)
    if native.kind == "cudnn":
        assert native.calls[-1][2] is False  # inference asks for no lse
    assert len(module._plans.fast) == 2


def test_same_shapes_other_strides_do_not_use_a_call_bound_to_contiguous_tensors(native):
    torch.manual_seed(2)
    b, s, h, d = 2, 16, 2, 8
    module = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="no_mask", backend="unfused").eval()
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    with torch.no_grad():
        module(q, k, v)
        # q as a slice of a fused [b, s, h, 3, d] projection: same shape, other strides
        fused = torch.randn(b, s, h, 3, d)
        q2, k2, v2 = fused.unbind(3)
        assert q2.shape == q.shape and q2.stride() != q.stride()
        _check(module, q2, k2, v2, "bshd", "no_mask")
        _check(module, q, k, v, "bshd", "no_mask")


def test_calls_the_op_cannot_express_are_not_bound(native):
    from attn_dispatch.backends.base import AttnAux, AttnConfig

    q = torch.randn(1, 8, 2, 8)
    k = torch.randn(1, 16, 2, 8)
    window = AttnConfig(qkv_format="bshd", attn_mask_type="causal", window_size=(4, 0), softmax_scale=0.3)
    top_left = AttnConfig(qkv_format="bshd", attn_mask_type="causal", window_size=(-1, 0), softmax_scale=0.3)
    bottom_right = AttnConfig(qkv_format="bshd", attn_mask_type="causal_bottom_right", window_size=(-1, 0),
                              softmax_scale=0.3)
    aux = AttnAux(max_seqlen_q=8, max_seqlen_kv=16)
    assert _torch_native.bind(_torch_native.cudnn_call, q, k, k, aux, window) is None
    assert _torch_native.bind(_torch_native.cudnn_call, q, k, k, aux, top_left) is None  # sq != skv
    assert _torch_native.bind(_torch_native.flash_call, q, k, k, aux, top_left) is None
    assert _torch_native.bind(_torch_native.flash_call, q, k, k, aux, bottom_right) is not None
    strided = torch.randn(1, 16, 2, 16)[..., ::2]
    assert _torch_native.bind(_torch_native.flash_call, strided, strided, strided, aux, top_left) is None


def _fa2_bshd_stand_in(calls: list, causal_flag_honoured: bool = True):
    """aten::_flash_attention_forward's signature on the CPU: [b, s, h, d] in and out (the CPU flash op on views)."""
    def fa2(q, k, v, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, debug, scale=None):
        assert cum_q is None and cum_k is None and (max_q, max_k) == (q.shape[1], k.shape[1]) and not debug
        calls.append(("fa2_bshd", q.stride()))
        out, lse = _CPU_FLASH(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p,
                              is_causal and causal_flag_honoured, scale=scale)
        return out.transpose(1, 2), lse, None, None, None
    return fa2


@pytest.fixture
def fa2_bshd(monkeypatch):
    """torch FA2 as the provider on the CPU, with the bshd op stood in and its self-check passed: (calls of the bshd
    op, the Recorder of _FLASH's)."""
    recorder, calls = Recorder(), []
    monkeypatch.setattr(_torch_native, "_FLASH", recorder.flash)
    monkeypatch.setattr(_torch_native, "_FA2_BSHD", _fa2_bshd_stand_in(calls))
    monkeypatch.setitem(_torch_native._FA2_BSHD_OK, torch.device("cpu"), True)
    monkeypatch.setattr(_torch_native, "fa2_bshd_ok", lambda device: _torch_native._FA2_BSHD_OK.get(device, False))

    class StandIn(_torch_native.NativeOpPath, Engine):
        family, provider = "unfused", "pytorch"
        native_call = staticmethod(_torch_native.flash_call)

        def forward(self, *args):
            raise AssertionError("general path taken")

    monkeypatch.setitem(backends._INSTANCES, "unfused:pytorch", StandIn())
    return calls, recorder


@pytest.mark.private_torch
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_fa2_takes_the_bshd_op_once_the_self_check_passed(fa2_bshd, fmt, mask):
    """bshd calls run FA2's own op with no views where the device's self-check passed, the first (planning) call
    and the bound repeats alike; sbhd keeps _FLASH. Values and gradients against the float64 reference, GQA."""
    calls, recorder = fa2_bshd
    torch.manual_seed(3)
    b, s, h, hkv, d = 2, 20, 4, 2, 16
    shape = (b, s) if fmt == "bshd" else (s, b)
    q, k, v = (torch.randn(*shape, n, d).requires_grad_() for n in (h, hkv, hkv))
    module = DotProductAttention(h, d, num_gqa_groups=hkv, qkv_format=fmt, attn_mask_type=mask, backend="unfused")
    _check(module, q, k, v, fmt, mask)  # its first call plans (flash_call), the next ones take the bound call
    assert module._plans.last[2].call is not None  # the bound call the repeats take
    used, other = (calls, recorder.calls) if fmt == "bshd" else (recorder.calls, calls)
    assert len(used) == 2 and not other  # the planning call (flash_call) and a bound repeat


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_function_on_fa2_takes_the_bshd_op_with_no_views_in(fa2_bshd, is_causal):
    """The SDPA-signature function (what the transformers integration calls) hands [b, h, s, d] tensors over as
    bshd views: FA2's bshd op takes them as they are. Against F.scaled_dot_product_attention in float64."""
    from attn_dispatch import scaled_dot_product_attention

    calls, recorder = fa2_bshd
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 6, 24, 16, requires_grad=True) for _ in range(3))  # [b, h, s, d] (bshd memory too)
    q4, k4, v4 = (x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in (q, k, v))
    for inputs in ((q, k, v), (q4, k4, v4)):
        out = scaled_dot_product_attention(*inputs, is_causal=is_causal)
        ref = torch.nn.functional.scaled_dot_product_attention(*(x.double() for x in inputs), is_causal=is_causal)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, inputs, dout)
        expected = torch.autograd.grad(ref, inputs, dout.double())
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got.double(), want.double(), atol=2e-5, rtol=1e-5)
    assert calls and not recorder.calls
    assert any(stride[-1] == 1 and stride[1] == 16 * 6 for _, stride in calls)  # bshd memory went in unpermuted


def test_fa2_bshd_self_check_passes_only_an_op_equal_to_flash(monkeypatch):
    """The self-check compares the bshd op with _FLASH on a causal GQA call, forward and gradients: a stand-in that
    computes the same passes; one that drops the causal mask, or raises, fails (the module then keeps _FLASH)."""
    monkeypatch.setattr(_torch_native, "_FLASH", Recorder().flash)
    cpu = torch.device("cpu")
    monkeypatch.setattr(_torch_native, "_FA2_BSHD", _fa2_bshd_stand_in([]))
    assert _torch_native._check_fa2_bshd(cpu) is True
    monkeypatch.setattr(_torch_native, "_FA2_BSHD", _fa2_bshd_stand_in([], causal_flag_honoured=False))
    assert _torch_native._check_fa2_bshd(cpu) is False

    def raises(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    monkeypatch.setattr(_torch_native, "_FA2_BSHD", raises)
    assert _torch_native._check_fa2_bshd(cpu) is False
    with torch.inference_mode():  # the check builds its own autograd graph even there
        monkeypatch.setattr(_torch_native, "_FA2_BSHD", _fa2_bshd_stand_in([]))
        assert _torch_native._check_fa2_bshd(cpu) is True
    assert _torch_native.fa2_bshd_ok(cpu) is False  # never on a CPU device: the op is CUDA's


@pytest.mark.private_torch
def test_sdpa_function_repeats_run_the_op_on_its_bhsd_tensors(native, monkeypatch):
    """The SDPA-signature function's third call of a signature (its plan used twice) runs the torch provider's op
    on the [b, h, s, d] tensors as they are, skipping the module's bshd path; switching grad mode, shapes or memory
    layout stays correct (other signatures plan or take the bshd path). Values and gradients vs float64."""
    from attn_dispatch import sdpa

    monkeypatch.setattr(sdpa, "_MODULES", {})  # modules of earlier tests hold plans of other stand-ins
    unmerged = []
    through = DotProductAttention._attend_unmerged
    monkeypatch.setattr(DotProductAttention, "_attend_unmerged",
                        lambda self, *a, **kw: (unmerged.append(1), through(self, *a, **kw))[1])
    torch.manual_seed(6)

    def fresh(b, h, hkv, s, d, bshd_memory=False):
        shape = lambda n: (b, s, n, d) if bshd_memory else (b, n, s, d)  # noqa: E731
        made = [torch.randn(*shape(n)) for n in (h, hkv, hkv)]
        return [(x.transpose(1, 2) if bshd_memory else x).requires_grad_() for x in made]

    def check(q, k, v, is_causal, grad):
        gqa = q.shape[1] != k.shape[1]
        with torch.set_grad_enabled(grad):
            out = sdpa.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)
        ref = torch.nn.functional.scaled_dot_product_attention(*(x.double() for x in (q, k, v)), is_causal=is_causal,
                                                               enable_gqa=gqa)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
        if grad:
            dout = torch.randn_like(out)
            for got, want in zip(torch.autograd.grad(out, (q, k, v), dout),
                                 torch.autograd.grad(ref, (q, k, v), dout.double())):
                torch.testing.assert_close(got.double(), want.double(), atol=2e-5, rtol=1e-5)

    calls = [fresh(2, 4, 2, 24, 16) for _ in range(4)]  # new tensors per call, one signature
    for i, (q, k, v) in enumerate(calls):
        check(q, k, v, True, grad=True)
    assert len(unmerged) == 2  # planned, then the bshd cached path (which binds); then the op on bhsd tensors
    before = len(native.calls)
    check(*fresh(2, 4, 2, 24, 16), True, grad=True)
    assert len(unmerged) == 2 and len(native.calls) == before + 1 and native.calls[-1][2]  # lse for the backward
    for grad in (False, True, False):  # grad mode flips: each mode's own plan
        check(*fresh(2, 4, 2, 24, 16), True, grad=grad)
    check(*fresh(2, 4, 2, 24, 16, bshd_memory=True), True, grad=True)  # same shapes, other strides
    check(*fresh(2, 4, 2, 40, 16), True, grad=True)  # another length
    check(*fresh(2, 4, 2, 24, 16), True, grad=True)
    if native.kind == "cudnn":
        with torch.no_grad():
            sdpa.scaled_dot_product_attention(*fresh(2, 4, 2, 24, 16), is_causal=True, enable_gqa=True)
            sdpa.scaled_dot_product_attention(*fresh(2, 4, 2, 24, 16), is_causal=True, enable_gqa=True)
        assert native.calls[-1][2] is False  # inference asks the op for no lse


def test_fa2_bshd_self_check_waits_out_a_capture_and_deterministic_mode(monkeypatch):
    """The self-check runs once per device, but not during a CUDA graph capture or under torch's deterministic
    mode: those calls keep _FLASH and the check runs on a later bind (the verdict is not cached from them)."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(_torch_native, "_FA2_BSHD_OK", {})
    monkeypatch.setattr(_torch_native, "_FA2_BSHD", object())
    monkeypatch.setattr(_torch_native, "_FLASH", object())
    checks = []
    monkeypatch.setattr(_torch_native, "_check_fa2_bshd", lambda device: checks.append(device) or True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert _torch_native.fa2_bshd_ok(cuda) is False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    torch.use_deterministic_algorithms(True)
    try:
        assert _torch_native.fa2_bshd_ok(cuda) is False
    finally:
        torch.use_deterministic_algorithms(False)
    assert not checks and not _torch_native._FA2_BSHD_OK
    assert _torch_native.fa2_bshd_ok(cuda) is True and _torch_native.fa2_bshd_ok(cuda) is True
    assert checks == [cuda]
