"""A2AAttention over an exchange that keeps each rank's own row out of its buffer (as the copy-engine exchange does):
the rank packs, reads and places its own heads where they lie, and the result equals the collective exchange's, which
sends every row. Ranks run as threads over a shared in-process exchange whose buffers start as NaN, so a row read
but never written shows up in the output. Outputs and gradients against the unfused engine on the whole sequence in
float64."""
from __future__ import annotations

import threading

import pytest
import torch

from attn_dispatch import context_parallel as cp
from attn_dispatch.backends import AttnAux, AttnConfig, get_engine
from attn_dispatch.context_parallel import head_groups
from attn_dispatch.context_parallel._comm import GroupInfo


class _Pulled:
    def __init__(self, parts):
        self.parts = parts

    def wait(self):
        return self.parts


class _ThreadExchange:
    """The exchange interface over memory shared by threads; a barrier at each pull stands for the ready signal
    (every rank makes the same pulls in the same order)."""

    transport = "threads"

    def __init__(self, store: dict, barrier: threading.Barrier, rank: int, size: int, keeps_own_row: bool):
        self.store, self.barrier, self.rank, self.size = store, barrier, rank, size
        self.keeps_own_row = keeps_own_row

    def reserve(self, nbytes):
        pass

    def buffer(self, region, shape, dtype, device):
        buf = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.barrier.wait()  # every rank is done reading the region's previous contents
        self.store[(region, self.rank)] = buf
        return buf

    def publish(self, region, group=None):
        pass

    def pull(self, region, group, send, label, exposed=False, own=None):
        self.barrier.wait()
        parts = [self.store[(region, p)][group][self.rank].clone() for p in range(self.size)]
        if own is not None:
            parts[self.rank] = own
        return _Pulled(parts)

    def release(self, region):
        pass


def _run(fmt, mask, size, groups, keeps_own_row, q, k, v, dout):
    engine = get_engine("unfused:pytorch")
    cfg = AttnConfig(fmt, mask, (-1, 0) if mask == "causal" else (-1, -1), 0.3)
    store, barrier = {}, threading.Barrier(size)
    results, errors = [None] * size, []
    sd = 1 if fmt == "bshd" else 0
    balanced = mask == "causal"

    def rank_main(rank):
        try:
            leaves = [cp.shard(t, fmt, size, rank, load_balance=balanced).requires_grad_() for t in (q, k, v)]
            order = head_groups.SeqOrder(fmt, size, leaves[0].shape[sd], balanced)
            a2a = head_groups.A2AAttention(engine, cfg, AttnAux(), fmt, GroupInfo(None, size, rank, tuple(range(size))),
                                           order, groups, _ThreadExchange(store, barrier, rank, size, keeps_own_row))
            out, saved, states = a2a.forward(*(t.detach() for t in leaves), None)
            dq, dk, dv, _ = a2a.backward(cp.shard(dout, fmt, size, rank, load_balance=balanced), saved, states, None)
            results[rank] = (out, dq, dk, dv)
        except Exception as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("fmt,mask", [("bshd", "causal"), ("sbhd", "no_mask")])
@pytest.mark.parametrize("size,groups", [(2, 1), (2, 2), (4, 1)])
def test_keeping_the_own_row_matches_the_collective_exchange_and_the_reference(fmt, mask, size, groups):
    gen = torch.Generator().manual_seed(size * 10 + groups)
    b, s, h, d = 2, 8 * size, 4 * size, 8
    shape = (b, s, h, d) if fmt == "bshd" else (s, b, h, d)
    q, k, v, dout = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
    kept = _run(fmt, mask, size, groups, True, q, k, v, dout)
    sent = _run(fmt, mask, size, groups, False, q, k, v, dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    engine = get_engine("unfused:pytorch")
    cfg = AttnConfig(fmt, mask, (-1, 0) if mask == "causal" else (-1, -1), 0.3)
    res = engine.forward(*leaves, AttnAux(), cfg)
    grads = engine.backward(dout, *leaves, res.out, res.lse, res.state, AttnAux(), cfg)
    ref = [res.out, grads.dq, grads.dk, grads.dv]
    for rank in range(size):
        for name, got, same, want in zip(("out", "dq", "dk", "dv"), kept[rank], sent[rank], ref):
            assert torch.equal(got, same), f"rank {rank} {name}: keeping the own row changed the result"
            local = cp.shard(want.detach(), fmt, size, rank, load_balance=mask == "causal")
            torch.testing.assert_close(got, local, rtol=1e-10, atol=1e-10, msg=f"rank {rank} {name}")
