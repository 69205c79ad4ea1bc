"""attn_dispatch.integrations.megatron against megatron-core itself, on the CPU.

The core attention is compared with the float64 reference (tests/reference.py) on fresh random inputs, gradients
too; whole GPTs built by megatron-core train 20 steps with it and with a core attention that runs the float64
reference, and their losses must agree to float32 noise: plain, with packed sequences (PackedSeqParams), and with
context parallelism over two gloo ranks set up by Megatron's parallel_state (against one rank's whole sequence).
"""
from __future__ import annotations

import dataclasses
import datetime
import inspect
import math
import os
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

with warnings.catch_warnings():  # megatron-core warns at import that Apex / Transformer Engine are absent
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state, process_groups_config
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention as MegatronDotProductAttention
    from megatron.core.transformer.enums import AttnBackend, AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

from attn_dispatch.integrations.megatron import DispatchedCoreAttention, with_attn_dispatch

from reference import reference_attention
from spawn_ranks import free_port, spawn_ranks, teardown, write_gathered

# megatron-core's own warnings (deprecations, missing Apex / Transformer Engine) are not this test's subject
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:megatron.*"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")]

FP32_TOL = 2e-5
VOCAB, SEQ, STEPS = 64, 32, 20


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    """A world of one gloo rank with Megatron's parallel_state, as a CPU run of Megatron sets it up."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if started:
        dist.destroy_process_group()


def ProcessGroupCollection(**groups):
    """Megatron's collection of a layer's process groups: ProcessGroupCollection (pg_collection) from
    megatron-core 0.15, ModelCommProcessGroups (model_comm_pgs) in 0.13 and 0.14; 0.12 passes none."""
    takes = inspect.signature(MegatronDotProductAttention.__init__).parameters
    for name, keyword in (("ProcessGroupCollection", "pg_collection"), ("ModelCommProcessGroups", "model_comm_pgs")):
        if keyword in takes:
            return getattr(process_groups_config, name)(**groups)
    pytest.skip("this megatron-core passes core attention no process-group collection")


def _config(**overrides) -> TransformerConfig:
    settings = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                    use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                    params_dtype=torch.float32)
    settings.update(overrides)
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    missing = sorted(set(settings) - known)
    if missing:  # a setting an older megatron-core does not have: nothing of it to map
        pytest.skip(f"this megatron-core's TransformerConfig has no {', '.join(missing)}")
    return TransformerConfig(**settings)


def _core(config=None, layer_number=1, mask=AttnMaskType.causal, **kwargs) -> DispatchedCoreAttention:
    return DispatchedCoreAttention(config or _config(), layer_number, mask, "self", **kwargs)


def _qkv(s=12, b=2, h=4, hkv=2, d=8, dv=None, seed=0, fmt="sbhd"):
    g = torch.Generator().manual_seed(seed)
    lead = (s,) if fmt == "thd" else (s, b)
    q = torch.randn(*lead, h, d, generator=g)
    k = torch.randn(*lead, hkv, d, generator=g)
    v = torch.randn(*lead, hkv, dv or d, generator=g)
    return [x.requires_grad_() for x in (q, k, v)]


def _compare(out, ref, inputs, ref_inputs, tol=FP32_TOL):
    """out (float32) against ref (float64, same shape), then the gradients of a random projection of each."""
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * weight).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weight).sum(), ref_inputs)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


def _flat(x):
    return x.reshape(*x.shape[:-2], -1)


# --- the core attention against the float64 reference ----------------------------------------------------------
CASES = {
    "causal-gqa": dict(),
    "causal-window-learnable-sink": dict(config=dict(window_size=(4, 0), softmax_type="learnable")),
    "no_mask-two-sided-window": dict(mask=AttnMaskType.no_mask, config=dict(window_size=(3, 2))),
    "off-by-one-sink": dict(config=dict(softmax_type="off-by-one")),
    "explicit-softmax-scale": dict(core=dict(softmax_scale=0.3)),
    "mla-head-dims": dict(core=dict(k_channels=12, v_channels=8)),
    "arbitrary-mask": dict(mask=AttnMaskType.arbitrary),
    "padding-mask": dict(mask=AttnMaskType.padding),
    "causal-post-scale-bias": dict(bias=True),
    "query-key-layer-scaling": dict(config=dict(apply_query_key_layer_scaling=True), layer=3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_core_attention_matches_float64_reference(name):
    case = CASES[name]
    config = _config(**case.get("config", {}))
    core_kwargs = case.get("core", {})
    mask = case.get("mask", AttnMaskType.causal)
    module = _core(config, case.get("layer", 1), mask, **core_kwargs)
    d = core_kwargs.get("k_channels", 8)
    q, k, v = _qkv(d=d, dv=core_kwargs.get("v_channels"))
    s, b, h = q.shape[0], q.shape[1], q.shape[2]
    scale = core_kwargs.get("softmax_scale") or config.softmax_scale or 1.0 / math.sqrt(d)
    ref_kwargs = dict(qkv_format="sbhd", attn_mask_type=mask.name, window_size=config.window_size,
                      softmax_type=getattr(config, "softmax_type", "vanilla"), softmax_scale=scale)
    attention_mask = bias = None
    inputs = [q, k, v]
    if mask == AttnMaskType.arbitrary:
        attention_mask = torch.rand(b, 1, s, s, generator=torch.Generator().manual_seed(3)) < 0.4
        attention_mask[..., 0] = False  # every query keeps a key
        ref_kwargs["attention_mask"] = attention_mask
    if mask == AttnMaskType.padding:  # the second sequence ends after 7 tokens
        attention_mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
        attention_mask[1, ..., 7:] = True
        ref_kwargs.update(attn_mask_type="padding", cu_seqlens_q=torch.tensor([0, s, s + 7], dtype=torch.int32),
                          cu_seqlens_kv=torch.tensor([0, s, s + 7], dtype=torch.int32))
    if case.get("bias"):
        bias = torch.randn(1, h, s, s, generator=torch.Generator().manual_seed(4)).requires_grad_()
        inputs.append(bias)
        ref_kwargs.update(bias_type="post_scale_bias", bias=bias)
    if module.softmax_offset is not None and module.softmax_type == "learnable":
        inputs.append(module.softmax_offset)
        ref_kwargs["softmax_offset"] = module.softmax_offset
    out = module(q, k, v, attention_mask, attn_mask_type=mask, attention_bias=bias, packed_seq_params=None)
    ref, _ = reference_attention(q, k, v, **ref_kwargs)
    if mask == AttnMaskType.padding:  # padding query rows are not compared (the engines leave them 0)
        out, ref = out[:7], ref[:7]
    _compare(out, _flat(ref), inputs, inputs)


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "packed-with-padding"])
def test_packed_sequences_match_float64_reference(padded):
    """PackedSeqParams -> thd: the causal layer runs each sequence on its own (padding_causal), with the padded
    offsets where the batch has gaps between sequences."""
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    cu_padded = torch.tensor([0, 6, 14, 24], dtype=torch.int32) if padded else None
    t = 24 if padded else 20
    module = _core(_config(softmax_type="learnable"))
    q, k, v = _qkv(s=t, fmt="thd", seed=1)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                             cu_seqlens_kv_padded=cu_padded, max_seqlen_q=8, max_seqlen_kv=8)
    out = module(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    ref, _ = reference_attention(q, k, v, qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu,
                                 cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                                 softmax_type="learnable", softmax_offset=module.softmax_offset)
    assert module.last_decision.params["qkv_format"] == "thd"
    assert module.last_decision.params["attn_mask_type"] == "padding_causal"
    inputs = [q, k, v, module.softmax_offset]
    _compare(out, _flat(ref), inputs, inputs)


def test_tensor_parallel_heads_are_split():
    """With tensor_model_parallel_size=2 each rank holds half the query heads and half the key/value groups."""
    config = _config(tensor_model_parallel_size=2, softmax_type="learnable")
    module = _core(config, pg_collection=ProcessGroupCollection(tp=None, cp=None))
    assert module.softmax_offset.shape == (2,)
    q, k, v = _qkv(h=2, hkv=1)
    out = module(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    ref, _ = reference_attention(q, k, v, qkv_format="sbhd", attn_mask_type="causal", softmax_type="learnable",
                                 softmax_offset=module.softmax_offset)
    _compare(out, _flat(ref), [q, k, v], [q, k, v])
    with pytest.raises(ValueError, match="4-D|heads|num"):
        module(*_qkv(h=4, hkv=2), None, attn_mask_type=AttnMaskType.causal)


def test_window_follows_megatrons_layer_pattern():
    """window_attn_skip_freq=2: layers 1 and 3 have the window, 2 and 4 attend fully (Megatron counts from 1)."""
    config = _config(window_size=(3, 0), window_attn_skip_freq=2, num_layers=4)
    windows = [_core(config, n).sliding_window for n in (1, 2, 3, 4)]
    assert windows == [(3, 0), None, (3, 0), None]
    assert _core(config, 2).window_size == (-1, 0)


def test_constructor_maps_config():
    config = _config(attention_dropout=0.25, num_query_groups=1)
    module = _core(config, layer_number=0)
    assert (module.num_attention_heads, module.num_gqa_groups) == (4, 1)
    assert module.softmax_scale == pytest.approx(1 / math.sqrt(config.kv_channels))
    assert module.attention_dropout == 0.25 and module.layer_number == 1
    assert module.attn_mask_type == "causal" and module.qkv_format == "sbhd" and module.cp_group is None
    assert _core(config, attention_dropout=0.0).attention_dropout == 0.0
    assert _core(config, mask=AttnMaskType.padding_causal).attn_mask_type == "padding_causal"
    assert module.get_rng_state_tracker is None  # Megatron's CUDA tracker holds no states on the CPU


def test_max_logit_for_qk_clip():
    """config.qk_clip: the module returns the output alone and keeps the largest scaled logit per head since
    Megatron last reset current_max_attn_logits."""
    module = _core(_config(qk_clip=True))
    maxima = []
    for seed in (0, 1):
        q, k, v = _qkv(seed=seed)
        out = module(q, k, v, None, attn_mask_type=AttnMaskType.causal)
        assert out.shape == (12, 2, 32)
        scores = torch.einsum("sbhd,tbhd->bhst", q.double(), k.double().repeat_interleave(2, dim=2)) / math.sqrt(8)
        scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
        maxima.append(scores.amax(dim=(0, 2, 3)))
    torch.testing.assert_close(module.current_max_attn_logits.double(), torch.maximum(*maxima), atol=1e-5, rtol=1e-5)


def test_dropout_maps_and_is_reproducible():
    module = _core(_config(attention_dropout=0.5))
    q, k, v = _qkv()
    torch.manual_seed(11)
    first = module(q, k, v, None)
    torch.manual_seed(11)
    again = module(q, k, v, None)
    module.eval()
    plain = module(q, k, v, None)
    ref, _ = reference_attention(q, k, v, qkv_format="sbhd", attn_mask_type="causal")
    torch.testing.assert_close(again, first)
    torch.testing.assert_close(plain.double(), _flat(ref), atol=FP32_TOL, rtol=FP32_TOL)
    assert (first - plain).abs().max() > 0.1  # half the probabilities dropped: far from the plain output


def test_sliding_window_decode_step_is_bottom_right():
    """A single query with no_mask and a window (a decode step) attends to the last keys, as
    TEDotProductAttention makes it."""
    module = _core(_config(window_size=(3, 0)), mask=AttnMaskType.no_mask)
    q, _, _ = _qkv(s=1)
    _, k, v = _qkv(s=10)
    out = module(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)
    ref, _ = reference_attention(q, k, v, qkv_format="sbhd", attn_mask_type="causal_bottom_right",
                                 window_size=(3, 0))
    assert module.last_decision.params["attn_mask_type"] == "causal_bottom_right"
    torch.testing.assert_close(out.double(), _flat(ref), atol=FP32_TOL, rtol=FP32_TOL)


def test_explain_takes_megatrons_arguments():
    module = _core()
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    q, k, v = _qkv(s=12, fmt="thd")
    decision = module.explain(q, k, v, None, attn_mask_type=AttnMaskType.causal,
                              packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu))
    assert (decision.params["qkv_format"], decision.params["attn_mask_type"]) == ("thd", "padding_causal")
    assert decision.chosen is not None


def test_a2a_p2p_takes_megatrons_hierarchical_groups():
    world = dist.group.WORLD
    groups = ProcessGroupCollection(tp=world, cp=world, hcp=[world, world])
    module = _core(_config(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2]),
                   cp_comm_type="a2a+p2p", pg_collection=groups)
    assert module.cp_group == [world, world] and module.cp_global_ranks is None
    assert module.cp_comm_type == "a2a+p2p"


def test_learnable_sinks_enter_megatrons_distributed_checkpoint():
    """The learnable offsets are a ShardedTensor split along heads (tensor parallelism), one per layer; a vanilla
    softmax leaves the core attention nothing to save, as Megatron's own core attention does."""
    learnable = _gpt(_config(softmax_type="learnable"), dispatched=True).sharded_state_dict()
    keys = sorted(k for k in learnable if "core_attention" in k)
    assert keys == [f"decoder.layers.{i}.self_attention.core_attention.softmax_offset" for i in (0, 1)]
    assert tuple(learnable[keys[0]].global_shape) == (2, 4)  # (layers, heads)
    vanilla = _gpt(_config(), dispatched=True).sharded_state_dict()
    assert not [k for k in vanilla if "core_attention" in k]


