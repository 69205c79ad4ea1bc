"""What the GPU test modules share: the case description, ragged/dense input layout, the error metric against
the float64 reference, and the summary printed (and written under $OUT) at the end of a run."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


@dataclass(frozen=True)
class Case:
    name: str
    fmt: str = "bshd"
    mask: str = "no_mask"
    b: int = 2
    h: int = 4
    hkv: int = 4
    sq: int = 128
    skv: int = 128
    dqk: int = 64
    dv: int = 64
    window: tuple = (-1, -1)
    bias: str = "no_bias"        # no_bias | 1hss | bhss | b1ss | 11ss (cuDNN)
    bias_grad: bool = False
    alibi: str | None = None     # None | 'default' (cuDNN's built-in) | 'h' | 'bh' (slopes [h] or [b, h])
    softmax: str = "vanilla"
    dropout: float = 0.0
    deterministic: bool = False
    train: bool = True
    dtype: torch.dtype = torch.bfloat16
    thd_gaps: bool = False       # thd with padding between sequences
    lens_q: tuple = ()           # padding / thd lengths (default: each module's own)
    lens_kv: tuple = ()
    provider: str = "frontend"   # cuDNN's provider


def padded(c: Case) -> bool:
    return c.mask.startswith("padding") or c.fmt == "thd"


def cu(lens) -> torch.Tensor:
    """int32 cumulative offsets [0, l0, l0 + l1, ...] on the GPU."""
    return torch.tensor([0] + torch.tensor(list(lens)).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def layout_qkv(c: Case, lq: list[int], lkv: list[int], rnd: Callable[..., torch.Tensor]):
    """q, k, v in the case's layout from rnd(*shape), and the cu_seqlens the layout needs (a dict of AttnAux
    fields): thd packs the sequences (with gaps of 5 / 3 slots when c.thd_gaps), padding masks get offsets."""
    offsets = {}
    if c.fmt == "thd":
        gap_q, gap_kv = (5, 3) if c.thd_gaps else (0, 0)
        slots_q, slots_kv = [n + gap_q for n in lq], [n + gap_kv for n in lkv]
        q, k, v = rnd(sum(slots_q), c.h, c.dqk), rnd(sum(slots_kv), c.hkv, c.dqk), rnd(sum(slots_kv), c.hkv, c.dv)
        if c.thd_gaps:
            offsets.update(cu_seqlens_q_padded=cu(slots_q), cu_seqlens_kv_padded=cu(slots_kv))
    elif c.fmt == "bshd":
        q, k, v = rnd(c.b, c.sq, c.h, c.dqk), rnd(c.b, c.skv, c.hkv, c.dqk), rnd(c.b, c.skv, c.hkv, c.dv)
    else:
        q, k, v = rnd(c.sq, c.b, c.h, c.dqk), rnd(c.skv, c.b, c.hkv, c.dqk), rnd(c.skv, c.b, c.hkv, c.dv)
    if padded(c):
        offsets.update(cu_seqlens_q=cu(lq), cu_seqlens_kv=cu(lkv))
    return q, k, v, offsets


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (floored at 0.1), as tests/test_unfused_engine.py measures; inf for a shape
    mismatch or a non-finite value in a."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape or not torch.isfinite(a).all():
        return math.inf
    if b.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(0.1)).item()


def lse_error(lse: torch.Tensor, ref_lse: torch.Tensor) -> float:
    """rel_err over the rows that see a key; inf when the shape, or which rows see none (-inf), disagree, or
    when a row that sees keys is not finite."""
    mine = lse.detach().cpu().double()
    empty = torch.isneginf(ref_lse)
    if mine.shape != ref_lse.shape or not torch.equal(torch.isneginf(mine), empty):
        return math.inf
    return rel_err(mine[~empty], ref_lse[~empty])


def write_and_print(config, results: list[dict], meta: dict, filename: str, lines: list[str]) -> None:
    """Writes {"machine": meta, "results": results} to $OUT/filename (when $OUT is set) and prints the lines
    past pytest's output capture."""
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, filename), "w") as f:
            json.dump({"machine": meta, "results": results}, f, indent=1, default=str)
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        with capman.global_and_fixture_disabled():
            print("\n".join(lines))
    else:
        print("\n".join(lines))
