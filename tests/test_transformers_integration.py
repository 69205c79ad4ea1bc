"""attn_implementation="attn_dispatch" against "sdpa" ("eager" for Gemma 2) on small random-initialised transformers
models (float32, CPU): logits, loss and parameter gradients on padded and packed batches, greedy generation, and the
refusals."""
from __future__ import annotations

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attn_dispatch import sdpa, selection, tensor_cache  # noqa: E402
from attn_dispatch.integrations import transformers as glue  # noqa: E402
from attn_dispatch.integrations.transformers import register  # noqa: E402
from attn_dispatch.params import AttentionParams  # noqa: E402
from attn_dispatch.platform import Platform  # noqa: E402
from attn_dispatch.sdpa import explain_sdpa  # noqa: E402

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, head_dim=16)


def families():
    t = transformers
    return {
        "llama": (t.LlamaConfig(**TINY), t.LlamaForCausalLM),
        "mistral": (t.MistralConfig(**TINY, sliding_window=6), t.MistralForCausalLM),
        "qwen2": (t.Qwen2Config(**TINY), t.Qwen2ForCausalLM),
        "qwen3": (t.Qwen3Config(**TINY), t.Qwen3ForCausalLM),
        "gemma2": (t.Gemma2Config(**TINY, attn_logit_softcapping=None, final_logit_softcapping=None,
                                  sliding_window=6), t.Gemma2ForCausalLM),
        "gemma3": (t.Gemma3TextConfig(**TINY, sliding_window=6), t.Gemma3ForCausalLM),
    }


def build(name: str):
    config, cls = families()[name]
    torch.manual_seed(0)
    return cls(config).float()


def run(model, impl: str, **batch):
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def padded_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (3, 14), generator=g)
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    mask[2, 10:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 5] = -100  # its prediction comes from a padded position, whose output eager and SDPA define differently
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def one_sided_batch(side: str):
    """Every padded row padded on one side: HF's training collators pad right, generation pads left."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 97, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    for row, pad in ((1, 4), (2, 7)):
        if side == "right":
            mask[row, 12 - pad:] = 0
        else:
            mask[row, :pad] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if side == "left":
        labels[1, 4] = labels[2, 7] = -100  # predicted from a padded position (eager and SDPA differ there)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def right_padded_batch():
    return one_sided_batch("right")


def left_padded_batch():
    return one_sided_batch("left")


def packed_batch():
    """What DataCollatorWithFlattening hands a model: one row, position_ids restarting at each sequence."""
    g = torch.Generator().manual_seed(2)
    lens = [5, 7, 4]
    ids = torch.randint(0, 97, (1, sum(lens)), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lens])[None]
    labels = ids.clone()
    labels[0, [0, 5, 12]] = -100
    return dict(input_ids=ids, position_ids=position_ids, labels=labels)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register()


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"])
@pytest.mark.parametrize("batch", [padded_batch, right_padded_batch, left_padded_batch],
                         ids=["padded", "right_padded", "left_padded"])
def test_logits_loss_and_gradients_match_sdpa(name, batch):
    model = build(name)
    data = batch()
    reference = "eager" if name == "gemma2" else "sdpa"  # transformers offers Gemma 2 no SDPA path
    ref_logits, ref_loss, ref_grads = run(model, reference, **data)
    logits, loss, grads = run(model, "attn_dispatch", **data)
    valid = data.get("attention_mask", torch.ones_like(data["input_ids"])).bool()
    torch.testing.assert_close(logits[valid], ref_logits[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) > 5
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-5, msg=n)


@pytest.mark.parametrize("batch", [padded_batch, right_padded_batch, left_padded_batch],
                         ids=["padded", "right_padded", "left_padded"])
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3"])  # the last two: sliding-window layers
def test_padded_batches_reach_padding_mask_types_not_arbitrary(name, batch):
    """transformers' bool masks for a padded batch (sliding windows included) are padding patterns: the fused
    engines' mask types; the same batch unpadded is plain causal."""
    model = build(name)
    data = batch()
    for padded in (True, False):
        sdpa._MODULES.clear()
        run(model, "attn_dispatch", **(data if padded else dict(input_ids=data["input_ids"],
                                                                  labels=data["input_ids"])))
        used = {(m.last_decision.params["attn_mask_type"], tuple(m.last_decision.params["window_size"]))
                for m in sdpa._MODULES.values() if m.last_decision is not None}
        assert used and {mask for mask, _ in used} == {"padding_causal" if padded else "causal"}, used
        if name != "llama":
            assert {window for _, window in used} == {(5, 0)}, used  # sliding_window=6: the query and 5 before


