"""torch.distributed plumbing for context parallelism: who the neighbours are, ring exchanges, collective checks.

Collectives and send/recv by torch.distributed (gloo on CPU, NCCL on GPUs); copy_engine.py carries CUDA ring hops.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..env import choice

# Set ATTN_DISPATCH_CP_CHECKS=0 to skip the per-call collective agreement check (one tiny all-gather of host
# integers per call). Local checks always run.
CHECKS_ENV = "ATTN_DISPATCH_CP_CHECKS"

# Tags keep k, v, dk and dv apart on gloo, which matches messages by (peer, tag); NCCL ignores tags and
# matches in issue order, which is the same order on every rank.
TAG_K, TAG_V, TAG_DK, TAG_DV = 11, 12, 13, 14


@dataclass(frozen=True)
class GroupInfo:
    group: dist.ProcessGroup
    size: int
    rank: int                   # rank within the group
    global_ranks: tuple[int, ...]  # global rank of each group rank

    @property
    def next_global(self) -> int:
        return self.global_ranks[(self.rank + 1) % self.size]

    @property
    def prev_global(self) -> int:
        return self.global_ranks[(self.rank - 1) % self.size]

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.group))


def group_info(group, cp_global_ranks=None, *, name: str = "cp_group", min_size: int = 2) -> GroupInfo:
    """Validate one process group and describe this rank's place in it."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name}={group!r}: torch.distributed is not initialized; call "
                         "torch.distributed.init_process_group first")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{name}={group!r} must be a torch.distributed.ProcessGroup "
                         "(for cp_comm_type='a2a+p2p', a list [a2a_group, p2p_group])")
    size = dist.get_world_size(group)
    if size < min_size:
        raise ValueError(f"{name} has size {size}; context parallelism needs at least {min_size} ranks. "
                         "With one rank, call attention without cp_group")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{name}: this process (global rank {dist.get_rank()}) is not a member of the group")
    ranks = tuple(dist.get_process_group_ranks(group))
    if cp_global_ranks is not None and tuple(int(r) for r in cp_global_ranks) != ranks:
        raise ValueError(f"cp_global_ranks={list(cp_global_ranks)!r} does not match {name}'s global ranks "
                         f"{list(ranks)!r}; pass the group's ranks in group-rank order, or None")
    return GroupInfo(group, size, rank, ranks)


def checks_enabled() -> bool:
    return choice(CHECKS_ENV, ("0", "1"), "1") == "1"


# Keyed by the group's name; an entry also holds its group, since a process that destroys its groups and makes
# new ones reuses their names.
_HOST_GROUPS: dict = {}


def host_group(info: GroupInfo) -> dist.ProcessGroup:
    """A gloo group over the same ranks, for the agreement check: comparing calls over NCCL would need the signature
    back on the host, a sync that waits for every kernel queued before the call and so stops the host from running
    ahead of the GPU. Made at the group's first checked call, which every rank of it makes (only its ranks take
    part: use_local_synchronization)."""
    if info.backend == "gloo":
        return info.group
    entry = _HOST_GROUPS.get(info.group.group_name)
    if entry is None or entry[0] is not info.group:
        companion = dist.new_group(list(info.global_ranks), backend="gloo", use_local_synchronization=True)
        entry = _HOST_GROUPS[info.group.group_name] = (info.group, companion)
    return entry[1]


def agree(info: GroupInfo, signature: list[int], describe, local_error: str | None) -> None:
    """Collective: every rank learns whether any rank failed its local checks or holds a different call.
    Raises the same ValueError on every rank, so no rank is left waiting in a later exchange.
    `describe(row)` renders one rank's signature for the message. Runs on the host (host_group): no GPU sync."""
    group = host_group(info)
    row = torch.tensor([1 if local_error else 0, *signature], dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(info.size)]
    dist.all_gather(rows, row, group=group)
    table = [r.tolist() for r in rows]
    failed = [r for r, t in enumerate(table) if t[0]]
    if failed:
        messages: list[str | None] = [None] * info.size
        dist.all_gather_object(messages, local_error, group=group)
        detail = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
        raise ValueError(f"context parallelism: invalid call on {len(failed)} of {info.size} ranks of cp_group: "
                         f"{detail}")
    if any(t[1:] != table[0][1:] for t in table):
        per_rank = "; ".join(f"rank {r}: {describe(t[1:])}" for r, t in enumerate(table))
        raise ValueError("context parallelism: the ranks of cp_group disagree on the call (" + per_rank +
                         "); every rank must hold an equal slice of the same sequences (the global length / "
                         "cp_size tokens each), with the same batch, heads, head dims, dtype and options")