# --- what cannot be mapped is refused ----------------------------------------------------------------------
def _refused_core(config=None, **kwargs):
    return lambda: _core(_config(**(config or {})), **kwargs)


def _refused_call(packed=None, **call):
    def run():
        module = _core()
        q, k, v = _qkv(s=12, fmt="thd" if packed is not None else "sbhd")
        module(q, k, v, None, packed_seq_params=packed, **call)
    return run


REFUSALS = {
    "unknown-argument": (_refused_core(qkv_layout="bshd"), r"cannot map: \['qkv_layout'\]"),
    "num-splits": (_refused_core(num_splits=2), r"num_splits=2.*pass None"),
    "batch-invariant": (_refused_core(dict(batch_invariant_mode=True, attention_backend=AttnBackend.flash)),
                        r"batch_invariant_mode=True"),
    "local-backend": (_refused_core(dict(attention_backend=AttnBackend.local)), r"attention_backend=AttnBackend.local"),
    "fp8-attention": (_refused_core(dict(fp8="hybrid", fp8_dot_product_attention=True)),
                      r"fp8_dot_product_attention.*attn_dispatch.fp8_autocast"),
    "deterministic-mode": (_refused_core(dict(deterministic_mode=True)),
                           r"deterministic_mode=True.*NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"),
    "one-head-dim": (_refused_core(k_channels=12), r"k_channels=12, v_channels=None"),
    "unknown-cp-comm-type": (_refused_core(dict(context_parallel_size=2), cp_comm_type="ring"),
                             r"cp_comm_type='ring'.*'p2p'"),
    "cp-without-group": (lambda: _core(_config(context_parallel_size=2),
                                       pg_collection=ProcessGroupCollection(tp=None, cp=None)),
                         r"context_parallel_size=2 but there is no context-parallel group"),
    "cp-size-mismatch": (_refused_core(dict(context_parallel_size=2)), r"context_parallel_size=2 but .* 1 ranks"),
    "a2a+p2p-without-hierarchy": (_refused_core(dict(context_parallel_size=2), cp_comm_type="a2a+p2p"),
                                  r"cp_comm_type='a2a\+p2p' needs Megatron's two hierarchical"),
    "unknown-mask-type": (_refused_core(mask="sliding"), r"attn_mask_type='sliding'.*causal"),
    "attention-type": (lambda: DispatchedCoreAttention(_config(), 1, AttnMaskType.causal, "encoder"),
                       r"attention_type='encoder'"),
    "forward-num-splits": (_refused_call(num_splits=4), r"num_splits=4"),
    "packed-bshd": (_refused_call(PackedSeqParams(qkv_format="bshd")), r"qkv_format='bshd'.*'thd'"),
}
if "local_cp_size" in {f.name for f in dataclasses.fields(PackedSeqParams)}:  # megatron-core >= 0.16
    REFUSALS["local-cp-size"] = (_refused_call(PackedSeqParams(qkv_format="thd", local_cp_size=2)),
                                 r"local_cp_size=2 without a cp_group")


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refused_with_reason(name, monkeypatch):
    build, message = REFUSALS[name]
    with pytest.raises(ValueError, match=message):
        build()


