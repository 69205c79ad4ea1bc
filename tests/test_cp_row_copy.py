"""a2a's memory passes in one pass per direction (context_parallel/_row_copy.py): packing heads into the send region,
assembling whole sequences in natural order from the rows received (a rank's own heads read in place), writing each
rank's tokens back into the rows sent and placing the rows received, against the per-piece copies they replaced (one
torch copy per chunk, SeqOrder.to_whole / write_rows), bit for bit: thd, bshd and sbhd, 2, 4 and 8 ranks, identity and
load-balanced orders, an odd number of heads per group, one and two head groups, both kinds of exchange.

Modes: torch's index ops (what CPU and GPUs without Triton run), the per-piece copies themselves, and the Triton
kernel under Triton's interpreter where it is installed and TRITON_INTERPRET=1 (tests/gpu/test_cp_row_copy_gpu.py
runs it compiled)."""
from __future__ import annotations

import os

import pytest
import torch

from attn_dispatch.context_parallel import _row_copy
from attn_dispatch.context_parallel._row_copy import Move, Rows, Runs, full_runs

from a2a_passes_reference import check_passes
from test_cp_a2a_own_row import _run

INTERPRETED = _row_copy.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="the kernel on CPU needs Triton and TRITON_INTERPRET=1")


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("keeps_own_row", [True, False])
def test_index_ops_equal_the_per_piece_copies(fmt, size, balanced, keeps_own_row):
    check_passes(fmt, size, balanced, 2 if size < 8 else 1, keeps_own_row, 3, torch.float32, "cpu", "torch",
                 seed=size)


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_pieces_mode_is_the_reference(fmt):
    check_passes(fmt, 4, True, 2, True, 1, torch.bfloat16, "cpu", "pieces")


@needs_interpreter
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("size,groups", [(2, 2), (8, 1)])
@pytest.mark.parametrize("keeps_own_row", [True, False])
def test_kernel_equals_the_per_piece_copies(fmt, size, groups, keeps_own_row):
    for dtype, skew in ((torch.bfloat16, 1), (torch.float32, 0)):  # 2-byte units, and 16-byte accesses
        check_passes(fmt, size, fmt != "sbhd", groups, keeps_own_row, 3, dtype, "cpu", "triton", skew=skew)


@pytest.mark.parametrize("fmt,mask", [("bshd", "causal"), ("sbhd", "no_mask")])
@pytest.mark.parametrize("keeps_own_row", [True, False])
def test_a_whole_call_is_bit_for_bit_the_per_piece_path(monkeypatch, fmt, mask, keeps_own_row):
    gen = torch.Generator().manual_seed(11)
    size, groups = 4, 2
    b, s, h, d = 2, 8 * size, 3 * size * groups, 8
    shape = (b, s, h, d) if fmt == "bshd" else (s, b, h, d)
    q, k, v, dout = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
    results = {}
    for mode in ("torch", "pieces"):
        monkeypatch.setenv(_row_copy.COPIES_ENV, mode)
        results[mode] = _run(fmt, mask, size, groups, keeps_own_row, q, k, v, dout)
    for rank in range(size):
        for name, got, want in zip(("out", "dq", "dk", "dv"), results["torch"][rank], results["pieces"][rank]):
            assert torch.equal(got, want), f"rank {rank} {name}"


def test_runs_join_consecutive_tokens_and_index_back():
    whole_of_part = torch.tensor([4, 5, 6, 0, 1, 9, 2, 3])
    runs = Runs.from_index(whole_of_part)
    assert runs.triples == ((0, 4, 3), (3, 0, 2), (5, 9, 1), (6, 2, 2))
    assert torch.equal(runs.index(torch.device("cpu")), whole_of_part)
    assert not runs.full and full_runs(8).full


def test_a_plan_is_made_once_per_geometry():
    def moves(x, into):
        return [Move(Rows.of(x, "bshd"), Rows.of(into, "bshd"), full_runs(x.shape[1]))]

    a, b = torch.randn(2, 6, 3, 4), torch.randn(2, 6, 3, 4)
    plan = _row_copy._plan(moves(a, torch.empty_like(a)))
    assert _row_copy._plan(moves(b, torch.empty_like(b))) is plan  # other tensors, the same geometry
    wider = torch.randn(2, 6, 5, 4)[:, :, :3]
    assert _row_copy._plan(moves(wider, torch.empty_like(a))) is not plan  # other strides
    # a token's heads contiguous on both sides: one row per token, 16-byte multiples (12 floats)
    assert plan.segments[:, 8].tolist() == [1, 1] and plan.segments[:, 9].tolist() == [12, 12]
    assert plan.byte_gcd == 16


def test_rows_of_a_view_name_its_elements():
    x = torch.arange(2 * 5 * 4 * 3, dtype=torch.float32).view(2, 5, 4, 3)  # bshd
    view = x[:, 1:4, 2:]
    rows = Rows.of(view, "bshd")
    assert torch.equal(rows.view(), view)
    assert rows.address() == view.data_ptr()
    sbhd = Rows.of(x.transpose(0, 1), "sbhd")
    assert torch.equal(sbhd.view(), x)
    packed = Rows.packed(x.flatten(), 7, "thd", (3, 2, 5))
    assert torch.equal(packed.view()[0], x.flatten()[7:37].view(3, 2, 5))


def test_an_unknown_copy_mode_is_refused(monkeypatch):
    monkeypatch.setenv(_row_copy.COPIES_ENV, "fast")
    with pytest.raises(ValueError, match="ATTN_DISPATCH_CP_A2A_COPIES='fast'"):
        _row_copy.copy_mode()


def test_the_kernel_is_off_on_cpu():
    assert not _row_copy.triton_ready(torch.device("cpu"))
