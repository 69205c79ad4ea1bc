"""Padding patterns in the SDPA function's bool masks (attn_dispatch.mask_patterns): right/left padded keys, with
or without a causal diagonal (top-left or bottom-right), GQA, broadcast and per-head masks, fully masked rows,
sq != skv. Each recognised call must equal torch's SDPA in float64 on every row (outputs and gradients), and run
as the Transformer Engine mask type and lengths the pattern means (the Decision says which)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_dispatch import AttentionParams, EnvFlags, Platform, explain_sdpa, scaled_dot_product_attention
from attn_dispatch.constraints import TABLES
from attn_dispatch.mask_patterns import NotRecognised, recognise_padding

KINDS = ("keys", "top_left", "bottom_right")


def tensors(b, h, hkv, sq, skv, d, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    return mk(b, h, sq, d), mk(b, hkv, skv, d), mk(b, hkv, skv, d), torch.randn(b, h, sq, d, generator=g,
                                                                                dtype=torch.float64)


def padding_mask(kind: str, ranges: list[tuple[int, int]], sq: int, skv: int, window: int | None = None
                 ) -> torch.Tensor:
    """[b, 1, sq, skv], True = take part: keys [start, end) of each batch element, cut by the diagonal and, with a
    window, to the `window` keys before it (transformers' sliding window is window + 1 keys, the query's own)."""
    j = torch.arange(skv).view(1, skv)
    i = torch.arange(sq).view(sq, 1)
    rows = []
    for start, end in ranges:
        keep = (j >= start) & (j < end)
        diagonal = {"top_left": i, "bottom_right": i + skv - sq}.get(kind)
        if diagonal is not None:
            keep = keep & (j <= diagonal)
            if window is not None:
                keep = keep & (j >= diagonal - window)
        rows.append(keep.expand(sq, skv))
    return torch.stack(rows)[:, None]


def check(q, k, v, dout, mask, gqa):
    ours = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)
    grads = torch.autograd.grad(ours, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"d{name}")


def lengths(decision, side: str) -> list[int]:
    """Sequence lengths of a recognised call, from the Decision's note (what the engine was given)."""
    note = next(n for n in decision.notes if "recognised" in n)
    text = note.split(f"{side} lengths ")[1]
    return [int(x) for x in text[1:text.index("]")].split(",")]


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), hkv=st.sampled_from([1, 2]), groups=st.sampled_from([1, 3]), sq=st.integers(1, 9),
       extra=st.sampled_from([0, 0, 1, 4]), kind=st.sampled_from(KINDS),
       side=st.sampled_from(["right", "left", "mixed"]), broadcast=st.booleans(), per_head=st.booleans(),
       window=st.sampled_from([None, None, 0, 2]), data=st.data(), seed=st.integers(0, 10_000))