def test_old_megatron_core_is_refused(monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(metadata, "version", lambda name: "0.11.0")
    with pytest.raises(ImportError, match=r"megatron-core 0.11.0 is installed.*>= 0\.12"):
        _core()


# --- layer specs ---------------------------------------------------------------------------------------
def _core_attention_of(layer_spec):
    return layer_spec.submodules.self_attention.submodules.core_attention


def test_with_attn_dispatch_swaps_the_local_spec_and_keeps_the_original():
    local = get_gpt_layer_local_spec()
    swapped = with_attn_dispatch(local)
    assert _core_attention_of(swapped) is DispatchedCoreAttention
    assert _core_attention_of(local).__name__ == "DotProductAttention"
    assert with_attn_dispatch(swapped).submodules.self_attention.submodules.core_attention is DispatchedCoreAttention
    assert _core_attention_of(swapped).__module__ == "attn_dispatch.integrations.megatron"


def test_with_attn_dispatch_swaps_transformer_engines_class_by_name():
    """The TE spec names TEDotProductAttention; its ModuleSpec params are kept."""
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=("megatron.core.extensions.transformer_engine", "TEDotProductAttention"), params={"num_splits": None})
    swapped = _core_attention_of(with_attn_dispatch(spec))
    assert swapped.module is DispatchedCoreAttention and swapped.params == {"num_splits": None}


