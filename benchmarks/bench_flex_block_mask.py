"""What flex_attention:torch spends preparing one call whose cu_seqlens tensors are new (transformers builds new
mask tensors every step, so nothing derived from the previous step's tensors is reused): the frame (each token's
sequence and position), the BlockMask built by create_block_mask evaluating the mask_mod on every pair (before), the
BlockMask built from the sequence bounds (after), and the whole plan (frame, modifiers, BlockMask) as the engine runs
it. Each call also counts the host reads of device data it makes (.item()/int() dispatch aten._local_scalar_dense;
nonzero, masked_select, unique and equal make the host wait too), and says whether the plan runs on fake tensors
(contents unknown: any read-back raises, also those the count cannot see: .tolist(), indexing with a bool tensor).

Default call: 8192 packed tokens in 4 sequences with gaps between them (cu_seqlens_q_padded), h16, causal
(top-left), causal bottom-right, and a 4096-token sliding window.

    python benchmarks/bench_flex_block_mask.py --out /tmp/flex_block_mask_cpu.json
    python benchmarks/bench_flex_block_mask.py --device cuda --out $OUT/flex_block_mask_h200.json   # a GPU host
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform as py_platform
import statistics
import time
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import flex_attention as flex
from torch.utils._python_dispatch import TorchDispatchMode

from attn_dispatch.backends import _flex_masks as masks
from attn_dispatch.backends.base import AttnAux, AttnConfig
from attn_dispatch.backends.flex_attention import plan
from attn_dispatch.params import normalize_window

LENS = (1900, 2150, 1700, 2000)      # tokens per sequence
GAPS = (148, 60, 200, 34)            # padding after each: 8192 tokens in all
HEADS = 16
CALLS = (("padding_causal", None), ("padding_causal_bottom_right", None), ("padding_causal", (4095, 0)))
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
              "unique_consecutive", "equal", "is_nonzero", "item", "repeat_interleave"}


class CountHostReads(TorchDispatchMode):
    """Counts the ops that hand device data (or a data-dependent size) back to the host."""

    def __init__(self):
        super().__init__()
        self.reads: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.reads[name] = self.reads.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def packed_aux(device: torch.device) -> AttnAux:
    """Fresh cu_seqlens tensors, as a new step makes them."""
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    padded = torch.tensor([0, *torch.tensor([a + g for a, g in zip(LENS, GAPS)]).cumsum(0).tolist()],
                          dtype=torch.int32, device=device)
    return AttnAux(cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), cu_seqlens_q_padded=padded,
                   cu_seqlens_kv_padded=padded.clone(), max_seqlen_q=max(LENS), max_seqlen_kv=max(LENS))


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> dict:
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": reps}


def host_reads(fn: Callable[[], object]) -> dict[str, int]:
    with CountHostReads() as counter:
        fn()
    return counter.reads


def runs_on_fake_tensors(mask_type: str, window, total: int) -> bool | str:
    real = packed_aux(torch.device("cpu"))
    try:
        with FakeTensorMode() as mode:
            aux = AttnAux(**{name: mode.from_tensor(getattr(real, name)) for name in (
                "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")},
                max_seqlen_q=real.max_seqlen_q, max_seqlen_kv=real.max_seqlen_kv)
            plan(flex, aux, config(mask_type, window), 1, HEADS, total, total, torch.device("cpu"))
        return True
    except Exception as exc:  # noqa: BLE001 - which read-back, reported
        return f"{type(exc).__name__}: {exc}"[:200]


def config(mask_type: str, window) -> AttnConfig:
    return AttnConfig(qkv_format="thd", attn_mask_type=mask_type, window_size=normalize_window(window, mask_type))


def measure(mask_type: str, window, device: torch.device, reps: int, reps_old: int) -> dict:
    total = sum(LENS) + sum(GAPS)
    cfg = config(mask_type, window)
    win = tuple(cfg.window_size)

    def frame():
        return masks.frame_for(packed_aux(device), cfg, total, total)

    def before():  # the frame, then create_block_mask over every pair
        f = frame()
        mask_mod = masks.mask_mod_for(f, cfg, None, None)
        return masks._from_mask_mod(flex, mask_mod, (1, 1, total, total), device, compile_=False)

    def after():  # the frame, then the blocks from the sequence bounds
        return masks._from_bounds(flex, frame(), win, total, total, device)

    def whole_plan():
        return plan(flex, packed_aux(device), cfg, 1, HEADS, total, total, device)

    for fn in (before, after, whole_plan):
        fn()  # warm: first-call costs (imports, vmap tracing) are not per step
    old, new = before().block_mask, after().block_mask
    same = all(torch.equal(getattr(old, n), getattr(new, n)) for n in (
        "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"))
    row = {"mask_type": mask_type, "window": list(win), "tokens": total, "sequences": len(LENS),
           "same_block_mask": same,
           "frame": timed(frame, device, reps), "before_create_block_mask": timed(before, device, reps_old),
           "after_from_bounds": timed(after, device, reps), "plan_after": timed(whole_plan, device, reps),
           "host_reads": {"frame": host_reads(frame), "before_create_block_mask": host_reads(before),
                          "after_from_bounds": host_reads(after), "plan_after": host_reads(whole_plan)},
           "plan_runs_on_fake_tensors": runs_on_fake_tensors(mask_type, window, total)}
    row["speedup"] = row["before_create_block_mask"]["median_ms"] / row["after_from_bounds"]["median_ms"]
    return row


def environment(device: torch.device) -> dict:
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": py_platform.node(), "processor": py_platform.processor() or py_platform.machine(),
            "cpu_threads": torch.get_num_threads(), "python": py_platform.python_version(),
            "torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=20, help="repeats of the fast paths (median reported)")
    parser.add_argument("--reps-old", type=int, default=3, help="repeats of create_block_mask (slow on the CPU)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = [measure(mask_type, window, device, args.reps, args.reps_old) for mask_type, window in CALLS]
    print(f"{'call':<44} {'frame':>8} {'before':>10} {'after':>8} {'plan':>8} {'x':>7}  host reads (before/after/plan)")
    for r in rows:
        name = f"{r['mask_type']} window={tuple(r['window'])}"
        reads = r["host_reads"]
        print(f"{name:<44} {r['frame']['median_ms']:8.2f} {r['before_create_block_mask']['median_ms']:10.1f} "
              f"{r['after_from_bounds']['median_ms']:8.2f} {r['plan_after']['median_ms']:8.2f} {r['speedup']:7.0f}  "
              f"{sum(reads['before_create_block_mask'].values())}/{sum(reads['after_from_bounds'].values())}/"
              f"{sum(reads['plan_after'].values())}  same={r['same_block_mask']} "
              f"fake={r['plan_runs_on_fake_tensors'] is True}")
    print("ms per call (median); before/after include the frame; plan = what the engine runs per call")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"environment": environment(device), "calls": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
