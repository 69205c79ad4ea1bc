"""Greedy generation through attn_implementation="attn_dispatch" on a left-padded batch with the decode steps on the
engine a GPU picks for them (mem_efficient:torch, the mask as given: its op's contract registered for the CPU, as
tests/test_mem_efficient_engine.py does, standing in for the CPU's pick), against eager in float32: every step's
logits and the tokens. A decode step reads nothing back to the host, copies no keys or values (the query heads of a
group fold into query rows), and dispatches the same few ops on every layer after the first of its step."""
from __future__ import annotations

import collections
import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from attn_dispatch import backends, sdpa, tensor_cache  # noqa: E402
from attn_dispatch.backends.base import Engine  # noqa: E402
from attn_dispatch.backends.mem_efficient import MemEfficientEngine  # noqa: E402
from attn_dispatch.inputs import DECODE_KV_STEP  # noqa: E402
from attn_dispatch.integrations import transformers as glue  # noqa: E402
from tests.test_mem_efficient_engine import _op_backward, _op_forward  # noqa: E402

CPU_PICK = "unfused:pytorch"
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy")


class DecodeOnMemEfficient(Engine):
    """One-query calls on mem_efficient:torch's glue, the prefill on the CPU's own engine."""

    family, provider = "unfused", "pytorch"

    def __init__(self, own: Engine):
        self.own, self.decode, self.decode_calls = own, MemEfficientEngine(), 0

    def __call__(self, q, k, v, aux, cfg, *, flatten_heads: bool = False):
        if aux.max_seqlen_q != 1:
            return self.own(q, k, v, aux, cfg, flatten_heads=flatten_heads)
        assert cfg.attn_mask_type == "arbitrary" and cfg.qkv_format == "bshd", cfg
        self.decode_calls += 1
        return self.decode(q, k, v, aux, cfg, flatten_heads=flatten_heads)

    def bind_fast(self, q, k, v, aux, cfg, layout: str = "merged"):
        """mem_efficient:torch's bound call for the repeats of a decode step's masked call (the other layers)."""
        bound = self.decode.bind_fast(q, k, v, aux, cfg, layout) if aux.max_seqlen_q == 1 else None
        if bound is None:
            return None

        def counted(q, k, v):
            self.decode_calls += 1
            return bound(q, k, v)
        return counted

    def bind_masked(self, q, k, v, aux, cfg):
        """mem_efficient:torch's bound call, the mask an argument: the other layers of a decode step and the next
        steps."""
        bound = self.decode.bind_masked(q, k, v, aux, cfg) if aux.max_seqlen_q == 1 else None
        if bound is None:
            return None

        def counted(q, k, v, mask):
            self.decode_calls += 1
            return bound(q, k, v, mask)
        return counted


@pytest.fixture
def decode_on_mem_efficient():
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_efficient_attention", _op_forward, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention_backward", _op_backward, "CPU")
    own = backends.get_engine(CPU_PICK)
    engine = backends._INSTANCES[CPU_PICK] = DecodeOnMemEfficient(own)
    glue.register()
    sdpa._MODULES.clear()
    glue._DECODE_READING.clear()
    tensor_cache.clear()
    yield engine
    backends._INSTANCES[CPU_PICK] = own
    sdpa._MODULES.clear()
    glue._DECODE_READING.clear()
    del lib


def tiny_llama(layers: int = 3):
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256)
    config.eos_token_id = None
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float().eval()


def left_padded(b: int = 4, s: int = 9):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 97, (b, s), generator=g)
    keep = torch.ones(b, s, dtype=torch.long)
    for row in range(b):
        keep[row, : 2 * row] = 0
    return ids.masked_fill(keep == 0, 0), keep


def generate(model, impl: str, ids, keep, new: int = 8):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=keep, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)


def test_left_padded_generation_matches_eager(decode_on_mem_efficient):
    model = tiny_llama()
    ids, keep = left_padded()
    eager = generate(model, "eager", ids, keep)
    ours = generate(model, "attn_dispatch", ids, keep)
    assert decode_on_mem_efficient.decode_calls == 7 * 3  # 7 decode steps (the first token is the prefill's)
    assert torch.equal(ours.sequences, eager.sequences)
    for step, (got, want) in enumerate(zip(ours.logits, eager.logits)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"step {step}")
    used = {m.last_decision.chosen for m in sdpa._MODULES.values() if m.last_decision is not None
            and m.last_decision.params["max_seqlen_q"] == 1}
    assert used == {CPU_PICK}