class Ring:
    """Batched isend/irecv to the next rank / from the previous one (or to given peers). On GPUs the batch is
    issued from a communication stream (cp_stream, else one side stream per device) after it waits for the
    compute stream, so the transfer overlaps the next compute; NCCL runs it on its own stream either way. On CPU,
    gloo runs it on its own threads."""

    def __init__(self, info: GroupInfo, stream=None):
        self.info = info
        self.stream = stream

    def reserve(self, pieces: list[tuple[int, torch.Size, torch.dtype]]) -> None:
        """The most one start will send, as (tag, shape, dtype), the same on every rank; NCCL needs no buffer."""

    def receive_buffer(self, tag: int, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An empty tensor for the next start() to receive `tag` into. Where the transport keeps its own buffers
        (copy_engine) it is one of them, from which a later start sends it on without a copy: it is then valid
        until the second start() after the one that fills it."""
        return torch.empty(shape, dtype=dtype, device=device)

    def start(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], *,
              send_to: int | None = None, recv_from: int | None = None) -> list:
        if not sends and not recvs:
            return []
        for t, tag in sends + recvs:
            if not t.is_contiguous():  # NCCL would reject it; gloo would send the wrong bytes
                raise RuntimeError(f"internal error: ring buffer (tag {tag}) of shape {tuple(t.shape)} is not "
                                   "contiguous")
        dst = self.info.next_global if send_to is None else send_to
        src = self.info.prev_global if recv_from is None else recv_from
        ops = [dist.P2POp(dist.isend, t, dst, self.info.group, tag) for t, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, src, self.info.group, tag) for t, tag in recvs]
        if any(t.is_cuda for t, _ in sends + recvs):
            device = sends[0][0].device if sends else recvs[0][0].device
            stream = self.stream or side_stream(device)
            compute = torch.cuda.current_stream(device.index)  # the index given: no device lookup on the host
            stream.wait_stream(compute)
            torch.cuda.set_stream(stream)
            try:
                return dist.batch_isend_irecv(ops)
            finally:
                torch.cuda.set_stream(compute)
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list) -> None:
        for w in works:
            w.wait()


_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device):
    """One communication stream per CUDA device, shared by every ring of this process."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


def all_gather_seq(x: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """[P, *x.shape]: every rank's x, in group-rank order. (gloo wants the output concatenated along dim 0.)"""
    out = torch.empty((info.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    with warnings.catch_warnings():  # torch >= 2.13 renames all_gather_into_tensor; 2.11 has only the old name
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(out, x.contiguous(), group=info.group)
    return out.view(info.size, *x.shape)


def reduce_scatter_seq(x: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """x is [P, *shape]; returns sum over ranks of x[my rank]."""
    out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.reduce_scatter_tensor(out, x.contiguous().flatten(0, 1), group=info.group)
    return out


class AllToAll:
    """One all-to-all in flight (async_op=True): dim 0 of `send` is split into one slice per rank. NCCL runs it on
    its own stream after the current stream's work so far; wait() makes the current stream wait for it. The send and
    receive buffers stay referenced here until wait(), so the caching allocator cannot hand their memory to the
    compute stream while the transfer may still read or write it (no record_stream needed). `label` names the
    transfer in profiles."""

    def __init__(self, send: torch.Tensor, info: GroupInfo, label: str):
        if not send.is_contiguous():
            raise RuntimeError(f"internal error: all-to-all buffer {label} of shape {tuple(send.shape)} is not "
                               "contiguous")
        self.label = label
        self.send = send
        self.recv = torch.empty_like(send)
        with torch.profiler.record_function(f"cp_a2a_start:{label}"):
            self.work = dist.all_to_all_single(self.recv, send, group=info.group, async_op=True)

    def wait(self) -> torch.Tensor:
        with torch.profiler.record_function(f"cp_a2a_wait:{self.label}"):
            self.work.wait()
        self.send = self.work = None
        return self.recv


class CollectiveExchange:
    """The exchange interface of head_groups.A2AAttention (reserve / buffer / publish / pull / release) over
    torch.distributed's all-to-all (NCCL on GPUs, gloo on CPU): a region is an ordinary tensor, and pull() starts
    the group's all-to-all.
    copy_engine_a2a.CopyEngineExchange is the same interface over the copy engines."""

    transport = "collective"
    keeps_own_row = False  # all_to_all_single sends a rank its own row too

    def __init__(self, info: GroupInfo):
        self.info = info

    def reserve(self, nbytes: dict[str, int]) -> None:
        """The regions' sizes (every rank the same); collectives need no buffer of their own."""

    def buffer(self, region: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def publish(self, region: str, group: int | None = None) -> None:
        """Nothing to signal: the all-to-all itself pairs the ranks."""

    def pull(self, region: str, group: int, send: torch.Tensor, label: str, exposed: bool = False,
             own=None) -> AllToAll:
        return AllToAll(send, self.info, label)

    def release(self, region: str) -> None:
        """Nothing to acknowledge: every buffer is the call's own."""


def all_to_all_dim0(x: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """x is [P, ...]: slice p goes to rank p; returns [P, ...] with slice p from rank p."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=info.group)
    return out
