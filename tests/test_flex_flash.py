"""flex_attention:flash_attn_4 (FlexAttention lowered to flash-attn-4 with BACKEND='FLASH'): its table on described
machines, and a compile the lowering refuses becoming a recorded fact that moves selection on."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import types

import pytest
import torch

from attn_dispatch import runtime_facts, selection
from attn_dispatch.backends.base import AttnAux, AttnConfig, EngineRefused
from attn_dispatch.backends.flex_attention import FlexAttentionEngine, FlexFlashEngine, flash_lse_scaled_by_ln2
from attn_dispatch.constraints.flex_attention import flash_kind_of
from attn_dispatch.params import AttentionParams
from attn_dispatch.platform import PROFILES

FLASH = "flex_attention:flash_attn_4"
H100 = PROFILES["h100-cudnn9"]


def _verdict(params, platform=H100):
    decision = selection.explain(params, platform, use_cache=False)
    verdict = next(v for v in decision.verdicts if v.backend == "flex_attention" and v.provider == "flash_attn_4")
    return decision, [r.code for r in verdict.reasons]


def test_an_arbitrary_mask_in_inference_runs_on_flash_attn_4_first():
    decision, codes = _verdict(AttentionParams(attn_mask_type="arbitrary", max_seqlen_q=4096, is_training=False))
    assert codes == [] and decision.chosen == FLASH


def test_training_with_a_mask_alone_is_accepted():
    """The engine's training call asks for no LSE, which the FLASH backward cannot differentiate through."""
    _, codes = _verdict(AttentionParams(attn_mask_type="arbitrary", max_seqlen_q=4096))
    assert codes == []


@pytest.mark.parametrize("change, platform, code", [
    (dict(), PROFILES["a100-cudnn9"], "flex_attention.device"),
    (dict(), H100.with_packages(flash_attn_4=None), "flex_attention.package"),
    (dict(device_type="cpu", is_training=False), PROFILES["cpu"], "flex_attention.device"),
    (dict(head_dim_qk=256), H100, "flex_attention.head_dim"),
    (dict(head_dim_qk=128, head_dim_v=64), H100, "flex_attention.head_dim"),
    (dict(dtype="float32"), H100, "flex_attention.dtype"),
    (dict(softcap=30.0), H100, "flex_attention.score_mod_grad"),
    (dict(bias_type="post_scale_bias", bias_shape="1hss"), H100, "flex_attention.score_mod_grad"),
    (dict(score_mod=True), H100, "flex_attention.score_mod_grad"),
    (dict(deterministic=True), H100, "flex_attention.deterministic"),
    (dict(dropout=0.1), H100, "flex_attention.dropout"),
])
def test_refusals_name_their_check(change, platform, code):
    decision, codes = _verdict(AttentionParams(**{"attn_mask_type": "arbitrary", "max_seqlen_q": 2048, **change}),
                               platform)
    assert code in codes
    assert decision.chosen != FLASH


@pytest.mark.parametrize("mask, window", [("padding_causal", (-1, 0)), ("padding_causal", (255, 0)),
                                          ("padding", (128, 128))])
def test_packed_bands_are_refused_with_their_reason(mask, window):
    thd = dict(qkv_format="thd", attn_mask_type=mask, window_size=window, max_seqlen_q=2048, max_seqlen_kv=2048,
               batch_size=8, is_training=False)
    decision, codes = _verdict(AttentionParams(**thd))
    assert codes == ["flex_attention.packed_band"]
    verdict = next(v for v in decision.verdicts if v.provider == "flash_attn_4" and v.backend == "flex_attention")
    assert mask in verdict.reasons[0].message and verdict.reasons[0].fix
    if window != (-1, 0):
        assert str(window) in verdict.reasons[0].message
    # an unmasked pack (a document mask alone) still runs on it
    _, unmasked = _verdict(AttentionParams(**{**thd, "attn_mask_type": "padding", "window_size": (-1, -1)}))
    assert unmasked == []


def test_score_mods_run_in_inference():
    for change in (dict(softcap=30.0), dict(bias_type="alibi", alibi_slopes_shape="h"), dict(score_mod=True)):
        _, codes = _verdict(AttentionParams(attn_mask_type="arbitrary", is_training=False, **change))
        assert codes == [], change


