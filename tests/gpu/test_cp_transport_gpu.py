"""The copy-engine ring (copy_engine.py) and a2a exchange (copy_engine_a2a.py) against NCCL's send/recv and
all-to-all on 2+ GPUs: the same call through both
transports gives bitwise the same output (a transport moves bytes, it does no arithmetic; forward kernels are
deterministic) and gradients within the backward kernels' own run-to-run spread (their dq sums use atomics), and the
whole-sequence float64 reference agrees with both. A hop that read a buffer being rewritten
would be far off. Two calls run their forwards before their backwards, as a model's layers do. Causal p2p and a
windowed ring wider than a chunk, a2a in one and two head groups (causal: the load-balanced token order; no mask:
rank order), on 4 GPUs where visible, else 2."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

from spawn_ranks import free_port, spawn_ranks, teardown, write_gathered

pytestmark = pytest.mark.gpu

# (comm, mask, window, a2a head groups); (700, 0) reaches past the neighbouring chunk: window_ring
CASES = [("p2p", "causal", (-1, 0), None), ("p2p", "causal", (700, 0), None), ("a2a", "causal", (-1, 0), 1),
         ("a2a", "causal", (-1, 0), 2), ("a2a", "no_mask", (-1, -1), 2)]


def _worker(rank: int, world: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    from attn_dispatch import context_parallel as cp
    from attn_dispatch.backends import AttnAux, AttnConfig
    from attn_dispatch.context_parallel import copy_engine
    from attn_dispatch.context_parallel._comm import group_info
    from reference import reference_attention

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    results = []
    try:
        for comm, mask, window, groups in CASES:
            g = torch.Generator(device="cuda").manual_seed(11)
            s, h, d = 512 * world, 4 * world, 64
            whole = [torch.randn(1, s, h, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4)]
            local = [cp.shard(t, "bshd", world, rank) for t in whole]
            cfg = AttnConfig(attn_mask_type=mask, window_size=window, softmax_scale=d ** -0.5)
            kwargs = dict(cp_group=dist.group.WORLD, cp_comm_type=comm, cp_a2a_head_groups=groups)
            got = {}
            for transport in ("nccl", "copy_engine"):
                os.environ[copy_engine.TRANSPORT_ENV] = transport
                # two layers, both forwards before both backwards, as a model runs them: the second call's hops
                # reuse the ring's buffers while the first call's saved tensors wait for its backward
                q, k, v = (t.clone().requires_grad_() for t in local[:3])
                q2, k2, v2 = (t.clone().requires_grad_() for t in (local[1], local[2], local[0]))
                out = cp.attention(None, q, k, v, AttnAux(), cfg, **kwargs)
                out2 = cp.attention(None, q2, k2, v2, AttnAux(), cfg, **kwargs)
                torch.autograd.backward([out2, out], [local[3], local[3]])
                got[transport] = [out.detach(), q.grad, k.grad, v.grad, out2.detach(), q2.grad, k2.grad, v2.grad]
            same = torch.equal(got["nccl"][0], got["copy_engine"][0]) and \
                torch.equal(got["nccl"][4], got["copy_engine"][4])
            apart = [float((a.double() - b.double()).norm() / b.double().norm())
                     for i, (a, b) in enumerate(zip(got["nccl"], got["copy_engine"])) if i % 4]
            leaves = [t.double().requires_grad_() for t in whole[:3]]
            ref, _ = reference_attention(*leaves, attn_mask_type=mask, window_size=window, softmax_scale=d ** -0.5)
            ref.backward(whole[3].double())
            refs = [cp.shard(t, "bshd", world, rank) for t in (ref.detach(), *(x.grad for x in leaves))]
            errs = [float((a.double() - b).norm() / b.norm()) for a, b in zip(got["copy_engine"][:4], refs)]
            results.append({"case": f"{comm} {mask} {window} G={groups}", "out_bitwise_same": same,
                            "grads_apart": apart, "rel_errors": errs})
        os.environ[copy_engine.TRANSPORT_ENV] = "auto"
        results.append({"self_check": copy_engine.self_check(group_info(dist.group.WORLD),
                                                             torch.device("cuda", rank))})
    except Exception as exc:  # noqa: BLE001 - reported through the JSON, on every rank
        results.append({"error": f"{type(exc).__name__}: {exc}"})
    write_gathered(results, world, rank, out_path)
    teardown()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_copy_engine_ring_matches_nccl():
    world = 4 if torch.cuda.device_count() >= 4 else 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        ranks = spawn_ranks(_worker, (world, free_port(), out), world, out, "copy-engine ring", 300)
    assert not isinstance(ranks, str), ranks
    for rank, rows in enumerate(ranks):
        for row in rows:
            assert "error" not in row, (rank, row)
            if "case" in row:
                assert row["out_bitwise_same"], (rank, row)
                assert max(row["grads_apart"]) < 5e-3, (rank, row)
                assert max(row["rel_errors"]) < 2e-2, (rank, row)
            else:
                assert row["self_check"] is None, (rank, row)
