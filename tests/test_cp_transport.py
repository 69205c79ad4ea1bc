"""Which ring transport a group gets (copy_engine.ring_for): the environment variable is validated, NCCL/gloo
send-recv is kept where the copy engines cannot run, and forcing them there raises with the reason."""
from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from attn_dispatch.context_parallel import copy_engine
from attn_dispatch.context_parallel._comm import Ring, group_info
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
