"""flash-attn-4's Hopper (sm90) kernels: which tile each head-dim pair gets, and the shared memory that tile needs.

flash-attn-4 4.0.0b36 picks the sm90 tiles from the head dims alone (interface.py `_tile_size_fwd_sm90`,
`_tile_size_bwd_sm90`) and never checks that the kernel's shared storage fits: a pair whose storage exceeds the
227 KiB a block may use compiles, then fails at launch ("launch shared memory exceeds current GPU arch sm_90a
allowed. Allocated: 248832 bytes. Max: 232448 bytes." for head dims (64, 128) in training, on our H100).
This module repeats the tile choice and sums the kernels' SharedStorage structs, so a table can say before launch
which pairs fit. The backward sum reproduces that 248832 exactly, and gives 232448 (a perfect fit) for (128, 128)
non-causal, which trains. It also names the head dims whose sm90 backward returns a wrong dQ
(dq_accumulator_mismatch).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

SM90_MAX_SMEM = 232448  # bytes of dynamic shared memory per block on sm90 (227 KiB), as the launch error quotes
FWD_STAGES = 2          # interface.py builds FlashAttentionForwardSm90(num_stages=2)
BF16_BYTES = 2          # fp16 and bf16 alike
SOURCE = ("flash-attn-4 4.0.0b36 interface.py _tile_size_fwd_sm90/_tile_size_bwd_sm90; flash_fwd_sm90.py and "
          "flash_bwd_sm90.py _get_shared_storage_cls (sO reuses sQ's storage in the forward)")


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class BwdTile:
    m: int
    n: int
    q_stage: int
    do_stage: int
    pds_stage: int
    sdp_swap_ab: bool
    dkv_swap_ab: bool
    atom_m_sdp: int = 1
    atom_n_dkv: int = 2
    num_wg: int = 2

    @property
    def p_in_registers(self) -> bool:
        """mma_dkv_is_rs: P feeds the dV GEMM from registers, so sP takes no shared memory."""
        return (self.atom_m_sdp == 1 and self.atom_n_dkv == self.num_wg and self.sdp_swap_ab
                and not self.dkv_swap_ab)


def bwd_tile(head_dim: int, head_dim_v: int, causal_or_local: bool) -> BwdTile:
    """interface._tile_size_bwd_sm90 (no block sparsity): chosen by head_dim, with head_dim_v only above 128."""
    if head_dim <= 64:
        return BwdTile(128, 128, 2, 2, 2, True, False)
    if head_dim <= 96:
        return BwdTile(64, 128, 2, 2, 2, True, False)
    if head_dim <= 128:
        return BwdTile(64 if causal_or_local else 80, 128, 2, 2, 2, True, False)
    if head_dim <= 192:
        return BwdTile(64, 96, 2, 2 if head_dim_v <= 128 else 1, 1, False, True)
    return BwdTile(64, 48, 2, 1, 1, False, True, atom_n_dkv=1)


def _swizzle_width(elems: int) -> int:
    """Columns of the widest 16-bit smem swizzle atom (128, 64 or 32 bytes a row) whose width divides `elems`
    (cutlass hopper_helpers.get_smem_layout_atom)."""
    bits = elems * 16
    return next((width for width_bits, width in ((1024, 64), (512, 32), (256, 16)) if bits % width_bits == 0), 8)


def bwd_layout_problem(head_dim: int, head_dim_v: int) -> str | None:
    """Why the sm90 backward cannot lay out this head-dim pair (a build-time failure), or None.

    - sdO, (tile_m, head_dim_v), takes the swizzle atom chosen for head_dim_qk (it must also hold dO^T for the dK/dV
      GEMMs: major_mode_size = tile_hdim // wg_d_dKV), so that atom's width must divide the padded head_dim_v;
    - with dK/dV swapped (head_dim_qk > 128) both padded head dims lie on WGMMA's M axis, tiled by 64 per warp group
      along it: 128 with the one-warp-group-wide dK/dV layout of head_dim_qk > 192."""
    t = bwd_tile(head_dim, head_dim_v, False)
    multiple = 64 if t.dkv_swap_ab else 16
    hd, hdv = _round_up(head_dim, multiple), _round_up(head_dim_v, multiple)
    width = _swizzle_width(hd // (t.num_wg // t.atom_n_dkv))
    if hdv % width:
        return (f"its dO tile ({t.m} x {hdv}) uses the {width}-column swizzle chosen for head_dim_qk (padded to {hd}), "
                f"which does not divide {hdv}")
    if t.dkv_swap_ab:
        m_tile = 64 * (t.num_wg // t.atom_n_dkv)
        for name, padded in (("head_dim_qk", hd), ("head_dim_v", hdv)):
            if padded % m_tile:
                return (f"its swapped dK/dV GEMMs put {name} (padded to {padded}) on the WGMMA M axis, tiled by "
                        f"{m_tile}")
    return None


def bwd_smem_bytes(head_dim: int, head_dim_v: int, causal_or_local: bool) -> int:
    """FlashAttentionBackwardSm90's SharedStorageQKV, field by field, with its alignments."""
    t = bwd_tile(head_dim, head_dim_v, causal_or_local)
    multiple = 64 if t.dkv_swap_ab else 16  # swapped dK/dV put head_dim on WGMMA's 64-row M axis
    hd, hdv = _round_up(head_dim, multiple), _round_up(head_dim_v, multiple)
    rows = _round_up(t.m, 64)
    size = (t.q_stage + t.do_stage) * 2 * 8                      # mbarriers (Int64)
    for nbytes, align in (
            (rows * t.q_stage * 4, 128),                         # sLSE (fp32)
            (rows * t.do_stage * 4, 128),                        # sdPsum
            (t.m * hd * t.q_stage * BF16_BYTES, 1024),           # sQ
            (t.n * hdv * BF16_BYTES, 1024),                      # sV
            (t.n * hd * BF16_BYTES, 1024),                       # sK
            (t.m * hdv * t.do_stage * BF16_BYTES, 1024),         # sdO
            (0 if t.p_in_registers else t.m * t.n * t.pds_stage * BF16_BYTES, 1024),  # sP
            (t.m * t.n * t.pds_stage * BF16_BYTES, 1024),        # sdS
            (t.m * hd * 4, 1024)):                               # sdQaccum (fp32)
        size = _round_up(size, align) + nbytes
    return size


@dataclass(frozen=True)
class FwdFootprint:
    tile: tuple[int, int]
    total: int          # the SharedStorage struct: what the launch asks for
    o_tile: int         # bytes of the output tile the epilogue stages in shared memory
    o_room: int         # bytes from sQ's start to the end of the struct, where that tile is written

    @property
    def fits(self) -> bool:
        return self.total <= SM90_MAX_SMEM and self.o_tile <= self.o_room


def fwd_tile(head_dim: int, head_dim_v: int, causal: bool, local: bool) -> tuple[int, int, bool]:
    """interface._tile_size_fwd_sm90 (no block sparsity): (tile_m, tile_n, P kept in registers)."""
    if head_dim <= 64:
        return 192, 128, True
    if head_dim <= 96:
        return 192, (128 if causal or local else 144), False
    if head_dim <= 128:
        return 128, 128, True
    if head_dim <= 192:
        return 128, (96 if local else (128 if head_dim_v <= 128 else 112)), True
    return 128, (64 if local else 80), True


def fwd_footprint(head_dim: int, head_dim_v: int, causal: bool, local: bool) -> FwdFootprint:
    """FlashAttentionForwardSm90's SharedStorageQKV (Q not in registers): mbarriers, sV, sQ, sK, sP."""
    m, n, p_in_registers = fwd_tile(head_dim, head_dim_v, causal, local)
    hd, hdv = _round_up(head_dim, 16), _round_up(head_dim_v, 16)
    size = (2 + 2 * FWD_STAGES + 2 * FWD_STAGES) * 8
    size = _round_up(size, 1024) + n * hdv * FWD_STAGES * BF16_BYTES          # sV
    q_start = _round_up(size, 1024)
    size = q_start + m * hd * BF16_BYTES                                      # sQ
    size = _round_up(size, 1024) + n * hd * FWD_STAGES * BF16_BYTES           # sK
    size = _round_up(size, 1024) + (0 if p_in_registers else m * n * BF16_BYTES)  # sP
    return FwdFootprint((m, n), size, m * hdv * BF16_BYTES, size - q_start)


@lru_cache(maxsize=None)
def forward_problem(head_dim: int, head_dim_v: int, window: tuple[int, int]) -> tuple[str, str] | None:
    """(message, fix) when the sm90 forward for these head dims cannot run; None when it fits."""
    causal, local = masking(window)
    fp = fwd_footprint(head_dim, head_dim_v, causal, local)
    if fp.fits:
        return None
    m, n = fp.tile
    if fp.total > SM90_MAX_SMEM:
        why = f"needs {fp.total} bytes of shared memory per block (tile {m}x{n}); sm90 allows {SM90_MAX_SMEM}"
    else:
        why = (f"stages its {fp.o_tile}-byte output tile ({m} x head_dim_v) in sQ's storage, which has only "
               f"{fp.o_room} bytes to the end of its shared memory")
    best = largest_head_dim_v(lambda dv: fwd_footprint(head_dim, dv, causal, local).fits)
    return (f"(head_dim_qk, head_dim_v)=({head_dim}, {head_dim_v}) on sm90: flash-attn-4's forward kernel {why}",
            f"use head_dim_v={best} (the largest whose forward fits with head_dim_qk={head_dim}), or equal head dims")


def dq_accumulator_mismatch(head_dim: int) -> bool:
    """Below the swapped-dK/dV tiles (head_dim <= 128) the sm90 backward kernel pads head_dim to a multiple of 16
    (flash_bwd_sm90.py: hdim_multiple_of = 64 if dKV_swapAB else 16), while interface.py allocates, zeroes and
    post-processes the fp32 dQ accumulator padded to a multiple of 32: where the two differ, the postprocess reads
    columns the kernel never wrote, and dQ comes back wrong without an error (flash-attention PR #2896)."""
    return head_dim <= 128 and _round_up(head_dim, 16) != _round_up(head_dim, 32)


@lru_cache(maxsize=None)
def backward_problem(head_dim: int, head_dim_v: int, window: tuple[int, int], gqa_ratio: int) -> tuple[str, str] | None:
    """(message, fix) when the sm90 backward for these head dims cannot run, or runs wrongly; None when it works."""
    if dq_accumulator_mismatch(head_dim):
        return (f"training with head_dim_qk={head_dim} on sm90: flash-attn-4's backward kernel pads it to "
                f"{_round_up(head_dim, 16)} while its dQ accumulator and postprocess use {_round_up(head_dim, 32)}, "
                "so dQ comes back silently wrong (flash_bwd_sm90.py hdim_multiple_of=16 vs interface.py 32; "
                "flash-attention PR #2896)",
                f"use head_dim_qk={_round_up(head_dim, 32)} (a multiple of 32 up to 128), or run inference")
    causal, local = masking(window)
    best = largest_head_dim_v(lambda dv: bwd_layout_problem(head_dim, dv) is None
                              and bwd_smem_bytes(head_dim, dv, causal or local) <= SM90_MAX_SMEM)
    layout = bwd_layout_problem(head_dim, head_dim_v)
    if layout:
        return (f"training with (head_dim_qk, head_dim_v)=({head_dim}, {head_dim_v}) on sm90: flash-attn-4's backward "
                f"kernel cannot be built: {layout} (derived from flash_bwd_sm90.py _setup_attributes/_get_tiled_mma)",
                f"use head_dim_v={best} (the largest that trains with head_dim_qk={head_dim}), or run inference")
    if gqa_ratio > 1 and head_dim != head_dim_v:
        return (f"training with num_heads/num_gqa_groups={gqa_ratio} and (head_dim_qk, head_dim_v)=({head_dim}, "
                f"{head_dim_v}) on sm90: flash-attn-4's sm90 backward asserts 'GQA backward requires head_dim == "
                "head_dim_v' (FlashAttentionBackwardSm90.__init__)",
                "use equal head dims, one kv head per query head, or run inference")
    need = bwd_smem_bytes(head_dim, head_dim_v, causal or local)
    if need <= SM90_MAX_SMEM:
        return None
    t = bwd_tile(head_dim, head_dim_v, causal or local)
    return (f"training with (head_dim_qk, head_dim_v)=({head_dim}, {head_dim_v}) on sm90: flash-attn-4's backward "
            f"kernel (tile {t.m}x{t.n}, chosen by head_dim_qk) needs {need} bytes of shared memory per block; sm90 "
            f"allows {SM90_MAX_SMEM}",
            f"use head_dim_v={best} (the largest that trains with head_dim_qk={head_dim}), or run inference")


def masking(window: tuple[int, int]) -> tuple[bool, bool]:
    """(causal, local) as interface._resolve_causal_local_window sees our bottom-right window (-1 = unbounded)."""
    if window == (-1, -1):
        return False, False
    return (True, False) if window == (-1, 0) else (False, True)


def largest_head_dim_v(fits: Callable[[int], bool]) -> int | None:
    """The largest head_dim_v (a multiple of 8, at most 256) that `fits` accepts: the fix a message offers."""
    return next((dv for dv in range(256, 7, -8) if fits(dv)), None)
