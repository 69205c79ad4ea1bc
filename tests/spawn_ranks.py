"""Run a multi-rank test worker in spawned processes (gloo on the CPU) and read what the ranks wrote."""
from __future__ import annotations

import json
import socket
import time
from typing import Any, Callable


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker: Callable, args: tuple, nprocs: int, out_path: str, what: str, deadline_s: float) -> Any:
    """worker(rank, *args) in nprocs spawned processes; the JSON they leave at out_path, or a message saying why not
    (a hung or failed spawn is reported, once, to every test that reads it)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                return f"{what} workers did not finish in {deadline_s} s"
    except Exception as exc:  # noqa: BLE001 - a worker died: report it for every test
        return f"a {what} worker failed: {exc}"
    with open(out_path) as f:
        return json.load(f)


def write_gathered(results: Any, world: int, rank: int, out_path: str) -> None:
    """Every rank's results gathered; rank 0 writes them (a list by rank) to out_path for spawn_ranks to read."""
    import torch.distributed as dist

    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(everyone, f)


def teardown() -> None:
    """Collect garbage, then destroy the process groups. A group that only a garbage cycle still holds (a raised
    exception's frames) would otherwise be freed at interpreter exit, after gloo's transport is gone, which
    aborts the process ('terminate called without an active exception', about 1 run in 10 of the FP8 CP test)."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()