def left_padded_prompts():
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 97, (3, 7), generator=g)
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0
    mask[2, :5] = 0
    return prompt, mask


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3"])
def test_greedy_generation_matches_sdpa_and_eager(name):
    model = build(name).eval()
    prompt, mask = left_padded_prompts()
    outs = []
    sdpa._MODULES.clear()
    for impl in ("eager", "sdpa", "attn_dispatch"):
        model.set_attn_implementation(impl)
        outs.append(model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                   min_new_tokens=20, pad_token_id=0))
    assert outs[0].shape[1] == 27 and torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    if name == "llama":  # on the CPU both readings of a decode step's mask run unfused: the mask stays as given
        last = {m.last_decision.params["attn_mask_type"] for m in sdpa._MODULES.values() if m.last_decision}
        assert last == {"arbitrary"}, last


def decode_step(dtype=torch.bfloat16, batch=8, heads=16, kv_heads=8, prompt=512, step=5):
    """q, k, v and the bool mask transformers hands a decode step over a left-padded cache."""
    skv = prompt + step
    q = torch.zeros(batch, heads, 1, 128, dtype=dtype)
    k = torch.zeros(batch, kv_heads, skv, 128, dtype=dtype)
    mask = torch.ones(batch, 1, 1, skv, dtype=torch.bool)
    for b in range(batch):
        mask[b, ..., :b * prompt // (2 * batch)] = False  # row b left-padded by b/16 of the prompt
    return q, k, k, mask


def on_platform(decision, spec: str):
    """The decision for the same call on a described machine (the call's tensors on its GPU)."""
    params = AttentionParams(**decision.params).replace(device_type="cuda")
    return selection.explain(params, Platform.parse(spec))


@pytest.mark.parametrize("spec, reads_mask", [("h100-cudnn9", False),
                                              ("h100-cudnn9,no-cudnn-frontend,no-flash-attn-4", False),
                                              ("h200-cudnn9,no-cudnn-frontend,no-flash-attn-4", False),
                                              ("h100-cudnn9,torch=2.4.0", True)],
                         ids=["h100_full_stack", "h100_stock_torch", "h200_stock_torch", "h100_torch_2_4"])
def test_decode_steps_over_a_left_padded_cache_run_fused_on_a_gpu(spec, reads_mask):
    """The integration asks selection about both readings of a decode step's mask and reads it as a padding pattern
    only where that pick is better in kind: with torch's memory-efficient kernel (torch >= 2.5) the mask as given
    runs fused, and reading it would cost a host sync per step and copies of the keys and values, so it is not read
    (cuDNN's thd call has a predicted time where the memory-efficient kernel has none: no evidence either way). Where
    only the padding reading reaches a fused engine (torch 2.4: cuDNN), the mask is read. Neither runs unfused."""
    q, k, v, mask = decode_step()
    as_padding = on_platform(explain_sdpa(q, k, v, mask, enable_gqa=True), spec)
    as_given = on_platform(explain_sdpa(q, k, v, mask, enable_gqa=True, recognize_masks=False), spec)
    assert as_padding.params["qkv_format"] == "thd" and as_padding.params["attn_mask_type"] == "padding"
    assert as_given.params["attn_mask_type"] == "arbitrary"
    assert glue.prefer_padding_reading(as_padding, as_given) is reads_mask
    picked = as_padding if reads_mask else as_given
    assert picked.chosen is not None and picked.backend != "unfused", picked.policy_reason
    assert picked.backend == ("cudnn_fused" if reads_mask else "mem_efficient")


def test_preferring_a_reading_ranks_no_engine_then_unfused_then_predicted_time():
    q, k, v, mask = decode_step()
    full, stock = "h100-cudnn9", "h100-cudnn9,no-cudnn-frontend,no-flash-attn-4"
    cudnn = on_platform(explain_sdpa(q, k, v, mask, enable_gqa=True), full)
    flex = on_platform(explain_sdpa(q, k, v, mask, enable_gqa=True), stock)
    mem_efficient = on_platform(explain_sdpa(q, k, v, mask, enable_gqa=True, recognize_masks=False), full)
    unfused = on_platform(explain_sdpa(q, k, v, mask, enable_gqa=True), "h100-cudnn9,no-cudnn-frontend,"
                          "no-flash-attn-4,no-triton")
    nothing = cudnn.model_copy(update={"chosen": None})
    assert unfused.chosen == "unfused:pytorch" and flex.backend == "flex_attention"
    assert cudnn.chosen in cudnn.estimates and mem_efficient.chosen not in mem_efficient.estimates
    assert glue.prefer_padding_reading(flex, unfused) and not glue.prefer_padding_reading(unfused, flex)
    assert glue.prefer_padding_reading(unfused, nothing) and not glue.prefer_padding_reading(nothing, unfused)
    assert not glue.prefer_padding_reading(nothing, nothing)
    # a prediction against none, or none against none: the mask stays as given (reading it has its own costs)
    assert not glue.prefer_padding_reading(cudnn, mem_efficient) and not glue.prefer_padding_reading(flex, flex)
    ms = cudnn.estimates[cudnn.chosen]
    given = mem_efficient.model_copy(update={"estimates": {mem_efficient.chosen: ms * 2}})
    assert glue.prefer_padding_reading(cudnn, given)
    given = mem_efficient.model_copy(update={"estimates": {mem_efficient.chosen: ms}})
    assert not glue.prefer_padding_reading(cudnn, given)  # a tie keeps the mask as given
    slower = cudnn.model_copy(update={"estimates": {cudnn.chosen: ms * 2}})
    assert glue.prefer_padding_reading(cudnn, slower) and not glue.prefer_padding_reading(slower, cudnn)


SYNCING = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy")


def syncs_per_forward(monkeypatch, model, **generate):
    """Host reads of tensor values made by attn_dispatch's code (each one a device sync on a GPU), per forward
    of the model during generate()."""
    counts, active = [], [False]

    def counting(original, name):
        def read(*args, **kwargs):
            if active[0] and any("attn_dispatch" in f.f_code.co_filename for f in _frames(2)):
                counts[-1][name] = counts[-1].get(name, 0) + 1
            return original(*args, **kwargs)
        return read
    for name in SYNCING:
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name), name))
    monkeypatch.setattr(torch, "equal", counting(torch.equal, "equal"))
    forward = model.model.forward

    def counted(*args, **kwargs):
        counts.append({})
        active[0] = True
        try:
            return forward(*args, **kwargs)
        finally:
            active[0] = False
    monkeypatch.setattr(model.model, "forward", counted)
    model.generate(**generate)
    return [sum(c.values()) for c in counts]


