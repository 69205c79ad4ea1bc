"""Which ring transport a group gets (copy_engine.ring_for): the environment variable is validated, NCCL/gloo
send-recv is kept where the copy engines cannot run, and forcing them there raises with the reason. Where the
copy-engine ring places the pieces of a hop."""
from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from attn_dispatch.context_parallel import copy_engine
from attn_dispatch.context_parallel._comm import TAG_DK, TAG_DV, TAG_K, TAG_V, Ring, group_info
from spawn_ranks import free_port


@pytest.fixture()
def gloo_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield group_info(dist.group.WORLD, min_size=1)
    finally:
        dist.destroy_process_group()


def test_gloo_group_keeps_send_recv(gloo_group, monkeypatch):
    monkeypatch.delenv(copy_engine.TRANSPORT_ENV, raising=False)
    ring = copy_engine.ring_for(gloo_group, None, torch.device("cpu"))
    assert type(ring) is Ring
    assert copy_engine.transport_of(ring) == "gloo"
    monkeypatch.setenv(copy_engine.TRANSPORT_ENV, "nccl")
    assert type(copy_engine.ring_for(gloo_group, None, torch.device("cpu"))) is Ring


def test_forcing_copy_engines_where_they_cannot_run_raises(gloo_group, monkeypatch):
    monkeypatch.setenv(copy_engine.TRANSPORT_ENV, "copy_engine")
    with pytest.raises(RuntimeError, match="needs CUDA tensors and an NCCL group.*cpu tensors on a gloo group"):
        copy_engine.ring_for(gloo_group, None, torch.device("cpu"))


def test_unknown_transport_is_rejected_with_the_choices(gloo_group, monkeypatch):
    monkeypatch.setenv(copy_engine.TRANSPORT_ENV, "nvlink")
    with pytest.raises(ValueError, match="ATTN_DISPATCH_CP_TRANSPORT='nvlink'.*auto, nccl, copy_engine"):
        copy_engine.ring_for(gloo_group, None, torch.device("cpu"))


def test_explanations_say_how_ring_hops_travel(monkeypatch):
    monkeypatch.delenv(copy_engine.TRANSPORT_ENV, raising=False)
    cuda = torch.device("cuda", 0)
    describe = copy_engine.describe_transport
    ok, bad, fresh, reborn = (SimpleNamespace(group_name=n) for n in ("ok", "bad", "fresh", "ok"))
    assert describe("gloo", ok, torch.device("cpu")) == "ring hops: gloo's send/recv"
    assert "if the group's one-time self-check" in describe("nccl", fresh, cuda)
    monkeypatch.setitem(copy_engine._CHECKED, ("ok", cuda), (ok, None))
    assert describe("nccl", ok, cuda) == ("ring hops: pulled by the copy engines from symmetric memory (the "
                                          "group's self-check passed)")
    # a new group under a destroyed one's name is not the checked group
    assert "if the group's one-time self-check" in describe("nccl", reborn, cuda)
    monkeypatch.setitem(copy_engine._CHECKED, ("bad", cuda), (bad, "RuntimeError: no peer access"))
    assert describe("nccl", bad, cuda) == ("ring hops: NCCL's send/recv (the copy-engine self-check failed: "
                                           "RuntimeError: no peer access)")
    monkeypatch.setenv(copy_engine.TRANSPORT_ENV, "copy_engine")
    assert describe("nccl", bad, cuda).startswith("ring hops: none, the call raises")
    monkeypatch.setenv(copy_engine.TRANSPORT_ENV, "nccl")
    assert describe("nccl", ok, cuda) == "ring hops: NCCL's send/recv (ATTN_DISPATCH_CP_TRANSPORT=nccl)"


def _ring_over_host_pool(half_bytes: int, starts: int) -> copy_engine.CopyEngineRing:
    """A CopyEngineRing whose pool is a host buffer: its layout rules, without symmetric memory."""
    ring = object.__new__(copy_engine.CopyEngineRing)
    ring.slots = {}
    ring.stream, ring.device = object(), torch.device("cpu")  # a stream is only passed along
    ring.pool = SimpleNamespace(local=torch.zeros(2 * half_bytes, dtype=torch.uint8), half_bytes=half_bytes,
                                starts=starts, reserve=lambda nbytes, stream: None)
    return ring


def test_slots_follow_tag_order_and_received_pieces_sit_where_the_next_start_sends_them():
    k = torch.empty(4, 8, dtype=torch.bfloat16)          # 64 bytes, aligned to 256
    dk = torch.empty(4, 8, dtype=torch.float32)          # 128 bytes
    for starts in (0, 1, 6):
        ring = _ring_over_host_pool(4 * 256, starts)
        ring.reserve([(TAG_DK, dk.shape, dk.dtype), (TAG_K, k.shape, k.dtype), (TAG_V, k.shape, k.dtype),
                      (TAG_DV, dk.shape, dk.dtype)])
        assert ring.slots == {TAG_K: 0, TAG_V: 256, TAG_DK: 512, TAG_DV: 768}
        received = [ring.receive_buffer(tag, t.shape, t.dtype, t.device)
                    for tag, t in ((TAG_K, k), (TAG_V, k), (TAG_DK, dk))]
        pieces = [(t, tag) for t, tag in zip(received, (TAG_K, TAG_V, TAG_DK))]
        ring.pool.starts += 1  # the start that fills them has run; the next one sends them on
        base = (ring.pool.starts % 2) * ring.pool.half_bytes
        offsets = ring._layout(pieces)
        assert offsets == [0, 256, 512]
        for (t, _), off in zip(pieces, offsets):
            assert copy_engine._view(ring.pool.local, base + off, t).data_ptr() == t.data_ptr()


