"""Where p2p context parallelism loses against one GPU (issue 16): the same call taken apart, on 2 GPUs.

For each total length S and engine, every rank times (median, slowest rank; bench_cp.timed_ms):
- whole: rank 0 alone runs the whole sequence on one GPU (the baseline bench_cp's efficiency divides by);
- blocks: this rank's ring blocks (the causal diagonal block, then the half-size block of step 1) run back to
  back through the engine, no merge, no transfer: the compute floor of the ring;
- ring, no transfer: p2p's forward/backward with a ring that copies locally instead of sending (merges, copies,
  accumulators as in the real ring; the numbers are wrong, the work is not);
- ring: cp.attention(cp_comm_type="p2p") as a user calls it, the agreement check off and on.
Then rank 0 profiles one ring fwd+bwd (torch.profiler): GPU time by kernel, and the step's wall time.

    python3 benchmarks/gpu/diagnose_cp_p2p.py --out $OUT/cp_p2p_diag.json --seqlens 32768,131072 \
        --engines flash_attn_4:cute,cudnn_fused:torch
"""
from __future__ import annotations

import os

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_name] = _value  # before torch is imported (device README: NVLink multicast stays off)

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch import context_parallel as cp  # noqa: E402
from attn_dispatch.backends import AttnAux, get_engine  # noqa: E402
from attn_dispatch.context_parallel import _comm, p2p  # noqa: E402
from bench_cp import config, timed_ms  # noqa: E402


class LocalRing(_comm.Ring):
    """A ring that copies each send into the matching receive on this GPU: the ring's work without NCCL."""

    def start(self, sends, recvs, **_):
        for (s, _), (r, _) in zip(sends, recvs):
            if r.shape == s.shape:
                r.copy_(s)
            else:  # two ranks' gradient exchange has a size per direction; the values do not matter here
                r.zero_()
        return []


