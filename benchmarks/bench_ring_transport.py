"""Ring transports among the GPUs of one host: NCCL's send/recv (each rank to the next, from the previous) and
all-to-all, alone and beside bf16 matmuls on the compute stream, and a copy-engine pull from the next rank's
symmetric-memory buffer (what context_parallel/copy_engine.py does) alone and beside matmuls; plus the matmuls' time
alone and beside a ring. NCCL reads its environment at init: run once per setting, each run appends one JSON line.

    python3 benchmarks/bench_ring_transport.py 4 $OUT/ring.jsonl
    TORCH_NCCL_HIGH_PRIORITY=1 python3 benchmarks/bench_ring_transport.py 4 $OUT/ring.jsonl

Per rank and size: [median ms of 10 timed calls, GB/s] (all-to-all: the bytes that leave the rank).
"""
import json
import os
import socket
import sys
for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[k] = v
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

def ring(buf_s, buf_r, rank, world):
    ops = [dist.P2POp(dist.isend, buf_s, (rank + 1) % world), dist.P2POp(dist.irecv, buf_r, (rank - 1) % world)]
    return dist.batch_isend_irecv(ops)

def work(rank, world, port, out):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    side = torch.cuda.Stream()
    res = {}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for mib in (16, 64, 128, 192):
        n = mib * 2**20 // 2
        s, r = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda", dtype=torch.bfloat16)
        for mode in ("alone", "beside_matmul", "a2a"):
            times = []
            for it in range(12):
                dist.barrier()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if mode == "beside_matmul":
                    for _ in range(6):
                        a @ a
                with torch.cuda.stream(side):
                    side.wait_stream(torch.cuda.current_stream()) if mode != "beside_matmul" else None
                    e0.record(side)
                    if mode == "a2a":
                        dist.all_to_all_single(r, s)
                    else:
                        for w in ring(s, r, rank, world):
                            w.wait()
                    e1.record(side)
                torch.cuda.synchronize()
                if it >= 2:
                    times.append(e0.elapsed_time(e1))
            ms = sorted(times)[len(times) // 2]
            gbs = mib * 2**20 / (ms * 1e-3) / 1e9 * ((world - 1) / world if mode == "a2a" else 1)
            res[f"{mode}_{mib}MiB"] = [round(ms, 3), round(gbs, 1)]
    # matmul alone vs beside the ring
    s = torch.randn(64 * 2**19, device="cuda", dtype=torch.bfloat16)
    r = torch.empty_like(s)
    for mode in ("mm_alone", "mm_beside_ring"):
        times = []
        for it in range(8):
            dist.barrier()
            torch.cuda.synchronize()
            if mode == "mm_beside_ring":
                with torch.cuda.stream(side):
                    for _ in range(4):  # waited for by the synchronize below
                        ring(s, r, rank, world)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(6):
                a @ a
            e1.record()
            torch.cuda.synchronize()
            if it >= 2:
                times.append(e0.elapsed_time(e1))
        res[mode] = round(sorted(times)[len(times) // 2], 3)
    # copy engine: peer buffers through torch's symmetric memory, a copy_ into the next rank's buffer
    try:
        import torch.distributed._symmetric_memory as symm_mem
        n = 64 * 2**19
        buf = symm_mem.empty(n, dtype=torch.bfloat16, device=f"cuda:{rank}")
        try:
            hdl = symm_mem.rendezvous(buf, dist.group.WORLD)
        except Exception:
            hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        peer = hdl.get_buffer((rank + 1) % world, (n,), torch.bfloat16)
        src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for mode in ("ce_alone", "ce_beside_matmul"):
            times = []
            for it in range(12):
                dist.barrier()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if mode == "ce_beside_matmul":
                    for _ in range(6):
                        a @ a
                with torch.cuda.stream(side):
                    e0.record(side)
                    peer.copy_(src)
                    e1.record(side)
                torch.cuda.synchronize()
                if it >= 2:
                    times.append(e0.elapsed_time(e1))
            ms = sorted(times)[len(times) // 2]
            res[f"{mode}_64MiB"] = [round(ms, 3), round(64 * 2**20 / (ms * 1e-3) / 1e9, 1)]
        hdl.barrier()
        torch.cuda.synchronize()
        res["ce_ok"] = bool(torch.equal(buf, buf))
    except Exception as exc:
        res["ce_error"] = f"{type(exc).__name__}: {exc}"[:300]
    allr = [None] * world
    dist.all_gather_object(allr, res)
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        lowest = {k: min(x[k][1] for x in allr) for k in res if isinstance(res[k], list)}
        print(json.dumps({"env": env, "world": world, "rank0": allr[0], "min_gbs": lowest}))
        with open(out, "a") as f:
            f.write(json.dumps({"env": env, "world": world, "device": torch.cuda.get_device_name(0),
                                "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                                "ranks": allr}) + "\n")
    dist.destroy_process_group()

if __name__ == "__main__":
    world, out = int(sys.argv[1]), sys.argv[2]
    with socket.socket() as sk:
        sk.bind(("", 0))
        port = sk.getsockname()[1]
    mp.spawn(work, args=(world, port, out), nprocs=world)
