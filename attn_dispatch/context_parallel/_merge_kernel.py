"""One Triton pass for the log-sum-exp merge of two partial attention results (merge.merge_to on CUDA).

Eager torch takes five passes over the float32 output for one merge (scale, multiply-add, copies; on
2xH100 at 32k tokens the ring's merges and copies cost 0.66 ms of a 4.3 ms forward). This kernel reads both
partial outputs once, in their own dtype, computes in float32 and writes the merged output once, in the output's
dtype: no float32 copy of a block result, no float32 accumulator between the last step and the output.

Tensors are passed as [B, S, H, D] views (outputs) and [B, H, S] views (lse) with any strides, so halves of a
shard and every qkv_format go in without copies. The output may be one of the inputs (an in-place merge): each
element is read before it is written, by the same program.
"""
from __future__ import annotations

import torch

try:  # Triton ships with torch's CUDA builds; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

_TARGET_ELEMENTS = 4096  # per program: heads x head dim

if triton is not None:
    @triton.jit
    def _merge_kernel(out_ptr, lse_out_ptr, a_ptr, lse_a_ptr, b_ptr, lse_b_ptr, S, H, D,
                      so_b, so_s, so_h, so_d, sa_b, sa_s, sa_h, sa_d, sb_b, sb_s, sb_h, sb_d,
                      slo_b, slo_h, slo_s, sla_b, sla_h, sla_s, slb_b, slb_h, slb_s,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        b, s = row // S, row % S
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_ok = h < H
        la = tl.load(lse_a_ptr + b * sla_b + h * sla_h + s * sla_s, mask=h_ok, other=float("-inf")).to(tl.float32)
        lb = tl.load(lse_b_ptr + b * slb_b + h * slb_h + s * slb_s, mask=h_ok, other=float("-inf")).to(tl.float32)
        top = tl.maximum(la, lb)
        top = tl.where(top == float("-inf"), 0.0, top)  # rows with no key on either side: weights 0, lse -inf
        ea = tl.exp(la - top)
        eb = tl.exp(lb - top)
        total = ea + eb
        wa = tl.where(total > 0, ea / total, 0.0)
        wb = tl.where(total > 0, eb / total, 0.0)
        hd_ok = h_ok[:, None] & (d[None, :] < D)
        a = tl.load(a_ptr + b * sa_b + s * sa_s + h[:, None] * sa_h + d[None, :] * sa_d, mask=hd_ok, other=0.0)
        bb = tl.load(b_ptr + b * sb_b + s * sb_s + h[:, None] * sb_h + d[None, :] * sb_d, mask=hd_ok, other=0.0)
        merged = wa[:, None] * a.to(tl.float32) + wb[:, None] * bb.to(tl.float32)
        tl.store(out_ptr + b * so_b + s * so_s + h[:, None] * so_h + d[None, :] * so_d,
                 merged.to(out_ptr.dtype.element_ty), mask=hd_ok)
        tl.store(lse_out_ptr + b * slo_b + h * slo_h + s * slo_s,
                 (top + tl.log(total)).to(lse_out_ptr.dtype.element_ty), mask=h_ok)


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: CUDA, one device, 16/32-bit floats (float64 keeps torch ops)."""
    return triton is not None and all(t.is_cuda and t.dtype in _FLOATS for t in tensors) and \
        len({t.device for t in tensors}) == 1


def _as_bshd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "bshd":
        return x
    return x.permute(1, 0, 2, 3) if fmt == "sbhd" else x.unsqueeze(0)


def _as_bhs(lse: torch.Tensor, fmt: str) -> torch.Tensor:
    return lse.unsqueeze(0) if fmt == "thd" else lse


def merge(out: torch.Tensor, lse_out: torch.Tensor, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor, fmt: str) -> None:
    """out, lse_out <- the merge of (out_a, lse_a) and (out_b, lse_b); shapes as merge.merge_to's."""
    o, a, b = (_as_bshd(t, fmt) for t in (out, out_a, out_b))
    lo, la, lb = (_as_bhs(t, fmt) for t in (lse_out, lse_a, lse_b))
    batch, seq, heads, dim = o.shape
    if o.numel() == 0:
        return
    block_d = triton.next_power_of_2(dim)
    block_h = min(triton.next_power_of_2(heads), max(1, _TARGET_ELEMENTS // block_d))
    grid = (batch * seq, triton.cdiv(heads, block_h))
    _merge_kernel[grid](o, lo, a, la, b, lb, seq, heads, dim, *o.stride(), *a.stride(), *b.stride(),
                        *lo.stride(), *la.stride(), *lb.stride(), BLOCK_H=block_h, BLOCK_D=block_d)