def test_unknown_tags_or_oversized_pieces_are_packed_one_after_another():
    ring = _ring_over_host_pool(2 * 256, 0)
    ring.reserve([(TAG_K, torch.Size([8]), torch.float32)])
    small = torch.empty(8)
    assert ring._layout([(small, TAG_K), (small, TAG_V)]) == [0, 256]  # TAG_V has no slot
    assert ring.receive_buffer(TAG_V, small.shape, small.dtype, small.device).data_ptr() != \
        ring.pool.local.data_ptr() + 256  # no slot: memory of its own
    with pytest.raises(RuntimeError, match="exceeds"):
        ring._layout([(torch.empty(600, dtype=torch.uint8), 99)])


def test_a2a_exchange_keeps_collectives_where_copy_engines_cannot_run(gloo_group, monkeypatch):
    from attn_dispatch.context_parallel import copy_engine_a2a
    monkeypatch.delenv(copy_engine.TRANSPORT_ENV, raising=False)
    exchange, why = copy_engine_a2a.copy_engine_exchange(gloo_group, torch.device("cpu"), 2)
    assert exchange is None and "needs CUDA tensors and an NCCL group (cpu tensors, a gloo group)" in why
    monkeypatch.setenv(copy_engine.TRANSPORT_ENV, "nccl")
    assert copy_engine_a2a.copy_engine_exchange(gloo_group, torch.device("cpu"), 2) == (
        None, "ATTN_DISPATCH_CP_TRANSPORT=nccl")
    monkeypatch.setenv(copy_engine.TRANSPORT_ENV, "copy_engine")
    with pytest.raises(RuntimeError, match="a2a exchange cannot run on the copy engines: needs CUDA tensors"):
        copy_engine_a2a.copy_engine_exchange(gloo_group, torch.device("cpu"), 2)


def test_a2a_exchange_signal_channels_never_overlap():
    """Acks and every (region, head group)'s ready flag have channels of their own, inside the signal pad."""
    from attn_dispatch.context_parallel import copy_engine_a2a as ce
    for world in (2, 4, 8):
        groups = ce.max_groups(world)
        assert groups >= 8, (world, groups)  # heads / (P G) >= 1 leaves at most 128 / 8 = 16 groups in practice
        exchange = object.__new__(ce.CopyEngineExchange)
        exchange.ready_stride = groups
        ready = [exchange._ready(r, g) for r in ce.REGIONS for g in range(groups)]
        acks = [ce._FIRST_ACK + i for i in range(len(ce.REGIONS))]
        channels = ready + acks
        assert len(set(channels)) == len(channels) and 0 not in channels  # 0: the self-check's barrier
        assert max(channels) < ce.channel_capacity(world)


def test_explanations_say_how_a2a_exchanges_travel(monkeypatch):
    from attn_dispatch.context_parallel import copy_engine_a2a
    monkeypatch.delenv(copy_engine.TRANSPORT_ENV, raising=False)
    cuda = torch.device("cuda", 0)
    describe = copy_engine_a2a.describe_exchange
    ok, bad, fresh = (SimpleNamespace(group_name=n) for n in ("ok", "bad", "fresh"))
    assert describe("gloo", ok, torch.device("cpu")) == "a2a exchanges: gloo's all-to-all"
    assert "if the group's one-time self-check" in describe("nccl", fresh, cuda)
    monkeypatch.setitem(copy_engine._CHECKED, ("ok", cuda), (ok, None))
    assert describe("nccl", ok, cuda) == ("a2a exchanges: pulled by the copy engines from symmetric memory (the "
                                          "group's self-check passed)")
    monkeypatch.setitem(copy_engine._CHECKED, ("bad", cuda), (bad, "RuntimeError: no peer access"))
    assert describe("nccl", bad, cuda) == ("a2a exchanges: NCCL's all-to-all (the copy-engine self-check failed: "
                                           "RuntimeError: no peer access)")
    monkeypatch.setenv(copy_engine.TRANSPORT_ENV, "copy_engine")
    assert describe("nccl", bad, cuda).startswith("a2a exchanges: none, the call raises")
    monkeypatch.setenv(copy_engine.TRANSPORT_ENV, "nccl")
    assert describe("nccl", ok, cuda) == "a2a exchanges: NCCL's all-to-all (ATTN_DISPATCH_CP_TRANSPORT=nccl)"