def padded_batch(pads: tuple[int, ...], s: int, seed: int):
    """Prompts of s tokens, row i left-padded by pads[i]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (len(pads), s), generator=g)
    keep = torch.ones(len(pads), s, dtype=torch.long)
    for row, pad in enumerate(pads):
        keep[row, :pad] = 0
    return ids.masked_fill(keep == 0, 0), keep


@pytest.fixture
def planned_decode_calls(monkeypatch):
    """Decode calls (one query) that took the planning path rather than a bound call."""
    from attn_dispatch import DotProductAttention

    planned = []
    through = DotProductAttention._attend_unmerged

    def counting(self, q, *args, **kwargs):
        if q.shape[1] == 1:  # bshd views: one query
            planned.append(1)
        return through(self, q, *args, **kwargs)
    monkeypatch.setattr(DotProductAttention, "_attend_unmerged", counting)
    return planned


def test_decode_across_a_key_length_bucket_and_a_new_batch_match_eager(decode_on_mem_efficient,
                                                                        planned_decode_calls):
    """float32, against eager: greedy decode steps whose cache grows past DECODE_KV_STEP keys (steps up to it are
    decided for their own length and plan; past it, the first step of the bucket plans and binds, the later ones
    run the bound call with their new masks), then a new batch of other paddings and lengths whose steps all fall in
    that bucket: they run the same binding on their own masks, planning nothing. Every step's logits and the tokens
    as eager's."""
    model = tiny_llama()  # eager's softmax runs in float32 (a float64 model's padded rows come out NaN there)
    new = 12
    # the first batch's steps over 125 .. 135 keys: 4 up to the bound, 7 past it; the second's over 131 .. 141
    for n, (s, pads, plans) in enumerate(((DECODE_KV_STEP - 4, (0, 3, 17, 40), 5),
                                          (DECODE_KV_STEP + 2, (66, 17, 0, 3), 0))):
        ids, keep = padded_batch(pads, s, seed=7 + n)
        eager = generate(model, "eager", ids, keep, new)
        before = len(planned_decode_calls)
        ours = generate(model, "attn_dispatch", ids, keep, new)
        assert torch.equal(ours.sequences, eager.sequences)
        for step, (got, want) in enumerate(zip(ours.logits, eager.logits)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"batch {n} step {step}")
        assert len(planned_decode_calls) - before == plans
    assert decode_on_mem_efficient.decode_calls == 2 * (new - 1) * 3


def decode_loop(model, impl: str, ids, keep, steps: int, rewrite=None):
    """Greedy steps through the model's own KV cache, one token a step; rewrite(step, keep) may change the padding
    mask a step passes (another pattern, same shape). Returns every step's last logits."""
    model.set_attn_implementation(impl)
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=keep, use_cache=True)
        for step in range(steps):
            logits.append(out.logits[:, -1])
            keep = torch.cat([keep, keep.new_ones(keep.shape[0], 1)], 1)
            if rewrite is not None:
                keep = rewrite(step, keep)
            out = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=keep, cache=out.cache,
                        use_cache=True)
    return logits + [out.logits[:, -1]]