def test_recognised_padding_equals_torch_sdpa_on_every_row(b, hkv, groups, sq, extra, kind, side, broadcast, per_head,
                                                            window, data, seed):
    skv = sq + extra if data.draw(st.booleans()) else max(1, sq - extra)
    ranges = []
    for i in range(1 if broadcast else b):
        cut = data.draw(st.integers(0, skv - 1))
        pick = side if side != "mixed" else ("right", "left")[i % 2]
        ranges.append((0, skv - cut) if pick == "right" else (cut, skv))
    mask = padding_mask(kind, ranges, sq, skv, window)
    if broadcast:
        mask = mask[:1] if data.draw(st.booleans()) else mask[:1].expand(b, -1, -1, -1)  # as transformers expands
    h = hkv * groups
    if per_head:
        mask = mask.expand(-1, h, -1, -1).contiguous()
    q, k, v, dout = tensors(b, h, hkv, sq, skv, 8, seed)
    decision = explain_sdpa(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
    # recognition may leave such masks to 'arbitrary'; exact anyway
    some_row_sees_nothing_at_all = not mask.any(-1).all()
    expressible = kind != "bottom_right" or side == "left" or sq >= skv
    if expressible and not some_row_sees_nothing_at_all:
        assert decision.params["attn_mask_type"] != "arbitrary", decision.notes
    check(q, k, v, dout, mask, groups > 1)


def test_sliding_windows_are_recognised_with_and_without_padding():
    """transformers' sliding-window layers (Mistral, Gemma 2/3): causal and a window, padded or not."""
    q, k, v, dout = tensors(3, 4, 2, 10, 10, 8, seed=11)
    plain = padding_mask("top_left", [(0, 10)], 10, 10, window=3).expand(3, -1, -1, -1)
    d = explain_sdpa(q, k, v, attn_mask=plain, enable_gqa=True)
    assert (d.params["attn_mask_type"], tuple(d.params["window_size"])) == ("causal", (3, 0))
    check(q, k, v, dout, plain, True)
    right = padding_mask("top_left", [(0, 10), (0, 6), (0, 2)], 10, 10, window=3)
    d = explain_sdpa(q, k, v, attn_mask=right, enable_gqa=True)
    assert (d.params["attn_mask_type"], d.params["qkv_format"]) == ("padding_causal", "bshd")
    # rows past a sequence's last key + 3 see nothing through the window: they leave the sequence (0, as SDPA's)
    assert lengths(d, "query") == [10, 9, 5] and lengths(d, "key") == [10, 6, 2]
    check(q, k, v, dout, right, True)
    left = padding_mask("top_left", [(0, 10), (4, 10), (7, 10)], 10, 10, window=3)
    d = explain_sdpa(q, k, v, attn_mask=left, enable_gqa=True)
    assert (d.params["attn_mask_type"], d.params["qkv_format"]) == ("padding_causal", "thd")
    check(q, k, v, dout, left, True)


def test_right_padded_causal_batch_runs_as_padding_causal_with_every_query_row():
    """An HF decoder training batch: row i sees j <= i and j < len, so padded rows see every real key."""
    q, k, v, dout = tensors(3, 4, 2, 8, 8, 8, seed=1)
    mask = padding_mask("top_left", [(0, 8), (0, 5), (0, 3)], 8, 8)
    d = explain_sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    assert (d.params["attn_mask_type"], d.params["qkv_format"]) == ("padding_causal", "bshd")
    assert d.params["seqlens_differ"] and lengths(d, "query") == [8, 8, 8] and lengths(d, "key") == [8, 5, 3]
    check(q, k, v, dout, mask, True)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert out[2, :, 3:].abs().min() > 0  # padded rows attend to the real keys, as SDPA's do


def test_key_padding_without_causality_is_padding_and_a_decode_step_too():
    q, k, v, dout = tensors(2, 2, 2, 6, 6, 8, seed=2)
    keep = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    d = explain_sdpa(q, k, v, attn_mask=keep[:, None, None, :])
    assert (d.params["attn_mask_type"], d.params["qkv_format"]) == ("padding", "bshd")
    assert lengths(d, "query") == [6, 6] and lengths(d, "key") == [4, 6] and d.params["seqlens_differ"]
    check(q, k, v, dout, keep[:, None, None, :], False)
    # a decode step over a left-padded cache: one query, keys from each sequence's first real token
    q1, k1, v1, dout1 = tensors(2, 4, 2, 1, 9, 8, seed=3)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, :4] = False
    mask = keep[:, None, None, :]
    d = explain_sdpa(q1, k1, v1, attn_mask=mask, enable_gqa=True)
    assert (d.params["attn_mask_type"], d.params["qkv_format"]) == ("padding", "thd")
    assert lengths(d, "query") == [1, 1] and lengths(d, "key") == [9, 5] and d.params["pad_between_seqs"]
    check(q1, k1, v1, dout1, mask, True)
    keep = keep.flip(0)  # only the first sequence padded: from its first real key on, the rows are back to back
    d = explain_sdpa(q1, k1, v1, attn_mask=keep[:, None, None, :], enable_gqa=True)
    assert lengths(d, "key") == [5, 9] and not d.params["pad_between_seqs"]
    check(q1, k1, v1, dout1, keep[:, None, None, :], True)


def test_left_padded_causal_prefill_leaves_the_padded_rows_out_and_returns_zero_there():
    """HF generation's prefill: top-left causal over the real tokens, shifted by the padding; rows before the
    first real token see no key (SDPA: 0), and are in no sequence of the thd call."""
    q, k, v, dout = tensors(2, 4, 2, 7, 7, 8, seed=4)
    mask = padding_mask("top_left", [(3, 7), (0, 7)], 7, 7)
    d = explain_sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    assert (d.params["attn_mask_type"], d.params["qkv_format"]) == ("padding_causal", "thd")
    assert lengths(d, "query") == [4, 7] and lengths(d, "key") == [4, 7] and not d.params["seqlens_differ"]
    check(q, k, v, dout, mask, True)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert out[0, :, :3].abs().max() == 0 and out[0, :, 3:].abs().min() > 0