def test_deterministic_training_is_accepted_on_blackwell():
    _, codes = _verdict(AttentionParams(attn_mask_type="arbitrary", deterministic=True, is_training=True),
                        PROFILES["b200-cudnn9"])
    assert "flex_attention.deterministic" not in codes


@pytest.fixture
def flash_engine():
    engine = object.__new__(FlexFlashEngine)  # flash_attn.cute is not installed on the CPU runner
    FlexAttentionEngine.__init__(engine)
    engine._lse_scaled_by_ln2 = flash_lse_scaled_by_ln2(engine.flex)
    return engine


class _Call:
    score_mod = block_mask = None


def test_a_refused_compile_is_recorded_and_selection_moves_on(flash_engine, monkeypatch):
    monkeypatch.setattr(runtime_facts, "_CURRENT", [runtime_facts.RuntimeFacts()])

    def refusing_kernel(*args):
        raise NotImplementedError("Flash attention with block mask but without full blocks is not supported yet")

    q = torch.randn(2, 4, 64, 128, dtype=torch.bfloat16)
    cfg = AttnConfig(attn_mask_type="arbitrary")
    kind = (False, "arbitrary", (-1, -1), "no_bias", False, False, False, True)
    with pytest.raises(EngineRefused, match="BACKEND='FLASH' refused"):
        flash_engine._launch(refusing_kernel, q, q, q, _Call(), cfg, None, kind)
    params = AttentionParams(attn_mask_type="arbitrary", batch_size=2, num_heads=4, max_seqlen_q=640,
                             is_training=False)
    assert runtime_facts.current().rejections.get(flash_kind_of(params), "").startswith("NotImplementedError")
    live = dataclasses.replace(H100, facts=runtime_facts.current())  # a described H100 that saw the refusal
    decision, codes = _verdict(params, live)
    assert codes == ["flex_attention.compile_refused"]
    assert decision.chosen == "flex_attention:torch"
    # another kind of call (another head dim) is not refused by it
    _, other = _verdict(params.replace(head_dim_qk=64, head_dim_v=64), live)
    assert other == []


def test_a_lowering_error_of_any_type_moves_selection_on(flash_engine, monkeypatch):
    """The CuTe DSL raised ValueError ('Expected TensorSSA, but got int') for a mask_mod indexing with a literal."""
    monkeypatch.setattr(runtime_facts, "_CURRENT", [runtime_facts.RuntimeFacts()])

    def lowering(*args):
        raise ValueError("Expected TensorSSA, but got <class 'int'>")

    q = torch.randn(1, 2, 16, 64)
    with pytest.raises(EngineRefused, match="TensorSSA"):
        flash_engine._launch(lowering, q, q, q, _Call(), AttnConfig(attn_mask_type="arbitrary"), None,
                             (False, "arbitrary", (-1, -1), "no_bias", False, False, False, True))
    assert len(runtime_facts.current().rejections) == 1


def test_broadcast_mask_dims_are_read_with_tensor_indices():
    from attn_dispatch.backends._flex_masks import reader

    mask = torch.rand(1, 1, 8, 8) < 0.5
    seen = []

    class Index(int):  # records how the reader indexes each dim
        def __sub__(self, other):
            seen.append("tensor zero")
            return Index(0)

    read = reader(mask)
    read(Index(0), Index(1), Index(3), Index(5))
    assert seen == ["tensor zero", "tensor zero"]
    b, h, q, kv = (torch.tensor(i) for i in (0, 1, 3, 5))
    assert read(b, h, q, kv) == mask[0, 0, 3, 5]


def test_the_kernel_is_asked_for_flash_attn_4(flash_engine):
    seen = {}

    def kernel(*args):
        seen["options"], seen["want_lse"] = args[-2:]
        return "out", "lse"

    q = torch.randn(1, 2, 16, 64)
    flash_engine._launch(kernel, q, q, q, _Call(), AttnConfig(), None, (False,) + ("no_mask", (-1, -1), "no_bias",
                                                                                    False, False, False, False))
    assert seen == {"options": {"BACKEND": "FLASH"}, "want_lse": False}
    plain = FlexAttentionEngine()
    plain._launch(kernel, q, q, q, _Call(), AttnConfig(), None, (True,))
    assert seen == {"options": None, "want_lse": True}