def test_a_padding_pattern_changed_mid_generation_is_read_not_served_stale(decode_on_mem_efficient,
                                                                            planned_decode_calls):
    """Mid-generation, the padding mask changes (for two steps row 0 drops four keys of its prompt and row 2 ten,
    then row 0 takes its keys back): the steps run the bound call (no planning past the bucket's first step) and
    each step's bias is its own mask's, so the logits follow eager's, and differ from a generation whose mask did
    not change. (Only real tokens are dropped or taken back: a padded position's keys are each engine's own.)"""
    model = tiny_llama()
    ids, keep = padded_batch((0, 3, 9, 1), DECODE_KV_STEP + 2, seed=11)

    def rewrite(step, keep):
        if step >= 3:
            keep = keep.clone()
            keep[2, 20:30] = 0
            if step < 5:
                keep[0, 5:9] = 0
        return keep

    eager = decode_loop(model, "eager", ids, keep, 8, rewrite)
    ours = decode_loop(model, "attn_dispatch", ids, keep, 8, rewrite)
    assert len(planned_decode_calls) == 1  # the bucket's first step; every later step and layer ran bound
    for step, (got, want) in enumerate(zip(ours, eager)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    unchanged = decode_loop(model, "attn_dispatch", ids, keep, 8)
    assert torch.equal(unchanged[3], ours[3])  # the mask changes from the fifth step's on
    assert not torch.allclose(unchanged[4][0], ours[4][0]) and not torch.allclose(unchanged[4][2], ours[4][2])
    assert torch.equal(unchanged[4][1], ours[4][1])


class _Dispatched(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[list[tuple[str, tuple]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.calls:
            self.calls[-1].append((str(func.overloadpacket), tuple(out.shape) if isinstance(out, torch.Tensor)
                                   else None))
        return out


def test_decode_steps_read_nothing_back_and_copy_no_keys(decode_on_mem_efficient, monkeypatch):
    layers = 3
    model = tiny_llama(layers)
    ids, keep = left_padded()
    generate(model, "attn_dispatch", ids, keep, new=3)  # plans and the reading of decode masks made
    reads = collections.Counter()
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counting(*args, _original=original, _name=name, **kwargs):
            reads[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counting)
    ops = _Dispatched()
    attention = glue.attention_forward

    def watched(module, query, key, value, attention_mask, **kwargs):
        if query.shape[2] != 1:
            return attention(module, query, key, value, attention_mask, **kwargs)
        ops.calls.append([])
        before = sum(reads.values())
        with ops:
            out = attention(module, query, key, value, attention_mask, **kwargs)
        assert sum(reads.values()) == before, reads
        kv = key.shape
        repeated = [(op, shape) for op, shape in ops.calls[-1]
                    if shape is not None and len(shape) == 4 and shape[2] == kv[2] and shape[1] == query.shape[1]]
        assert not repeated, repeated  # nothing of the keys' length with the query's heads: no repeat
        return out

    transformers.AttentionInterface.register("attn_dispatch_watched", watched)
    transformers.AttentionMaskInterface.register("attn_dispatch_watched", transformers.masking_utils.sdpa_mask)
    generate(model, "attn_dispatch_watched", ids, keep, new=5)
    assert len(ops.calls) == 4 * layers
    for step in range(4):  # after a step's first layer (its mask's bias), every layer dispatches the same ops
        later = [[op for op, _ in ops.calls[step * layers + i]] for i in range(1, layers)]
        assert all(names == later[0] for names in later), later
        assert later[0].count("aten._scaled_dot_product_efficient_attention") == 1
        assert len(later[0]) <= 16, later[0]


def test_layers_and_steps_run_the_bound_call(decode_on_mem_efficient, monkeypatch):
    """The SDPA function's first masked inference call plans, binds mem_efficient's call with the mask an argument
    and runs it; the other layers of its step, the same mask written in place, keys of other strides, and a new mask
    (another padding pattern) of the same shapes run the bound call with no planning, each on its own mask's bias.
    Gradients plan (never bound) and leave the binding as it was; keys laid out otherwise and a key length outside
    the plan's range plan. A
    dead mask lets go of its call, not of the binding. Every output against the float64 reference (a row with no
    key: 0), and the module's decision is the one explain_sdpa describes."""
    from attn_dispatch import DotProductAttention
    from tests.reference import reference_attention

    planned = []
    through = DotProductAttention._attend_unmerged
    monkeypatch.setattr(DotProductAttention, "_attend_unmerged",
                        lambda self, *a, **kw: (planned.append(1), through(self, *a, **kw))[1])
    b, h, hk, d, skv = 3, 8, 2, 16, 21
    gen = torch.Generator().manual_seed(11)

    def padded(skv: int):
        keep = torch.rand(b, 1, 1, skv, generator=gen) > 0.3
        keep[0, ..., :4] = False  # left padding
        keep[2] = False  # a row with no key
        return keep

    def layer(mask, grad=False, strided_keys=False):
        n = mask.shape[-1]
        q = torch.randn(b, 1, h, d, generator=gen, dtype=torch.float64).transpose(1, 2)  # a projection's view
        k, v = (torch.randn(b, hk, n, d, generator=gen, dtype=torch.float64) for _ in range(2))
        if strided_keys:
            k = torch.randn(b, n, hk, d, generator=gen, dtype=torch.float64).transpose(1, 2)
        q.requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out = sdpa.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, recognize_masks=False)
        want, _ = reference_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask_type="arbitrary",
                                      attention_mask=~mask)
        torch.testing.assert_close(out.transpose(1, 2).detach(), want)
        assert out.requires_grad == grad
        return q, k, v

    keep = padded(skv)
    for _ in range(4):  # four layers of one step
        q, k, v = layer(keep)
    assert len(planned) == 1 and decode_on_mem_efficient.decode_calls == 4
    module = next(m for m in sdpa._MODULES.values() if m.last_decision is not None)
    decision = sdpa.explain_sdpa(q, k, v, keep, enable_gqa=True, recognize_masks=False)
    assert (module.last_decision.chosen, module.last_decision.params) == (decision.chosen, decision.params)
    binding = module._plans.bhsd_masked[1]
    keep[1, ..., -1] = ~keep[1, ..., -1]  # written in place: its new bias
    layer(keep)
    layer(keep)
    other = padded(skv)
    other[0] = True  # another batch: no padding in the first row
    layer(other)
    layer(other)
    assert len(planned) == 1 and decode_on_mem_efficient.decode_calls == 8
    layer(other, grad=True)  # gradients: planned, never bound
    layer(other, grad=True)
    assert len(planned) == 3 and module._plans.bhsd_masked[1] is binding
    layer(keep)
    assert len(planned) == 3
    layer(keep, strided_keys=True)  # keys laid out otherwise: planned and bound for them
    assert len(planned) == 4 and module._plans.bhsd_masked[1] is not binding
    layer(keep)
    longer = padded(skv + 1)
    layer(longer)  # another key length, here (no more than 128 keys) decided for itself: planned
    assert len(planned) == 6
    binding = module._plans.bhsd_masked[1]
    assert module._plans.bhsd_masked[2].attention_mask.shape[-1] == skv + 1
    del longer
    gc.collect()
    assert module._plans.bhsd_masked[2] is None  # the dead mask's call went (what the engine kept on it with it)
    assert module._plans.bhsd_masked[1] is binding