def test_bottom_right_causal_with_left_padding_is_padding_causal_bottom_right():
    """A chunked-prefill / speculative step over a left-padded cache: 3 queries, 9 keys."""
    q, k, v, dout = tensors(2, 2, 1, 3, 9, 8, seed=5)
    mask = padding_mask("bottom_right", [(2, 9), (8, 9)], 3, 9)
    d = explain_sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    assert (d.params["attn_mask_type"], d.params["qkv_format"]) == ("padding_causal_bottom_right", "thd")
    # element 1's only key is the last one: rows 0 and 1 see nothing and are left out
    assert lengths(d, "query") == [3, 1] and lengths(d, "key") == [7, 1]
    check(q, k, v, dout, mask, True)


@pytest.mark.parametrize("change, why", [
    (lambda m: m[1, 0, 4].__setitem__(1, False), "not one range"),       # a hole inside a row's keys
    (lambda m: m[0, 0, :, 0].__setitem__(slice(None), False), None),      # still a pattern: keys from 1
])
def test_masks_that_are_not_padding_patterns_stay_arbitrary_and_say_why(change, why):
    q, k, v, dout = tensors(2, 2, 2, 6, 6, 8, seed=6)
    mask = padding_mask("top_left", [(0, 6), (0, 4)], 6, 6).clone()
    change(mask)
    d = explain_sdpa(q, k, v, attn_mask=mask)
    if why is None:
        assert d.params["attn_mask_type"] == "padding_causal"
    else:
        assert d.params["attn_mask_type"] == "arbitrary" and why in d.notes[0]
    check(q, k, v, dout, mask, False)


def test_unexpressible_patterns_stay_arbitrary_with_the_reason():
    q, k, v, dout = tensors(2, 2, 2, 3, 8, 8, seed=7)
    right_br = padding_mask("bottom_right", [(0, 8), (0, 6)], 3, 8)  # bottom-right diagonal and right padding
    d = explain_sdpa(q, k, v, attn_mask=right_br)
    assert d.params["attn_mask_type"] == "arbitrary" and "right padding" in d.notes[0]
    check(q, k, v, dout, right_br, False)
    per_head = right_br.expand(2, 2, 3, 8).clone()
    per_head[0, 1] = padding_mask("keys", [(0, 8)], 3, 8)[0, 0]
    d = explain_sdpa(q, k, v, attn_mask=per_head)
    assert d.params["attn_mask_type"] == "arbitrary" and "differs between heads" in d.notes[0]
    nothing = padding_mask("keys", [(0, 8), (0, 8)], 3, 8).clone()
    nothing[1] = False
    d = explain_sdpa(q, k, v, attn_mask=nothing)
    assert d.params["attn_mask_type"] == "arbitrary" and "no key at all" in d.notes[0]
    check(q, k, v, dout, nothing, False)


def test_a_mask_modified_in_place_is_read_again():
    mask = padding_mask("keys", [(0, 5), (0, 3)], 4, 5).clone()
    first = recognise_padding(mask, mask, 2, 4, 5)
    assert first.cu_seqlens_kv.tolist() == [0, 5, 8]
    assert recognise_padding(mask, mask, 2, 4, 5) is first  # cached on the tensor
    mask[1, 0, :, 1] = False
    assert isinstance(recognise_padding(mask, mask, 2, 4, 5), NotRecognised)


def test_flash_tables_refuse_top_left_causal_when_per_sequence_lengths_differ():
    """What the recognised right-padded causal batch asks for: the flash engines align the diagonal bottom-right,
    so their verdicts say why they are out; cuDNN's is not."""
    params = AttentionParams(dtype="bf16", batch_size=2, num_heads=16, head_dim_qk=128, max_seqlen_q=1024,
                             attn_mask_type="padding_causal", seqlens_differ=True)
    platform, env = Platform.parse("h100-cudnn9,flash-attn=2.8.3,flash-attn-3=3.0.0b1"), EnvFlags.from_environ({})
    for provider in ("flash_attn_2:package", "flash_attn_2:torch", "flash_attn_3:interface", "flash_attn_4:cute"):
        verdict = TABLES[provider].evaluate(params, platform, env)
        reason = next(r for r in verdict.reasons if r.code.endswith("causal_alignment"))
        assert "per sequence" in reason.message and "bottom_right" in reason.fix
        assert TABLES[provider].evaluate(params.replace(seqlens_differ=False), platform, env).eligible
    assert TABLES["cudnn_fused:frontend"].evaluate(params, platform, env).eligible
