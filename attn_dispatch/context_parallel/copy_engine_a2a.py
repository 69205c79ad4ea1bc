"""'a2a' exchanges by the GPUs' copy engines: each rank writes what it sends into a buffer every rank of the group maps
(torch's symmetric memory) and pulls its own slice of every peer's buffer with device-to-device copies on the
communication stream. Why not NCCL's all-to-all: its kernels need SMs, and beside attention kernels that fill every
SM they wait for them (copy_engine.py measured this for ring hops), so head groups could not overlap with attention.

An exchange has four regions, one per direction of a call: the forward's q, k, v in and out back, the backward's
dout in and dq, dk, dv back. Each holds [G, P, n]: head group g's slice for rank p at [g, p]. Per call and region:
  buffer():  wait until every peer acked its pulls of the region's previous contents, then hand it out to be written;
  publish(): after the compute stream wrote it (all groups, or group g), signal 'ready' to every peer;
  pull(g):   wait for each peer's 'ready', then copy its [g, me] into a fresh tensor on the communication stream
             (the copy engines, under another group's attention), or, where nothing would overlap the transfer,
             hand out a view of the peer's [g, me] for the consuming kernel to read over NVLink;
  release(): once the compute stream consumed every group, signal 'ack' to every peer.
A rank's own row is never written to its region: the caller keeps it where it lies. Signals are device flags
(put_signal / wait_signal), so no step waits for the host or for ranks it does not exchange with. Every rank makes
the same calls in the same order (the schedule depends on the head-group count only), which is what pairs each
signal with its wait.

torch's symmetric memory is a private API: a group uses this exchange only after copy_engine.self_check passed on
every rank; ATTN_DISPATCH_CP_TRANSPORT=nccl keeps NCCL's all-to-all.
"""
from __future__ import annotations

import functools
import math

import torch

from ._comm import GroupInfo
from .copy_engine import (_ALIGN, TRANSPORT_ENV, _aligned, _side_stream, describe_transport, requested_transport,
                          self_check)

REGIONS = ("fwd_in", "fwd_out", "bwd_in", "bwd_out")
_FIRST_ACK = 1  # ack channel of region r: _FIRST_ACK + r; ready channels follow (channel 0: unused here)
_FIRST_READY = _FIRST_ACK + len(REGIONS)
_DEFAULT_SIGNAL_PAD_BYTES = 2048  # torch 2.11's fixed size; later versions say theirs (get_signal_pad_size)


def channel_capacity(world: int) -> int:
    """Signal channels a symmetric allocation has for a group of `world` ranks (one 32-bit flag per rank each)."""
    import torch.distributed._symmetric_memory as symm_mem  # private API, gated by the self-check
    size = getattr(symm_mem, "get_signal_pad_size", lambda: _DEFAULT_SIGNAL_PAD_BYTES)()
    return size // (4 * world)


@functools.lru_cache(maxsize=None)  # fixed per process once allocations exist; asked on every a2a call
def max_groups(world: int) -> int:
    """The most head groups an exchange can signal for: a ready channel per region and group."""
    return (channel_capacity(world) - _FIRST_READY) // len(REGIONS)


class _Buffer:
    """One group's symmetric allocation, the regions' capacities in it, and the acks still due on it."""

    def __init__(self, info: GroupInfo, device: torch.device):
        self.info, self.device = info, device
        self.capacity = dict.fromkeys(REGIONS, 0)
        self.local = self.handle = None
        self.peers: list[torch.Tensor] = []
        self.retired: list = []  # earlier allocations: a peer may still be pulling from them
        self.acks_due = dict.fromkeys(REGIONS, False)

    def reserve(self, nbytes: dict[str, int]) -> None:
        """Collective (every rank asks the same sizes): every region holds at least its bytes."""
        if all(nbytes[r] <= self.capacity[r] for r in REGIONS):
            return
        import torch.distributed._symmetric_memory as symm_mem  # private API, gated by the self-check
        self.capacity = {r: _aligned(max(nbytes[r], self.capacity[r])) for r in REGIONS}
        if self.handle is not None:
            self.retired.append((self.local, self.handle, self.peers))
        total = max(sum(self.capacity.values()), _ALIGN)
        self.local = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
        self.handle = symm_mem.rendezvous(self.local, self.info.group)
        self.peers = [self.handle.get_buffer(r, (total,), torch.uint8) for r in range(self.info.size)]
        self.acks_due = dict.fromkeys(REGIONS, False)  # the peers ack the old allocation's pad, never read again

    def offset(self, region: str) -> int:
        return sum(self.capacity[r] for r in REGIONS[:REGIONS.index(region)])