def test_with_attn_dispatch_swaps_every_layer_of_a_block_spec():
    block = get_gpt_decoder_block_spec(_config(num_layers=3), use_transformer_engine=False)
    swapped = with_attn_dispatch(block)
    assert [_core_attention_of(layer) for layer in swapped.layer_specs] == [DispatchedCoreAttention] * 3


def test_with_attn_dispatch_refuses_another_core_attention():
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = torch.nn.Identity
    with pytest.raises(ValueError, match=r"core_attention is torch.nn.modules.linear.Identity; with_attn_dispatch "
                                         r"replaces only"):
        with_attn_dispatch(spec)
    with pytest.raises(ValueError, match="found no core_attention"):
        with_attn_dispatch(ModuleSpec(module=torch.nn.Linear))


# --- GPTs built by megatron-core: 20 training steps against the float64 reference ---------------------------------
class ReferenceCoreAttention(torch.nn.Module):
    """Megatron's core-attention interface computed by the float64 reference: the baseline the GPTs train with."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, model_comm_pgs=None):
        super().__init__()
        self.window = config.window_size
        self.scale = softmax_scale  # Megatron's attention passes config.softmax_scale
        self.softmax_type = getattr(config, "softmax_type", "vanilla")
        if self.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.zeros(config.num_attention_heads))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        kwargs = dict(window_size=self.window, softmax_scale=self.scale, softmax_type=self.softmax_type,
                      softmax_offset=getattr(self, "softmax_offset", None))
        if packed_seq_params is None:
            out, _ = reference_attention(query, key, value, qkv_format="sbhd", attn_mask_type="causal", **kwargs)
        else:
            p = packed_seq_params
            out, _ = reference_attention(query, key, value, qkv_format="thd", attn_mask_type="padding_causal",
                                         cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_kv=p.cu_seqlens_kv,
                                         cu_seqlens_q_padded=p.cu_seqlens_q_padded,
                                         cu_seqlens_kv_padded=p.cu_seqlens_kv_padded, **kwargs)
        return _flat(out).to(query.dtype)


def _gpt(config, dispatched: bool, seq=SEQ) -> GPTModel:
    spec = get_gpt_layer_local_spec()
    if dispatched:
        spec = with_attn_dispatch(spec)
    else:
        spec.submodules.self_attention.submodules.core_attention = ReferenceCoreAttention
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=seq,
                    position_embedding_type="learned_absolute")


def _same_weights(model, source) -> None:
    params = dict(source.named_parameters())
    names = [name for name, _ in model.named_parameters()]
    assert sorted(names) == sorted(params)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])


def _sequences(g: torch.Generator, n: int, length: int) -> torch.Tensor:
    """n token sequences [n, length] that step through the vocabulary by a stride of their own: predicting the
    next token needs the previous ones (attention), so the models learn within 20 steps."""
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    return (start + stride * torch.arange(length)) % VOCAB


def _batch(step: int, b=2, s=SEQ):
    tokens = _sequences(torch.Generator().manual_seed(1000 + step), b, s + 1)
    return tokens[:, :-1], torch.arange(s).expand(b, s), tokens[:, 1:]


def _train(model, batches, reduce=None) -> list[float]:
    """STEPS Adam steps; batches(step) -> (forward args, forward kwargs, loss mask, token count). reduce sums a
    tensor over ranks (context parallelism: the loss's pieces and the gradients)."""
    # eps well above float32 noise: Adam divides each gradient by its own scale, which would blow a
    # parameter's noise-sized gradient (a token seen once) up to a full step and let the runs drift apart
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3, eps=1e-6)
    losses = []
    for step in range(STEPS):
        args, kwargs, mask, count = batches(step)
        loss = (model(*args, **kwargs) * mask).sum() / count
        optimizer.zero_grad()
        loss.backward()
        if reduce is not None:
            for p in model.parameters():
                reduce(p.grad)
            loss = loss.detach().clone()
            reduce(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses


def _plain_batches(step):
    tokens, positions, labels = _batch(step)
    return (tokens, positions, None), dict(labels=labels), torch.ones(labels.shape), labels.numel()


def _assert_same_losses(got, want):
    assert len(got) == len(want) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)
    assert want[-1] < want[0] - 0.15  # the model learned something: the comparison is not of flat curves