def _frames(skip: int):
    frame = sys._getframe(skip)
    while frame is not None:
        yield frame
        frame = frame.f_back


@pytest.mark.parametrize("reading", ["as_given", "as_padding"])
def test_decode_steps_sync_the_host_per_step_not_per_layer(monkeypatch, reading):
    """Each decode step gets a new mask tensor. Given as it is, attn_dispatch reads nothing of it (after the first
    step, where selection is asked about both readings); read as a padding pattern, once per step (the layers share
    the mask tensor, and what is read from it), whatever the number of layers."""
    if reading == "as_padding":
        monkeypatch.setattr(glue, "prefer_padding_reading", lambda as_padding, as_given: True)
    prompt, mask = left_padded_prompts()
    per_layers = {}
    for layers in (2, 4):
        glue._DECODE_READING.clear()
        tensor_cache.clear()  # a cache filled by earlier tests would be emptied mid-step, and read again
        config, cls = families()["llama"]
        config.num_hidden_layers = layers
        torch.manual_seed(0)
        model = cls(config).eval()
        model.set_attn_implementation("attn_dispatch")
        with monkeypatch.context() as patch:
            per_layers[layers] = syncs_per_forward(patch, model, input_ids=prompt, attention_mask=mask,
                                                   max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                                   pad_token_id=0)
    glue._DECODE_READING.clear()
    steps = {layers: counts[2:] for layers, counts in per_layers.items()}  # after the prefill and first decode step
    assert len(steps[2]) == 4 and steps[2] == steps[4], per_layers
    if reading == "as_given":
        assert steps[2] == [0, 0, 0, 0], per_layers
    else:
        assert steps[2] == [1, 1, 1, 1], per_layers