def test_a_training_call_asks_flash_for_no_lse(flash_engine, monkeypatch):
    """FLASH's backward cannot differentiate through the LSE, and flex's autograd gives it a gradient slot whenever
    the LSE is an output: a training call leaves it out; inference keeps it."""
    asked = []

    def run(q, k, v, aux, cfg, want_lse=True):
        asked.append(want_lse)
        return q, (None if not want_lse else torch.zeros(1))

    monkeypatch.setattr(flash_engine, "_run", run)
    q = torch.randn(1, 16, 2, 64, requires_grad=True)
    out, lse, _ = flash_engine(q, q, q, None, AttnConfig(qkv_format="bshd", attn_mask_type="arbitrary"))
    assert asked == [False] and lse is None
    with torch.no_grad():
        flash_engine(q, q, q, None, AttnConfig(qkv_format="bshd", attn_mask_type="arbitrary"))
    assert asked[-1] is True


def test_the_flash_lse_is_put_back_in_natural_log_where_torch_scaled_it_by_ln2(flash_engine, monkeypatch, tmp_path):
    """torch before the fix of pytorch#181645 returned FLASH's LSE times ln(2) (0.693x float32's on the H200)."""
    fixed = tmp_path / "fixed_flex.py"
    fixed.write_text("def _finalize_outputs(out, lse, stats_are_log2):\n    return out, lse\n")
    spec = importlib.util.spec_from_file_location("fixed_flex", fixed)
    fixed_flex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixed_flex)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert flash_lse_scaled_by_ln2(types.ModuleType("no_source"))
    assert not flash_lse_scaled_by_ln2(fixed_flex)  # a source that holds the fix (stats_are_log2)
    monkeypatch.undo()
    assert not flash_lse_scaled_by_ln2(types.ModuleType("no_source"))  # torch >= 2.13: fixed, whatever the source
    q, k, v = (torch.randn(10, 1, 2, 16) for _ in range(3))  # eager flex on the CPU: a natural-log LSE
    aux = AttnAux()
    cfg = AttnConfig(qkv_format="sbhd", attn_mask_type="causal", window_size=(-1, 0), softmax_scale=0.25)
    with torch.no_grad():
        out, lse = FlexAttentionEngine()._run(q, k, v, aux, cfg)
        flash_engine._lse_scaled_by_ln2 = False
        assert torch.equal(flash_engine._run(q, k, v, aux, cfg)[1], lse)
        flash_engine._lse_scaled_by_ln2 = True
        torch.testing.assert_close(flash_engine._run(q, k, v, aux, cfg)[1] * math.log(2.0), lse)


@pytest.mark.gpu
@pytest.mark.parametrize("gqa", [1, 2])
def test_flash_trains_a_prefix_lm_mask_through_the_module(gqa):
    """Forced onto flex_attention:flash_attn_4, a training step with a bool prefix-LM mask: output and gradients
    against the unfused engine in float32 on the same inputs."""
    pytest.importorskip("flash_attn.cute")
    from attn_dispatch import DotProductAttention

    b, s, h, d, prefix = 2, 1024, 8, 128, 256
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for n in (h, h // gqa, h // gqa))
    i = torch.arange(s, device="cuda")
    masked = (i[None, :] > i[:, None]) & (i[None, :] >= prefix)  # True: masked out (causal after the prefix)
    mask = masked.expand(b, 1, s, s)
    dout = torch.randn(b, s, h * d, device="cuda", dtype=torch.bfloat16, generator=gen)
    results = {}
    for backend, dtype in (("flex_attention:flash_attn_4", torch.bfloat16), ("unfused", torch.float32)):
        module = DotProductAttention(h, d, num_gqa_groups=h // gqa, qkv_format="bshd", attn_mask_type="arbitrary",
                                     backend=backend)
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = module(*leaves, attention_mask=mask)
        out.backward(dout.to(dtype))
        results[backend] = [out.detach().float()] + [t.grad.float() for t in leaves]
    for name, got, want in zip(("out", "dq", "dk", "dv"), results["flex_attention:flash_attn_4"], results["unfused"]):
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 2e-2, f"{name}: relative error {rel:.3g} against float32 unfused"