@pytest.mark.parametrize("settings", [dict(), dict(window_size=(6, 0), softmax_type="learnable", softmax_scale=0.3)],
                         ids=["causal-gqa", "window-learnable-sink-scale"])
def test_gpt_trains_like_the_reference(settings):
    config = _config(**settings)
    torch.manual_seed(0)
    model = _gpt(config, dispatched=True)
    baseline = _gpt(config, dispatched=False)
    _same_weights(baseline, model)
    _assert_same_losses(_train(model, _plain_batches), _train(baseline, _plain_batches))
    core = model.decoder.layers[0].self_attention.core_attention
    assert core.last_decision.chosen is not None and core.last_decision.params["qkv_format"] == "sbhd"


def _packed_batches(step):
    """Four sequences packed in one row with gaps after three (padded offsets), as a Megatron packed data set
    with padding hands them over; padding tokens carry no loss."""
    lengths, padded_lengths = [9, 23, 5, 20], [10, 26, 8, 20]
    cu = torch.tensor([0, 9, 32, 37, 57], dtype=torch.int32)
    cu_padded = torch.tensor([0, 10, 36, 44, 64], dtype=torch.int32)
    t = 64
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.zeros(1, t, dtype=torch.long)
    labels = torch.zeros(1, t, dtype=torch.long)
    positions = torch.zeros(1, t, dtype=torch.long)
    mask = torch.zeros(1, t)
    for start, n, sequence in zip(cu_padded.tolist(), lengths, _sequences(g, len(lengths), max(lengths) + 1)):
        tokens[0, start:start + n], labels[0, start:start + n] = sequence[:n], sequence[1:n + 1]
        positions[0, start:start + n] = torch.arange(n)
        mask[0, start:start + n] = 1.0
    assert sum(padded_lengths) == t
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                             cu_seqlens_kv_padded=cu_padded, max_seqlen_q=23, max_seqlen_kv=23)
    return (tokens, positions, None), dict(labels=labels, packed_seq_params=params), mask, int(mask.sum())


