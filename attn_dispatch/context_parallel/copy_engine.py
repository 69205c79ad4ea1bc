"""Ring hops by the GPUs' copy engines: each rank pulls what its peer sends from a buffer every rank of the group
maps (torch's symmetric memory), with a device-to-device copy on the communication stream.

Why not NCCL's send/recv: its kernels need SMs, and beside attention kernels that fill every SM they wait for
them. On 4x H200 (NV18), a 64 MiB ring hop took 0.5-0.6 ms alone and 1.9 ms beside matmuls, while the same hop
pulled by the copy engines took 0.19 ms alone and 0.21 ms beside them; in a 32k ring the hops no longer hid under
the blocks' compute (benchmarks/results/README.md, context parallelism).

Protocol of one start() n, on the communication stream, with h = n % 2 (n counts the group's starts; every rank
makes the same starts in the same order, the ring's schedule depending on the step only):
  wait for the compute stream; wait for the ack of the rank that pulled our half h at start n - 2 (and of the one
  that pulled our other half at start n - 1, where we receive into it);
  copy our sends into our half h, each at its tag's slot, unless it is there already; signal 'ready h' to the
  rank that pulls from us;
  wait for 'ready h' from the rank we pull from; pull its half h into our receive tensors; signal it 'ack h'.
A receive tensor may be a view of our own other half at its tag's slot (receive_buffer): the next start, which
sends from that half, then sends it on without the copy. The copies that remain run as kernels (_copy_on_sms).
Signals are device flags between the two ranks of a hop (symmetric memory's put_signal / wait_signal), so a rank
waits only for its neighbours, not for the whole group: a late rank delays the ranks it feeds, as with NCCL.

torch's symmetric memory is a private API: a group uses this transport only after a collective self-check (a pull
of known values between neighbours) passed on every rank. ATTN_DISPATCH_CP_TRANSPORT=nccl keeps NCCL's send/recv.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..env import choice
from ._comm import GroupInfo, Ring

TRANSPORT_ENV = "ATTN_DISPATCH_CP_TRANSPORT"
TRANSPORTS = ("auto", "nccl", "copy_engine")
_ALIGN = 256  # bytes: each piece of a half starts at a multiple of this
_READY, _ACK = 1, 3  # signal channels: ready h = _READY + h, ack h = _ACK + h (channel 0: the self-check's barrier)


def requested_transport() -> str:
    return choice(TRANSPORT_ENV, TRANSPORTS, "auto")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class _Pool:
    """One group's symmetric buffer (two halves), its peers' mappings, and the count of starts so far."""

    def __init__(self, info: GroupInfo, device: torch.device):
        self.info, self.device = info, device
        self.half_bytes = 0
        self.starts = 0
        self.handle = self.local = None
        self.peers: list[torch.Tensor] = []
        self.retired: list = []  # earlier buffers: a peer may still read them when we grow
        self.puller: list[int | None] = [None, None]  # who pulled each half last, and has an ack for us

    def reserve(self, nbytes: int, stream) -> None:
        """Collective (every rank asks the same size): make each half hold at least nbytes. The acks still due on
        the old buffer's signal pads are taken first, on the communication stream."""
        if nbytes <= self.half_bytes:
            return
        # private API (self_check gates it), imported when a group first needs it: no cycle, 20 ms of import
        import torch.distributed._symmetric_memory as symm_mem
        half = _aligned(max(nbytes, 2 * self.half_bytes))
        if self.handle is not None:
            with torch.cuda.stream(stream):
                self.take_acks()
            self.retired.append((self.local, self.handle, self.peers))
        local = symm_mem.empty(2 * half, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(local, self.info.group)
        self.peers = [handle.get_buffer(r, (2 * half,), torch.uint8) for r in range(self.info.size)]
        self.local, self.handle, self.half_bytes = local, handle, half

    def take_acks(self, half: int | None = None) -> None:
        for h in (0, 1) if half is None else (half,):
            if self.puller[h] is not None:
                self.handle.wait_signal(self.puller[h], channel=_ACK + h)
                self.puller[h] = None


class _Pending:
    """A start in flight: its tensors stay referenced until the compute stream waits for it."""

    def __init__(self, event, keep, device_index: int):
        self.event, self.keep, self.device_index = event, keep, device_index

    def wait(self) -> None:
        torch.cuda.current_stream(self.device_index).wait_event(self.event)
        self.keep = None


# Keyed by (group name, device); an entry also holds its group, since a process that destroys its groups and makes
# new ones reuses their names: an entry of a destroyed group is made anew, never used.
_POOLS: dict = {}


class CopyEngineRing(Ring):
    """Ring's interface (start / wait / reserve), the bytes moved by the copy engines. See the module docstring."""

    def __init__(self, info: GroupInfo, stream, device: torch.device):
        super().__init__(info, stream)
        self.slots: dict[int, int] = {}
        key = (info.group.group_name, device)
        pool = _POOLS.get(key)
        if pool is None or pool.info.group is not info.group:
            pool = _POOLS[key] = _Pool(info, device)
        self.pool = pool
        self.device = device

    def reserve(self, pieces: list[tuple[int, torch.Size, torch.dtype]]) -> None:
        """Each tag gets a fixed place in a half (its slot), in tag order: what a rank receives into its own half
        is then where the next start sends it from, and a peer finds each piece without being told where."""
        self.slots, offset = {}, 0
        for tag, shape, dtype in sorted(pieces, key=lambda p: p[0]):
            self.slots[tag] = offset
            offset += _aligned(math.prod(shape) * dtype.itemsize)
        self.pool.reserve(offset, self.stream or _side_stream(self.device))

    def _layout(self, pieces: list[tuple[torch.Tensor, int]]) -> list[int]:
        """Byte offsets of pieces within a half: their slots where every tag has one that fits (the same answer on
        the sending and the pulling rank, which hold the same tags and shapes), else one after another."""
        sizes = [_aligned(t.numel() * t.element_size()) for t, _ in pieces]
        if all(tag in self.slots and self.slots[tag] + n <= self.pool.half_bytes
               for (_, tag), n in zip(pieces, sizes)):
            return [self.slots[tag] for _, tag in pieces]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += n
        if total > self.pool.half_bytes:
            raise RuntimeError(f"internal error: a ring hop of {total} bytes exceeds the {self.pool.half_bytes} "
                               "reserved")
        return offsets

    def receive_buffer(self, tag: int, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A view of this rank's half that the start after the next sends from, at the tag's slot: the next start
        pulls into it, the one after sends it on with no copy."""
        offset, nbytes = self.slots.get(tag), math.prod(shape) * dtype.itemsize
        if offset is None or offset + nbytes > self.pool.half_bytes:
            return torch.empty(shape, dtype=dtype, device=device)
        base = ((self.pool.starts + 1) % 2) * self.pool.half_bytes + offset
        return self.pool.local[base:base + nbytes].view(dtype).view(shape)

    def start(self, sends, recvs, *, send_to: int | None = None, recv_from: int | None = None) -> list:
        if not sends and not recvs:
            return []
        info, pool = self.info, self.pool
        src = (info.rank - 1) % info.size if recv_from is None else info.global_ranks.index(recv_from)
        dst = (info.rank + 1) % info.size if send_to is None else info.global_ranks.index(send_to)
        send_offsets, recv_offsets = self._layout(sends), self._layout(recvs)
        h = pool.starts % 2
        base = h * pool.half_bytes
        pool.starts += 1
        stream = self.stream or _side_stream(self.device)
        # the device index given, not looked up: current_stream() and torch.cuda.stream() without one cost tens of
        # microseconds of host time each, and a ring step's host time is on the critical path of short blocks
        compute = torch.cuda.current_stream(self.device.index)
        stream.wait_stream(compute)
        torch.cuda.set_stream(stream)
        try:
            # our half h is written below (unless every send is already in place), and a receive buffer lies in
            # the other half: wait until the ranks that pulled them last are done
            pool.take_acks(None if any(_inside(pool, t) for t, _ in recvs) else h)
            for (t, _), off in zip(sends, send_offsets):
                place = _view(pool.local, base + off, t)
                if place.data_ptr() != t.data_ptr():  # else received there by the previous start
                    _copy_on_sms(place, t)
            pool.handle.put_signal(dst, channel=_READY + h)
            pool.handle.wait_signal(src, channel=_READY + h)
            for (t, _), off in zip(recvs, recv_offsets):
                t.copy_(_view(pool.peers[src], base + off, t))
            pool.handle.put_signal(src, channel=_ACK + h)
            pool.puller[h] = dst
            event = torch.cuda.Event()
            event.record(stream)
        finally:
            torch.cuda.set_stream(compute)
        return [_Pending(event, (sends, recvs), self.device.index)]


def _copy_on_sms(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = src by an elementwise kernel (x * 1 is exact for every float, and for integers), not copy_(): a
    same-device copy_ is a cudaMemcpy, which beside attention kernels ran at 110-310 GB/s on 4x H200, as slow as
    the pull from a peer; the kernel on the high-priority stream takes ~0.1 ms for 128 MiB."""
    torch.mul(src, 1, out=dst)


def _inside(pool: _Pool, t: torch.Tensor) -> bool:
    if pool.local is None:
        return False
    start = pool.local.data_ptr()
    return start <= t.data_ptr() < start + 2 * pool.half_bytes


def _view(buf: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    return buf[offset:offset + nbytes].view(like.dtype).view(like.shape)


_SIDE: dict = {}


def _side_stream(device: torch.device):
    """High priority: the barrier kernel is scheduled ahead of the attention blocks waiting for SMs."""
    stream = _SIDE.get(device)
    if stream is None:
        stream = _SIDE[device] = torch.cuda.Stream(device=device, priority=-1)
    return stream


_CHECKED: dict = {}


def self_check(info: GroupInfo, device: torch.device) -> str | None:
    """Collective, once per group: None when every rank pulled its neighbour's known values through symmetric
    memory, else why not (the same answer on every rank)."""
    key = (info.group.group_name, device)
    if key in _CHECKED and _CHECKED[key][0] is info.group:
        return _CHECKED[key][1]
    reason = None
    try:
        pool = _Pool(info, device)
        pool.reserve(_ALIGN, torch.cuda.current_stream())
        mine = torch.full((64,), info.rank + 1, dtype=torch.int32, device=device)
        got = torch.empty_like(mine)
        _view(pool.local, 0, mine).copy_(mine)
        pool.handle.barrier(channel=0)
        got.copy_(_view(pool.peers[(info.rank - 1) % info.size], 0, mine))
        pool.handle.put_signal((info.rank + 1) % info.size, channel=_READY)  # the signals start() uses
        pool.handle.wait_signal((info.rank - 1) % info.size, channel=_READY)
        pool.handle.barrier(channel=0)
        expected = (info.rank - 1) % info.size + 1
        if not bool((got == expected).all()):
            reason = f"a pull from rank {(info.rank - 1) % info.size} read wrong values"
    except Exception as exc:  # noqa: BLE001 - any failure of the private API means: use NCCL
        reason = f"{type(exc).__name__}: {exc}"[:300]
    flag = torch.tensor([0 if reason else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=info.group)
    if reason is None and int(flag.item()) == 0:
        reason = "the self-check failed on another rank of the group"
    _CHECKED[key] = (info.group, reason)
    return reason


def ring_for(info: GroupInfo, stream, device: torch.device) -> Ring:
    """The ring transport for a group: copy engines where the group runs NCCL on CUDA, the environment allows it
    and the self-check passed; else NCCL's (or gloo's) send/recv."""
    wanted = requested_transport()
    if wanted == "nccl":
        return Ring(info, stream)
    if device.type != "cuda" or info.backend != "nccl":
        if wanted == "copy_engine":
            raise RuntimeError(f"{TRANSPORT_ENV}=copy_engine needs CUDA tensors and an NCCL group; this call has "
                               f"{device.type} tensors on a {info.backend} group. Unset it or set it to auto")
        return Ring(info, stream)
    reason = self_check(info, device)
    if reason is None:
        return CopyEngineRing(info, stream, device)
    if wanted == "copy_engine":
        raise RuntimeError(f"{TRANSPORT_ENV}=copy_engine, but the copy-engine ring cannot run on this group: "
                           f"{reason}. Unset it (auto falls back to NCCL) or fix the cause")
    return Ring(info, stream)


UNCHECKED = object()  # self_check_answer: the group has not run its self-check yet


def self_check_answer(group, device: torch.device):
    """What self_check answered for the group (None: passed; else why not), or UNCHECKED; never collective."""
    checked = _CHECKED.get((group.group_name, device))
    if checked is None or checked[0] is not group:
        return UNCHECKED
    return checked[1]


def describe_transport(backend: str, group, device: torch.device, what: str = "ring hops",
                       collective: str = "send/recv") -> str:
    """What ring_for gives a group (or copy_engine_a2a an a2a call: `what` and the `collective` it falls back to), for
    explanations: never collective (the self-check's answer only where a call already ran it)."""
    wanted = requested_transport()
    if wanted == "nccl":
        return f"{what}: NCCL's {collective} ({TRANSPORT_ENV}=nccl)"
    if device.type != "cuda" or backend != "nccl":
        if wanted == "copy_engine":
            return (f"{what}: none, the call raises: {TRANSPORT_ENV}=copy_engine needs CUDA tensors and an NCCL "
                    f"group ({device.type} tensors, a {backend} group)")
        return f"{what}: {backend}'s {collective}"
    reason = self_check_answer(group, device)
    if reason is UNCHECKED:
        fallback = "the call raises" if wanted == "copy_engine" else f"NCCL's {collective}"
        return (f"{what}: pulled by the copy engines from symmetric memory if the group's one-time self-check "
                f"(collective, at its first context-parallel call) passes, else {fallback}")
    if reason is None:
        return f"{what}: pulled by the copy engines from symmetric memory (the group's self-check passed)"
    if wanted == "copy_engine":
        return f"{what}: none, the call raises: {TRANSPORT_ENV}=copy_engine but the self-check failed: {reason}"
    return f"{what}: NCCL's {collective} (the copy-engine self-check failed: {reason})"


def transport_of(ring: Ring) -> str:
    """'copy_engine', or the group's backend ('nccl', 'gloo') whose send/recv the ring uses."""
    return "copy_engine" if isinstance(ring, CopyEngineRing) else ring.info.backend
