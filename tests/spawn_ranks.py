"""Run a multi-rank test worker in spawned processes (gloo on the CPU) and read what the ranks wrote."""
from __future__ import annotations

import json
import os
import random
import socket
import time
from typing import Any, Callable


_PORTS_BELOW_EPHEMERAL = 10000  # the rendezvous ports start here, under the kernel's ephemeral range
_PORT_SLICES = 16  # one slice of them per pytest-xdist worker (gw0, gw1, ...), modulo this many
_PORT_DRAWS = random.Random()  # its own generator: a test's random.seed neither fixes nor is moved by the draw


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port for rank 0's rendezvous store, free now and not handed to any concurrent test: drawn below the kernel's
    ephemeral range (where the ranks' own gloo connections, and every bind to port 0, land while the spawned ranks
    start), from a slice of its own for each pytest-xdist worker. Where the ephemeral range leaves no room below it,
    a port the kernel picks."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    width = (ephemeral_low - _PORTS_BELOW_EPHEMERAL) // _PORT_SLICES
    if width >= 16:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        start = _PORTS_BELOW_EPHEMERAL + (int(worker) if worker.isdigit() else 0) % _PORT_SLICES * width
        first = _PORT_DRAWS.randrange(width)
        for i in range(width):
            port = start + (first + i) % width
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_environ(rank: int, environ: dict, worker: Callable, *args) -> None:
    """worker(rank, *args) under the environment of the test that started it (the fork server keeps the one it
    was started with)."""
    os.environ.clear()
    os.environ.update(environ)
    worker(rank, *args)


def spawn_ranks(worker: Callable, args: tuple, nprocs: int, out_path: str, what: str, deadline_s: float) -> Any:
    """worker(rank, *args) in nprocs spawned processes; the JSON they leave at out_path, or a message saying why not
    (a hung or failed spawn is reported, once, to every test that reads it)."""
    failure = run_ranks(worker, args, nprocs, what, deadline_s)
    if failure is not None:
        return failure
    with open(out_path) as f:
        return json.load(f)


def run_ranks(worker: Callable, args: tuple, nprocs: int, what: str, deadline_s: float) -> str | None:
    """worker(rank, *args) in nprocs processes started at once from the fork server; None once all have finished,
    else a message saying which did not."""
    import multiprocessing

    import torch.multiprocessing as mp

    # The ranks fork from a server (one per test process) that has imported torch, with the compiler and FlexAttention
    # modules the package imports, and nothing of ours: as clean a start as a fresh interpreter, without each rank
    # paying those imports (about 4.5 s of CPU) again.
    multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "torch.nn.attention.flex_attention"])
    ctx = mp.start_processes(_in_environ, args=(dict(os.environ), worker, *args), nprocs=nprocs, join=False,
                             start_method="forkserver")
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
    return None


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