def test_packed_gpt_trains_like_the_reference():
    config = _config()
    torch.manual_seed(1)
    model = _gpt(config, dispatched=True, seq=64)
    baseline = _gpt(config, dispatched=False, seq=64)
    _same_weights(baseline, model)
    _assert_same_losses(_train(model, _packed_batches), _train(baseline, _packed_batches))
    params = model.decoder.layers[1].self_attention.core_attention.last_decision.params
    assert (params["qkv_format"], params["attn_mask_type"]) == ("thd", "padding_causal")


# --- context parallelism: two gloo ranks through Megatron's parallel_state ------------------------------------
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")
SPAWN_DEADLINE_S = 240


def _cp_worker(rank: int, world: int, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    results: dict = {}
    try:
        from megatron.core.utils import get_batch_on_this_cp_rank

        parallel_state.initialize_model_parallel(context_parallel_size=world)
        group = parallel_state.get_context_parallel_group()

        def reduce(x):
            dist.all_reduce(x, group=group)

        def cp_batches(step):
            tokens, positions, labels = _batch(step)
            shard = _cp_shard(get_batch_on_this_cp_rank, dict(tokens=tokens, positions=positions, labels=labels),
                              world, rank)
            mask = torch.ones(shard["labels"].shape)
            return (shard["tokens"], shard["positions"], None), dict(labels=shard["labels"]), mask, labels.numel()

        torch.manual_seed(2)
        initial = _gpt(_config(), dispatched=False)
        whole = _gpt(_config(), dispatched=False)
        _same_weights(whole, initial)
        results["whole"] = _train(whole, _plain_batches)
        for comm in CP_COMM_TYPES:
            try:
                model = _gpt(_config(context_parallel_size=world, cp_comm_type=comm), dispatched=True)
                _same_weights(model, initial)
                core = model.decoder.layers[0].self_attention.core_attention
                losses = _train(model, cp_batches, reduce)
                results[comm] = dict(losses=losses, cp_comm_type=core.cp_comm_type,
                                     cp_ranks=core.cp_global_ranks,
                                     chosen=str(core.last_decision.chosen),
                                     cp_size=core.last_decision.params["cp_size"])
            except Exception:  # noqa: BLE001 - reported per comm type
                results[comm] = dict(error=traceback.format_exc()[-3000:])
    except Exception:  # noqa: BLE001 - reported to every test
        results["error"] = traceback.format_exc()[-3000:]
    write_gathered(results, world, rank, out_path)
    parallel_state.destroy_model_parallel()
    teardown()


def _cp_shard(megatrons_split, batch: dict, cp_size: int, cp_rank: int) -> dict:
    """This rank's part of each [b, s] tensor by Megatron's get_batch_on_this_cp_rank: chunks r and 2*cp-1-r of
    2*cp (before megatron-core 0.13 it pins memory, which needs CUDA: then the same split, written here)."""
    try:
        return megatrons_split(dict(batch))
    except RuntimeError as exc:
        if "pin_memory" not in str(exc):
            raise
    return {name: torch.cat([x.chunk(2 * cp_size, dim=1)[i] for i in (cp_rank, 2 * cp_size - 1 - cp_rank)], dim=1)
            for name, x in batch.items()}


_CP_RESULTS: list = []


def _cp_results(tmp_path_factory) -> list[dict]:
    """One spawn of two ranks for every comm type (a failed or hung spawn is reported to each test, once)."""
    if not _CP_RESULTS:
        out_path = str(tmp_path_factory.mktemp("megatron_cp") / "results.json")
        _CP_RESULTS.append(spawn_ranks(_cp_worker, (2, free_port(), out_path), 2, out_path,
                                       "megatron context-parallel", SPAWN_DEADLINE_S))
    if isinstance(_CP_RESULTS[0], str):
        pytest.fail(_CP_RESULTS[0])
    return _CP_RESULTS[0]


@pytest.mark.parametrize("comm", CP_COMM_TYPES)
def test_context_parallel_gpt_trains_like_the_whole_sequence(comm, tmp_path_factory):
    """CP=2 through Megatron's parallel_state (its load-balanced shards from get_batch_on_this_cp_rank, gradients
    summed over the CP group as Megatron's DDP does) against one rank training on the whole sequence."""
    per_rank = _cp_results(tmp_path_factory)
    for rank, results in enumerate(per_rank):
        assert "error" not in results, results.get("error")
        got = results[comm]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert (got["cp_comm_type"], got["cp_ranks"], got["cp_size"]) == (comm, [0, 1], 2)
        _assert_same_losses(got["losses"], results["whole"])


# --- on the GPU: Megatron's RNG tracker, its activation recomputation, CUDA graph capture ---------------------
def _seed_megatron(seed: int) -> None:
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)


