"""The BlockMask that flex_attention:torch builds from sequence bounds (padded and packed frames, causal either
alignment, sliding windows) holds the same partial and full blocks as create_block_mask evaluating the call's mask_mod
on every pair; the call reads nothing back to the host (it runs on fake tensors, whose contents are unknown)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.nn.attention import flex_attention as flex

from attn_dispatch.backends import _flex_masks
from attn_dispatch.backends.base import AttnAux, AttnConfig
from attn_dispatch.backends.flex_attention import plan
from attn_dispatch.params import normalize_window

CPU = torch.device("cpu")
BLOCK = _flex_masks.BLOCK


def _cfg(fmt: str, mask_type: str, window) -> AttnConfig:
    return AttnConfig(qkv_format=fmt, attn_mask_type=mask_type, window_size=normalize_window(window, mask_type))


def _dense(num: torch.Tensor, idx: torch.Tensor, nk: int) -> torch.Tensor:
    """[B, H, nq, nk] bool: the blocks a (num_blocks, indices) pair lists."""
    num, idx = num.cpu(), idx.cpu()
    listed = torch.arange(idx.shape[-1]) < num.unsqueeze(-1)
    return torch.zeros(*idx.shape[:-1], nk, dtype=torch.bool).scatter_(-1, idx.long(), listed)


def _assert_same_blocks(aux: AttnAux, cfg: AttnConfig, b: int, sq: int, skv: int, device=CPU) -> None:
    frame = _flex_masks.frame_for(aux, cfg, sq, skv)
    mask_mod = _flex_masks.mask_mod_for(frame, cfg, None, None)
    rows = b if frame.kind == "padded" else 1
    want = flex.create_block_mask(mask_mod, rows, 1, sq, skv, device=device, BLOCK_SIZE=BLOCK)
    got = _flex_masks._from_bounds(flex, frame, tuple(cfg.window_size), sq, skv, torch.device(device)).block_mask
    nq, nk = -(-sq // BLOCK), -(-skv // BLOCK)
    for kind in ("", "full_"):
        for side, cols in (("kv", nk), ("q", nq)):
            num, idx = f"{kind}{side}_num_blocks", f"{kind}{side}_indices"
            got_map = _dense(getattr(got, num), getattr(got, idx), cols)
            want_map = _dense(getattr(want, num), getattr(want, idx), cols)
            assert got_map.shape == want_map.shape
            assert torch.equal(got_map, want_map), f"{kind or 'partial '}{side} blocks differ:\n" \
                f"{(got_map.int() - want_map.int()).nonzero().tolist()}"
    assert got.seq_lengths == want.seq_lengths == (sq, skv)
    assert torch.equal(got.kv_num_blocks.cpu(), want.kv_num_blocks.cpu())


# (mask type, window): the masks a sequence frame carries; non-causal masks take a right window too
MASKS = st.sampled_from(["padding", "padding_causal", "padding_causal_bottom_right"])
EDGES = st.sampled_from([127, 128, 129, 255, 256, 257])  # block edges: where a full block turns partial


def _sizes(low: int, high: int):
    return st.one_of(st.integers(low, high), EDGES)


SIDE = st.one_of(st.just(-1), _sizes(0, 300))


def _window(draw, mask_type):
    if draw(st.booleans()):
        return None
    left = draw(SIDE)
    right = 0 if "causal" in mask_type else draw(SIDE)
    return (left, right)


@st.composite
def packed_calls(draw):
    n = draw(st.integers(1, 4))
    lens_q = draw(st.lists(_sizes(0, 300), min_size=n, max_size=n))
    lens_kv = draw(st.lists(_sizes(0, 300), min_size=n, max_size=n))
    gapped = draw(st.booleans())
    gaps_q = draw(st.lists(_sizes(0, 140), min_size=n, max_size=n)) if gapped else [0] * n
    gaps_kv = draw(st.lists(_sizes(0, 140), min_size=n, max_size=n)) if gapped else [0] * n
    lead = draw(st.integers(0, 140)) if gapped else 0  # tokens before the first sequence belong to none

    def offsets(values, start=0):
        out = [start]
        for v in values:
            out.append(out[-1] + v)
        return torch.tensor(out, dtype=torch.int32)
    cu_q, cu_kv = offsets(lens_q), offsets(lens_kv)
    extra = {}
    if gapped:
        extra = dict(cu_seqlens_q_padded=offsets([a + g for a, g in zip(lens_q, gaps_q)], lead),
                     cu_seqlens_kv_padded=offsets([a + g for a, g in zip(lens_kv, gaps_kv)], lead))
    # tokens past the last sequence belong to none
    tq = int((extra.get("cu_seqlens_q_padded", cu_q))[-1]) + draw(st.integers(0, 200))
    tkv = int((extra.get("cu_seqlens_kv_padded", cu_kv))[-1]) + draw(st.integers(0, 200))
    mask_type = draw(MASKS)
    aux = AttnAux(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=max(lens_q), max_seqlen_kv=max(lens_kv),
                  **extra)
    return aux, _cfg("thd", mask_type, _window(draw, mask_type)), max(tq, 1), max(tkv, 1)


@st.composite
def padded_calls(draw):
    b = draw(st.integers(1, 3))
    sq, skv = draw(_sizes(1, 400)), draw(_sizes(1, 400))
    lens_q = draw(st.lists(st.one_of(st.integers(0, sq), st.just(sq)), min_size=b, max_size=b))
    lens_kv = draw(st.lists(st.one_of(st.integers(0, skv), st.just(skv)), min_size=b, max_size=b))
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_kv = torch.tensor([0] + lens_kv, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    mask_type = draw(MASKS)
    aux = AttnAux(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=sq, max_seqlen_kv=skv)
    return aux, _cfg("bshd", mask_type, _window(draw, mask_type)), b, sq, skv


@st.composite
def banded_calls(draw):
    """No padding: one sequence per row, a causal mask (either alignment) or a window."""
    mask_type = draw(st.sampled_from(["no_mask", "causal", "causal_bottom_right"]))
    window = _window(draw, mask_type)
    if mask_type == "no_mask" and window in (None, (-1, -1)):
        window = (draw(_sizes(0, 300)), draw(SIDE))
    return _cfg("bshd", mask_type, window), draw(_sizes(1, 500)), draw(_sizes(1, 500))


@settings(max_examples=60, deadline=None)
@given(packed_calls())
def test_packed_block_mask_matches_create_block_mask(call):
    aux, cfg, tq, tkv = call
    _assert_same_blocks(aux, cfg, 1, tq, tkv)


@settings(max_examples=30, deadline=None)
@given(padded_calls())
def test_padded_block_mask_matches_create_block_mask(call):
    aux, cfg, b, sq, skv = call
    _assert_same_blocks(aux, cfg, b, sq, skv)


@settings(max_examples=20, deadline=None)
@given(banded_calls())
def test_banded_block_mask_matches_create_block_mask(call):
    cfg, sq, skv = call
    _assert_same_blocks(AttnAux(), cfg, 2, sq, skv)


@pytest.mark.parametrize("mask_type, window", [
    ("causal", (254, 0)), ("causal", (255, 0)), ("causal_bottom_right", (256, 0)), ("causal_bottom_right", (383, 0)),
    ("no_mask", (0, 254)), ("no_mask", (0, 255)), ("no_mask", (127, 128)), ("no_mask", (128, 127)),
])
@pytest.mark.parametrize("sq, skv", [(512, 512), (384, 640), (640, 384)])
def test_a_window_one_key_short_of_a_block_leaves_it_partial(mask_type, window, sq, skv):
    """The least and greatest key - query distance in a block decide whether a window covers all of it."""
    _assert_same_blocks(AttnAux(), _cfg("bshd", mask_type, window), 1, sq, skv)


@pytest.mark.parametrize("fmt, mask_type, window", [("thd", "padding_causal", (300, 0)),
                                                     ("thd", "padding_causal_bottom_right", None),
                                                     ("bshd", "padding", (40, 70))])
def test_the_call_reads_nothing_back_to_the_host(fmt, mask_type, window):
    """On fake tensors (no contents) any .item()/.tolist()/nonzero raises: planning the call never waits for the
    device, however often cu_seqlens change."""
    cu_q = torch.tensor([0, 700, 1500, 2300], dtype=torch.int32)
    cu_kv = torch.tensor([0, 900, 1500, 2600], dtype=torch.int32)
    padded = torch.tensor([0, 800, 1700, 2600], dtype=torch.int32)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor
        extra = dict(cu_seqlens_q_padded=fake(padded), cu_seqlens_kv_padded=fake(padded)) if fmt == "thd" else {}
        aux = AttnAux(cu_seqlens_q=fake(cu_q), cu_seqlens_kv=fake(cu_kv), max_seqlen_q=800, max_seqlen_kv=1100,
                      **extra)
        b, s = (1, 2600) if fmt == "thd" else (3, 1100)
        call = plan(flex, aux, _cfg(fmt, mask_type, window), b, 2, s, s, CPU)
        assert call.block_mask.kv_num_blocks.shape == (b, 1, -(-s // BLOCK))
    with pytest.raises(DataDependentOutputException):  # what a read-back would do
        with FakeTensorMode() as mode:
            mode.from_tensor(cu_q).tolist()


GAPPED = dict(cu_seqlens_q=[0, 1900, 4050, 5750, 7750], cu_seqlens_kv=[0, 1900, 4050, 5750, 7750],
              cu_seqlens_q_padded=[0, 2048, 4258, 6158, 8192], cu_seqlens_kv_padded=[0, 2048, 4258, 6158, 8192])


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type, window", [("padding_causal", None), ("padding_causal_bottom_right", (4095, 0)),
                                                ("padding", (100, 300))])
def test_on_cuda_the_blocks_match_and_the_host_never_waits(mask_type, window):
    """8192 packed tokens in 4 sequences with gaps: the same blocks as create_block_mask on the GPU, and planning a
    call with new cu_seqlens tensors runs under torch's sync debug mode 'error' (a device-to-host wait raises)."""
    tensors = {k: torch.tensor(v, dtype=torch.int32, device="cuda") for k, v in GAPPED.items()}
    cfg = _cfg("thd", mask_type, window)
    _assert_same_blocks(AttnAux(**tensors, max_seqlen_q=2150, max_seqlen_kv=2150), cfg, 1, 8192, 8192, "cuda")
    plan(flex, AttnAux(**tensors, max_seqlen_q=2150, max_seqlen_kv=2150), cfg, 1, 16, 8192, 8192,
         torch.device("cuda"))  # warm: lazy initialisation is not a step's work
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            fresh = {k: t.clone() for k, t in tensors.items()}  # a new step's tensors
            call = plan(flex, AttnAux(**fresh, max_seqlen_q=2150, max_seqlen_kv=2150), cfg, 1, 16, 8192, 8192,
                        torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert call.block_mask.kv_indices.is_cuda