def test_softcapping_runs_and_matches_eager():
    """Gemma 2 with its default attention logit softcapping (50.0): the unfused engine implements it."""
    config, cls = families()["gemma2"]
    config.attn_logit_softcapping = 50.0
    torch.manual_seed(0)
    model = cls(config)
    data = padded_batch()
    ref_logits, ref_loss, ref_grads = run(model, "eager", **data)
    logits, loss, grads = run(model, "attn_dispatch", **data)
    valid = data["attention_mask"].bool()
    torch.testing.assert_close(logits[valid], ref_logits[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-5, msg=n)


@pytest.mark.parametrize("name, how", [(n, "cu_seq_lens") for n in ("llama", "mistral", "qwen2", "qwen3", "gemma2",
                                                                     "gemma3")]
                         + [(n, "position_ids") for n in ("llama", "qwen2", "qwen3")])  # no mask built: positions
def test_a_packed_row_equals_its_sequences_run_apart(name, how):
    """A flattening collator's row: each sequence attends only to itself (thd), so its logits equal those of the
    sequence run on its own with the reference implementation."""
    model = build(name).eval()
    reference = "eager" if name == "gemma2" else "sdpa"
    data = packed_batch()
    ids, position_ids = data["input_ids"], data["position_ids"]
    starts = [0] + [i for i in range(1, ids.shape[1]) if position_ids[0, i] == 0] + [ids.shape[1]]
    model.set_attn_implementation(reference)
    with torch.no_grad():
        apart = torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in zip(starts, starts[1:])], dim=1)
    model.set_attn_implementation("attn_dispatch")
    extra = {}
    if how == "cu_seq_lens":
        cu = torch.tensor(starts, dtype=torch.int32)
        extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(b - a for a, b in zip(starts, starts[1:])),
                     max_length_k=max(b - a for a, b in zip(starts, starts[1:])))
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=position_ids, **extra).logits
    torch.testing.assert_close(packed, apart, rtol=1e-5, atol=1e-5)


def test_register_packed_positions_off_skips_reading_positions():
    """register(packed_positions=False): a batch-1 call with no mask does not read position_ids (a meta tensor
    cannot be read); cu_seq_lens still give a packed row. The default reads them and finds the packed row."""
    q = torch.randn(1, 2, 6, 8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert glue._packed_offsets(q, q, None, {"position_ids": positions}).tolist() == [0, 3, 6]
    glue.register(packed_positions=False)
    try:
        meta = torch.empty(1, 6, dtype=torch.long, device="meta")
        assert glue._packed_offsets(q, q, None, {"position_ids": meta}) is None
        cu = torch.tensor([0, 3, 6], dtype=torch.int32)
        assert glue._packed_offsets(q, q, None, {"cu_seq_lens_q": cu}).tolist() == [0, 3, 6]
        with pytest.raises(ValueError, match="packed_positions='no'"):
            glue.register(packed_positions="no")
    finally:
        glue.register()
    assert glue._READ_POSITIONS[0]