def point(args, s: int, provider: str, rank: int, world: int) -> dict:
    b, h, d = 1, args.heads, args.head_dim
    local = s // world
    cuda = args.device == "cuda"
    dt, dev = (torch.bfloat16, torch.device("cuda", rank)) if cuda else (torch.float32, torch.device("cpu"))
    engine = get_engine(provider)
    cfg = config("causal", "vanilla", d)
    row: dict = {"seqlen": s, "engine": provider}

    # whole sequence on rank 0 (the other rank waits at timed_ms's barriers running nothing)
    qw, kw, vw = (torch.randn(b, s, h, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    dw = torch.randn(b, s, h, d, device=dev, dtype=dt)
    aux_w = AttnAux(max_seqlen_q=s, max_seqlen_kv=s)
    mine = rank == 0
    fwd_w = lambda: engine(qw, kw, vw, aux_w, cfg)[0] if mine else None  # noqa: E731
    row["whole_fwd_ms"] = timed_ms(lambda: torch.no_grad()(fwd_w)(), args, args.device)
    row["whole_fwd_bwd_ms"] = timed_ms(lambda: fwd_w().backward(dw) if mine else None, args, args.device,
                                       grads=(qw, kw, vw))
    del qw, kw, vw, dw

    q, k, v = (torch.randn(b, local, h, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, local, h, d, device=dev, dtype=dt)
    plan = p2p.RingPlan(cfg, AttnAux(), "bshd", True, local, local)
    src = (rank - 1) % world
    kind = plan.kind(1, src, rank)
    halves = plan.halves

    def blocks(backward: bool):
        res0 = engine.forward(q, k, v, plan.aux[p2p.DIAG], plan.cfg(p2p.DIAG))
        qb, kb, vb = q, k, v
        if kind == p2p.KV_FIRST:
            kb, vb = halves.take(k, 0).contiguous(), halves.take(v, 0).contiguous()
        else:
            qb = halves.take(q, 1).contiguous()
        res1 = engine.forward(qb, kb, vb, plan.aux[kind], plan.cfg(kind))
        if backward:
            engine.backward(dout, q, k, v, res0.out, res0.lse, res0.state, plan.aux[p2p.DIAG], plan.cfg(p2p.DIAG))
            d1 = dout if kind == p2p.KV_FIRST else halves.take(dout, 1).contiguous()
            engine.backward(d1, qb, kb, vb, res1.out, res1.lse, res1.state, plan.aux[kind], plan.cfg(kind))

    with torch.no_grad():
        row["blocks_fwd_ms"] = timed_ms(lambda: blocks(False), args, args.device)
        row["blocks_fwd_bwd_ms"] = timed_ms(lambda: blocks(True), args, args.device)

    info = _comm.group_info(dist.group.WORLD)
    local_ring = p2p.P2PAttention(engine, plan, info)
    local_ring.ring = LocalRing(info)

    def ring_local(backward: bool):
        out, saved, states = local_ring.forward(q, k, v, None)
        if backward:
            local_ring.backward(dout, saved, states, None)

    with torch.no_grad():
        row["ring_local_fwd_ms"] = timed_ms(lambda: ring_local(False), args, args.device)
        row["ring_local_fwd_bwd_ms"] = timed_ms(lambda: ring_local(True), args, args.device)

    call = lambda: cp.attention(engine, q, k, v, AttnAux(), cfg, cp_group=dist.group.WORLD,  # noqa: E731
                                cp_comm_type="p2p")
    for checks in ("0", "1"):
        os.environ[_comm.CHECKS_ENV] = checks
        tag = "ring" if checks == "0" else "ring_checked"
        row[f"{tag}_fwd_ms"] = timed_ms(lambda: torch.no_grad()(call)(), args, args.device)
        row[f"{tag}_fwd_bwd_ms"] = timed_ms(lambda: call().backward(dout), args, args.device, grads=(q, k, v))
    os.environ[_comm.CHECKS_ENV] = "0"

    # rank 0's kernels in one ring fwd+bwd (both ranks run it; only rank 0 records)
    for _ in range(2):
        call().backward(dout)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    dist.barrier()
    if rank == 0:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            call().backward(dout)
            sync()
        events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        row["profile_top"] = [{"name": e.key[:90], "count": e.count, "gpu_ms": e.device_time_total / 1e3}
                              for e in events[:14]]
    else:
        call().backward(dout)
        sync()
    dist.barrier()
    ideal = row["whole_fwd_bwd_ms"] / world
    row["efficiency_fwd_bwd"] = {k: ideal / row[f"{k}_fwd_bwd_ms"] for k in
                                 ("blocks", "ring_local", "ring", "ring_checked")}
    row["efficiency_fwd"] = {k: row["whole_fwd_ms"] / world / row[f"{k}_fwd_ms"] for k in
                             ("blocks", "ring_local", "ring", "ring_checked")}
    return row


def worker(rank: int, world: int, port: int, args, results):
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}", device_id=torch.device("cuda", rank) if cuda else None)
    rows = []
    try:
        for s in args.seqlens:
            for provider in args.engines:
                try:
                    rows.append(point(args, s, provider, rank, world))
                except Exception as exc:  # noqa: BLE001 - report and go on
                    rows.append({"seqlen": s, "engine": provider, "error": traceback.format_exc()[-1500:]})
                    print(f"rank {rank}: {s} {provider}: {exc}", flush=True)
                if rank == 0:
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile_top"}), flush=True)
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        if rank == 0:
            results.put(rows)
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlens", default="32768,131072")
    ap.add_argument("--engines", default="flash_attn_4:cute,cudnn_fused:torch")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=3.0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run over gloo")
    args = ap.parse_args()
    args.seqlens = [int(x) for x in args.seqlens.split(",")]
    args.engines = [x for x in args.engines.split(",") if x]
    world = 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.spawn(worker, args=(world, port, args, results), nprocs=world, join=True)
    rows = results.get()
    env = {"torch": torch.__version__, "device": args.device}
    if args.device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(0), cudnn=torch.backends.cudnn.version(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    Path(args.out).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    print(f"\n{env}")
    print("| S | engine | whole fwd / fwd+bwd | ideal fwd+bwd | blocks | ring, no transfer | ring | ring checked |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['seqlen']} | {r['engine']} | error |")
            continue
        cells = [f"{r[f'{k}_fwd_ms']:.2f} / {r[f'{k}_fwd_bwd_ms']:.2f} ({100 * r['efficiency_fwd_bwd'][k]:.1f}%)"
                 for k in ("blocks", "ring_local", "ring", "ring_checked")]
        print(f"| {r['seqlen']} | {r['engine']} | {r['whole_fwd_ms']:.2f} / {r['whole_fwd_bwd_ms']:.2f} | "
              f"{r['whole_fwd_bwd_ms'] / 2:.2f} | " + " | ".join(cells) + " |")
    for r in rows:
        for e in r.get("profile_top", [])[:10]:
            print(f"  {r['seqlen']} {r['engine'][:12]} {e['gpu_ms']:8.3f} ms x{e['count']:<4d} {e['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