class _Pulled:
    """A pull in flight: wait() makes the compute stream wait for it and gives the P slices (slice p from rank p)."""

    def __init__(self, event, parts: list[torch.Tensor], device_index: int):
        self.event, self.parts, self.device_index = event, parts, device_index

    def wait(self) -> list[torch.Tensor]:
        torch.cuda.current_stream(self.device_index).wait_event(self.event)
        parts, self.parts = self.parts, None
        return parts


class _Read:
    """Slices to be read in place (peers' memory): the compute stream already waits for them."""

    def __init__(self, parts: list[torch.Tensor]):
        self.parts = parts

    def wait(self) -> list[torch.Tensor]:
        parts, self.parts = self.parts, None
        return parts


# Keyed by (group name, device); an entry holds its group too: a destroyed group's name may be reused.
_BUFFERS: dict = {}


class CopyEngineExchange:
    """The exchange interface of head_groups (buffer / publish / pull), the bytes moved by the copy engines."""

    transport = "copy_engine"
    keeps_own_row = True  # a rank's own row is never pulled: the caller neither writes nor reads it in the region

    def __init__(self, info: GroupInfo, device: torch.device, groups: int):
        self.info, self.device, self.groups = info, device, groups
        key = (info.group.group_name, device)
        entry = _BUFFERS.get(key)
        if entry is None or entry.info.group is not info.group:
            entry = _BUFFERS[key] = _Buffer(info, device)
        self.buf = entry
        self.pulls = dict.fromkeys(REGIONS, 0)
        self.ready_per_group = dict.fromkeys(REGIONS, False)
        self.peers = [(info.rank + i) % info.size for i in range(1, info.size)]
        self.ready_stride = max_groups(info.size)

    def reserve(self, nbytes: dict[str, int]) -> None:
        self.buf.reserve(nbytes)

    def buffer(self, region: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The region as a [G, P, n] tensor to write into, once every peer is done pulling what it held."""
        buf = self.buf
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > buf.capacity[region]:
            raise RuntimeError(f"internal error: a2a region {region} needs {nbytes} bytes, {buf.capacity[region]} "
                               "reserved")
        if buf.acks_due[region]:
            compute, stream = self._streams()
            torch.cuda.set_stream(stream)
            try:
                for p in self.peers:
                    buf.handle.wait_signal(p, channel=_FIRST_ACK + REGIONS.index(region))
            finally:
                torch.cuda.set_stream(compute)
            compute.wait_stream(stream)
            buf.acks_due[region] = False
        start = buf.offset(region)
        return buf.local[start:start + nbytes].view(dtype).view(shape)

    def publish(self, region: str, group: int | None = None) -> None:
        """Tell every peer the region (every group, or `group`) is written, once the compute stream has written it."""
        compute, stream = self._streams()
        stream.wait_stream(compute)
        torch.cuda.set_stream(stream)
        try:
            for p in self.peers:
                self.buf.handle.put_signal(p, channel=self._ready(region, group or 0))
        finally:
            torch.cuda.set_stream(compute)
        self.ready_per_group[region] = group is not None

    def pull(self, region: str, group: int, send: torch.Tensor, label: str, exposed: bool = False, own=None):
        """Slice [group, me] of every peer's region; send is this rank's [P, n] of the same group. Where the call has
        nothing to overlap the transfer with (`exposed`: the first group in, the last one out), the compute stream
        waits for the peers and their slices are handed out as views of their memory, read by the kernel that
        consumes them (one pass over NVLink instead of a pull and a copy); else the copy engines pull them into
        fresh tensors on the communication stream. `own` stands for this rank's row in the result."""
        buf, info = self.buf, self.info
        me = send[info.rank]
        nbytes = me.numel() * me.element_size()
        at = send.data_ptr() - buf.local.data_ptr() + info.rank * nbytes  # the same place in every peer's buffer
        remote = {p: buf.peers[p][at:at + nbytes].view(me.dtype).view(me.shape) for p in self.peers}
        wait_ready = self.ready_per_group[region] or self.pulls[region] == 0
        self.pulls[region] += 1
        compute, stream = self._streams()
        parts = [me if own is None else own] * info.size
        if exposed and all(t.device == me.device for t in remote.values()):
            with torch.profiler.record_function(f"cp_a2a_read:{label}"):
                if wait_ready:
                    for p in self.peers:
                        buf.handle.wait_signal(p, channel=self._ready(region, group))
                for p in self.peers:
                    parts[p] = remote[p]
            return _Read(parts)
        for p in self.peers:
            parts[p] = torch.empty_like(me)
        stream.wait_stream(compute)  # the fresh tensors' memory may have been freed by work still queued there
        torch.cuda.set_stream(stream)
        try:
            with torch.profiler.record_function(f"cp_a2a_pull:{label}"):
                for p in self.peers:
                    if wait_ready:
                        buf.handle.wait_signal(p, channel=self._ready(region, group))
                    parts[p].copy_(remote[p])
            event = torch.cuda.Event()
            event.record(stream)
        finally:
            torch.cuda.set_stream(compute)
        return _Pulled(event, parts, self.device.index)

    def release(self, region: str) -> None:
        """The compute stream has consumed every group of the region this call: tell the peers (their next buffer()
        of it waits for this)."""
        if self.pulls[region] != self.groups:
            raise RuntimeError(f"internal error: a2a region {region} released after {self.pulls[region]} of "
                               f"{self.groups} pulls")
        self.pulls[region] = 0
        for p in self.peers:
            self.buf.handle.put_signal(p, channel=_FIRST_ACK + REGIONS.index(region))
        self.buf.acks_due[region] = True

    def _ready(self, region: str, group: int) -> int:
        return _FIRST_READY + REGIONS.index(region) * self.ready_stride + group

    def _streams(self):
        # the device index given: current_stream() without one looks the device up on the host
        return torch.cuda.current_stream(self.device.index), _side_stream(self.device)


def copy_engine_exchange(info: GroupInfo, device: torch.device, groups: int) -> tuple[CopyEngineExchange | None, str]:
    """The copy-engine exchange for an 'a2a' call where the environment allows it, the group runs NCCL on CUDA, the
    head groups fit the signal channels and the self-check passed; else (None, why not). Forcing it
    (ATTN_DISPATCH_CP_TRANSPORT=copy_engine) where it cannot run raises."""
    wanted = requested_transport()
    if wanted == "nccl":
        return None, f"{TRANSPORT_ENV}=nccl"
    why = None
    if device.type != "cuda" or info.backend != "nccl":
        why = f"needs CUDA tensors and an NCCL group ({device.type} tensors, a {info.backend} group)"
    elif groups > max_groups(info.size):
        why = (f"{groups} head groups need more signal channels than symmetric memory has for {info.size} ranks "
               f"(at most {max_groups(info.size)} groups)")
    else:
        reason = self_check(info, device)
        if reason is not None:
            why = f"the copy-engine self-check failed: {reason}"
    if why is None:
        return CopyEngineExchange(info, device, groups), ""
    if wanted == "copy_engine":
        raise RuntimeError(f"{TRANSPORT_ENV}=copy_engine, but the a2a exchange cannot run on the copy engines: {why}. "
                           "Unset it (auto falls back to NCCL) or fix the cause")
    return None, why


def describe_exchange(backend: str, group, device: torch.device) -> str:
    """How an 'a2a' call's exchanges travel, for explanations: never collective."""
    return describe_transport(backend, group, device, what="a2a exchanges", collective="all-to-all")