@pytest.mark.gpu
def test_gpu_dropout_draws_from_megatrons_rng_tracker():
    """Dropout runs inside the tracker's fork (as Megatron's own core attention does): the default CUDA generator
    is left as it was, and the tracker's seed alone decides the mask."""
    from megatron.core import tensor_parallel

    _seed_megatron(123)
    module = _core(_config(attention_dropout=0.3)).cuda()
    assert module.get_rng_state_tracker is tensor_parallel.get_cuda_rng_tracker
    q, k, v = [x.detach().cuda().to(torch.bfloat16) for x in _qkv(s=128)]
    outs = []
    for seed in (123, 123, 124):
        _seed_megatron(seed)
        before = torch.cuda.get_rng_state()
        outs.append(module(q, k, v, None))
        assert torch.equal(torch.cuda.get_rng_state(), before)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def _cuda_gpt(config, seq=256):
    _seed_megatron(5)
    return GPTModel(config, with_attn_dispatch(get_gpt_layer_local_spec()), vocab_size=VOCAB,
                    max_sequence_length=seq, position_embedding_type="learned_absolute").cuda()


@pytest.mark.gpu
def test_gpu_selective_recompute_gives_the_same_gradients():
    """Megatron's selective recomputation ("core_attn") re-runs the core attention in backward under its
    checkpoint's restored RNG states: with dropout on, loss and gradients equal the stored run's."""
    settings = dict(attention_dropout=0.2, use_cpu_initialization=False, num_layers=2)
    stored = _cuda_gpt(_config(**settings))
    recomputed = _cuda_gpt(_config(recompute_granularity="selective", recompute_modules=["core_attn"], **settings))
    _same_weights(recomputed, stored)
    tokens, positions, labels = (x.cuda() for x in _batch(0, s=256))
    grads = []
    for model in (stored, recomputed):
        _seed_megatron(9)
        loss = model(tokens, positions, None, labels=labels).mean()
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-6, rtol=1e-6)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_core_attention_replays_in_a_cuda_graph():
    """Forward and backward captured by torch.cuda.make_graphed_callables (what Megatron's Transformer Engine graph
    path does per layer) replay with the eager result, on new data in the same tensors."""
    module = _core(_config(num_attention_heads=8, num_query_groups=8, hidden_size=512)).cuda()
    sample = [x.detach().cuda().to(torch.bfloat16).requires_grad_() for x in _qkv(s=256, h=8, hkv=8, d=64)]
    graphed = torch.cuda.make_graphed_callables(lambda q, k, v: module(q, k, v, None), tuple(sample))
    fresh = [x.detach().cuda().to(torch.bfloat16).requires_grad_() for x in _qkv(s=256, h=8, hkv=8, d=64, seed=3)]
    out = graphed(*fresh)
    out.float().square().sum().backward()
    got = [out.detach()] + [x.grad for x in fresh]
    eager_inputs = [x.detach().clone().requires_grad_() for x in fresh]
    eager = module(*eager_inputs, None)
    eager.float().square().sum().backward()
    for a, b in zip(got, [eager.detach()] + [x.grad for x in eager_inputs]):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-2)  # backward kernels may accumulate in any order
