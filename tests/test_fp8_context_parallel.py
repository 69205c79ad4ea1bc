"""FP8 attention under context parallelism (cp_comm_type='a2a') on 2 gloo ranks, through the stand-in cudnn that
executes cuDNN's FP8 semantics on the CPU (tests/fp8_fake_cudnn.py).

One spawn runs every case; rank 0 writes what each rank measured to JSON and the tests read it. Each case runs a
few training steps of the same whole-sequence inputs twice: in one process on the FP8 engine (the single-GPU run),
and split over the 2 ranks (a2a, quantized before the exchange); both start from fresh scaling states. It compares
the local output and the q, k, v gradients with the single-rank run and with a float64 reference on the same
(un-quantized) inputs, the scaling state of the two ranks with each other and with the single-rank state, and the
amax history with the inputs' amaxes over both ranks. Refusals (a graph cuDNN rejects, a module call under p2p,
reduce_amax=False, an fp8_group that misses a CP rank) must raise on both ranks and leave the state as it was.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import sys
import time
import traceback

import pytest
import torch

from spawn_ranks import free_port, spawn_ranks, teardown, write_gathered

SPAWN_DEADLINE_S = 180
STEPS = 4
FWD_TOL, BWD_TOL = 0.08, 0.12  # vs float64, as tests/test_fp8.py (E4M3 rounding is 2^-4)
SAME_RUN_TOL = 1e-3  # vs the single-rank FP8 run: the same scales, so the same FP8 values but for rare rounding ties

CASES = {
    "delayed_causal_bshd": dict(recipe="delayed", fmt="bshd", mask="causal", h=4, hkv=4),
    "delayed_nomask_sbhd_gqa": dict(recipe="delayed", fmt="sbhd", mask="no_mask", h=4, hkv=2),
    "current_causal_bshd_gqa": dict(recipe="current", fmt="bshd", mask="causal", h=4, hkv=2),
    "hybrid_causal_bshd": dict(recipe="hybrid", fmt="bshd", mask="causal", h=4, hkv=4),
}
ERRORS = ("refused_graph", "module_p2p", "module_reduce_amax_off", "module_fp8_group_misses_a_rank")


# ----------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------
def _install_fake_cudnn():
    """What tests/test_fp8.py's `engine` fixture patches, done by hand in a spawned process."""
    import fp8_fake_cudnn as fake
    from attn_dispatch.backends import cudnn_fused as cd

    sys.modules["cudnn"] = fake.fake_cudnn()
    cd._on_device = lambda device: contextlib.nullcontext()
    cd._current_device = lambda: 0
    cd._stream = lambda device: 0
    cd._require_cuda = lambda q: None
    cd._empty_workspace = lambda size, device: torch.empty(size, dtype=torch.uint8)
    fake.Graph.refuse = set()
    return fake


def _recipe(name):
    from attn_dispatch.fp8 import DelayedScaling, Float8CurrentScaling

    if name == "current":
        return Float8CurrentScaling(fp8_format="E4M3", fp8_dpa=True)
    fmt = "HYBRID" if name == "hybrid" else "E4M3"
    return DelayedScaling(fp8_format=fmt, amax_history_len=4, fp8_dpa=True)


def _step_inputs(case, step):
    """Fresh inputs per step, but the last step repeats the one before: the scales of what cuDNN writes (O, dQ, dK,
    dV) come from the step before (Transformer Engine's rule), so the last step's FP8 error is the kernel's own,
    not that of an amax that grew since (which saturates: the single-rank run shows the same)."""
    b, s, d = 2, 32, 16
    g = torch.Generator().manual_seed(1000 * min(step, STEPS - 2) + 7)
    shape = (lambda n: (b, s, n, d)) if case["fmt"] == "bshd" else (lambda n: (s, b, n, d))
    q, k, v = (torch.randn(shape(n), generator=g).to(torch.bfloat16) for n in (case["h"], case["hkv"], case["hkv"]))
    dout = torch.randn(shape(case["h"]), generator=g).to(torch.bfloat16)
    return q, k, v, dout


def _cfg(case, d=16):
    from attn_dispatch.backends.base import AttnConfig

    causal = "causal" in case["mask"]
    return AttnConfig(qkv_format=case["fmt"], attn_mask_type=case["mask"], window_size=(-1, 0) if causal else (-1, -1),
                      softmax_scale=1.0 / math.sqrt(d))


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _rel_te(a, b):
    """Relative L2 error, or 1.0 where Transformer Engine's FP8 criterion fails (test_dpa_fp8_vs_f16: RMSE <= 0.11 x
    the values' range, as tests/test_fp8.py asserts)."""
    a, b = a.detach().double(), b.detach().double()
    both = torch.cat([a.flatten(), b.flatten()])
    if float((a - b).square().mean().sqrt()) > 0.11 * float(both.max() - both.min()):
        return 1.0
    return _rel(a, b)


def _run_case(case, engine, group):
    import torch.distributed as dist

    from attn_dispatch import context_parallel as cp
    from attn_dispatch.backends.base import AttnAux
    from attn_dispatch.backends.cudnn_fused_fp8 import FP8Call
    from attn_dispatch.fp8 import FP8ScalingState
    from reference import reference_attention

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    fmt, cfg = case["fmt"], _cfg(case)
    whole_state, cp_state = FP8ScalingState(_recipe(case["recipe"])), FP8ScalingState(_recipe(case["recipe"]))
    metrics = {}
    for step in range(STEPS):
        q, k, v, dout = _step_inputs(case, step)
        # the single-GPU run, on the whole sequence
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        aux = AttnAux()
        aux.extra["fp8"] = FP8Call(whole_state)
        out_w, _, _ = engine(*leaves, aux, cfg)
        out_w.backward(dout)
        grads_w = [t.grad for t in leaves]
        # the same step over the 2 ranks
        local = [cp.shard(t, fmt, size, rank).requires_grad_() for t in (q, k, v)]
        aux = AttnAux()
        aux.extra["fp8"] = FP8Call(cp_state, group=group, exchange_group=group)
        out = cp.attention(engine, *local, aux, cfg, cp_group=group, cp_comm_type="a2a")
        out.backward(cp.shard(dout, fmt, size, rank))
        if step == 0:  # q's scale after the first step comes from the amax over every rank's shard
            metrics["q_scale"] = float(cp_state.scale_of("q"))
            metrics["q_amax_whole"] = float(q.float().abs().max())
            metrics["q_amax_local"] = float(local[0].detach().float().abs().max())
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = reference_attention(q64, k64, v64, qkv_format=fmt, attn_mask_type=case["mask"],
                                 window_size=cfg.window_size)
    ref.backward(dout.double())
    # this rank's shard against the single-rank run; the whole tensors (gathered) against float64, as on one GPU
    metrics["out_vs_single"] = _rel(out, cp.shard(out_w.detach(), fmt, size, rank))
    metrics["out_vs_float64"] = _rel_te(cp.gather(out.detach(), fmt, group), ref)
    for name, got, single, want in zip(("dq", "dk", "dv"), local, grads_w, (q64, k64, v64)):
        metrics[f"{name}_vs_single"] = _rel(got.grad, cp.shard(single, fmt, size, rank))
        metrics[f"{name}_vs_float64"] = _rel_te(cp.gather(got.grad, fmt, group), want.grad)
    metrics["out_dtype"] = str(out.dtype)
    metrics["scale"] = cp_state.scale.tolist()
    metrics["history"] = cp_state.amax_history.tolist()
    metrics["single_scale"] = whole_state.scale.tolist()
    metrics["steps"] = cp_state.steps
    return metrics


def _expect(fn, *needles):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects the type and message
        msg = str(exc)
        return {"raised": type(exc).__name__, "message": msg[:800], "found": all(n in msg for n in needles)}
    return {"raised": None, "message": "", "found": False}


def _error_cases(engine, fake, group, singles):
    import torch.distributed as dist

    from attn_dispatch import DotProductAttention, context_parallel as cp
    from attn_dispatch.backends.base import AttnAux
    from attn_dispatch.backends.cudnn_fused_fp8 import FP8Call
    from attn_dispatch.fp8 import DelayedScaling, FP8ScalingState, fp8_autocast

    rank = dist.get_rank()
    case = CASES["delayed_causal_bshd"]
    cfg = _cfg(case)
    res = {}
    state = FP8ScalingState(_recipe("delayed"))
    q, k, v, _ = _step_inputs(case, 0)  # one trained step first: the state is not all ones
    aux = AttnAux()
    aux.extra["fp8"] = FP8Call(state, group=group, exchange_group=group)
    local = [cp.shard(t, "bshd", 2, rank).requires_grad_() for t in (q, k, v)]
    cp.attention(engine, *local, aux, cfg, cp_group=group, cp_comm_type="a2a").sum().backward()
    before = state.snapshot()
    fake.Graph.refuse = {"fwd"}
    engine._graphs.clear()
    res["refused_graph"] = _expect(lambda: cp.attention(engine, *(t.detach() for t in local), aux, cfg,
                                                        cp_group=group, cp_comm_type="a2a"),
                                   "stand-in refuses the FP8 fwd graph")
    fake.Graph.refuse = set()
    engine._failures.clear()
    res["refused_graph"]["state_kept"] = (torch.equal(state.scale, before[0])
                                          and torch.equal(state.amax_history, before[1]) and state.steps == before[2])

    def module_call(comm="a2a", recipe=DelayedScaling(fp8_dpa=True), fp8_group=None):
        m = DotProductAttention(4, 16, qkv_format="bshd", attn_mask_type="causal", cp_group=group, cp_comm_type=comm)
        try:
            with fp8_autocast(recipe=recipe, fp8_group=fp8_group):
                m(*local)
        finally:
            module_states.append(m.fp8_state)
    module_states: list = []
    res["module_p2p"] = _expect(lambda: module_call("p2p"), "cp_comm_type='p2p' is not implemented",
                                "use cp_comm_type='a2a'")
    res["module_reduce_amax_off"] = _expect(
        lambda: module_call(recipe=DelayedScaling(fp8_dpa=True, reduce_amax=False)), "reduce_amax=False")
    res["module_fp8_group_misses_a_rank"] = _expect(lambda: module_call(fp8_group=singles[rank]),
                                                    "miss cp_group's ranks")
    for name in ("module_p2p", "module_reduce_amax_off", "module_fp8_group_misses_a_rank"):
        res[name]["state_kept"] = True
    res["module_states_none"] = all(s is None for s in module_states)
    return res


def _worker(rank: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        fake = _install_fake_cudnn()
        from attn_dispatch.backends.cudnn_fused_fp8 import CudnnFP8Engine

        engine = CudnnFP8Engine()
        group = dist.new_group([0, 1])
        singles = [dist.new_group([0]), dist.new_group([1])]
        results = {}
        for name, case in CASES.items():
            start = time.perf_counter()
            try:
                results[name] = _run_case(case, engine, group)
            except Exception:  # noqa: BLE001 - reported per case
                results[name] = {"error": traceback.format_exc()[-3000:]}
            results[name]["seconds"] = time.perf_counter() - start
        try:
            results["errors"] = _error_cases(engine, fake, group, singles)
        except Exception:  # noqa: BLE001
            results["errors"] = {"error": traceback.format_exc()[-3000:]}
        write_gathered(results, 2, rank, out_path)
    finally:
        teardown()


# ----------------------------------------------------------------------------------------------
# Test side
# ----------------------------------------------------------------------------------------------
_RESULTS: list = []


def _results(tmp_path_factory):
    if not _RESULTS:
        _RESULTS.append(_spawn(str(tmp_path_factory.mktemp("fp8cp") / "results.json")))
    if isinstance(_RESULTS[0], str):
        pytest.fail(_RESULTS[0])
    return _RESULTS[0]


def _spawn(out_path: str):
    return spawn_ranks(_worker, (free_port(), out_path), 2, out_path, "FP8 context-parallel", SPAWN_DEADLINE_S)


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_a2a_matches_the_single_rank_run_and_float64(name, tmp_path_factory):
    per_rank = _results(tmp_path_factory)
    for rank, results in enumerate(per_rank):
        m = results[name]
        assert "error" not in m, f"rank {rank}:\n{m.get('error')}"
        assert m["out_dtype"] == "torch.bfloat16" and m["steps"] == STEPS
        for key in ("out", "dq", "dk", "dv"):
            assert m[f"{key}_vs_single"] < SAME_RUN_TOL, (rank, key, m)
        assert m["out_vs_float64"] < FWD_TOL, (rank, m)
        for key in ("dq", "dk", "dv"):
            assert m[f"{key}_vs_float64"] < BWD_TOL, (rank, key, m)


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_a2a_ranks_share_one_scaling_state(name, tmp_path_factory):
    """Both ranks hold the same scales and histories after the steps, and the same scales as the single-rank run;
    q's scale on each rank comes from the amax over both ranks' shards, not its own."""
    per_rank = _results(tmp_path_factory)
    r0, r1 = per_rank[0][name], per_rank[1][name]
    assert r0["scale"] == r1["scale"] and r0["history"] == r1["history"]
    assert r0["scale"] == pytest.approx(r0["single_scale"], rel=1e-5)
    assert len(set(r0["scale"])) > 3  # the scales moved off their initial 1.0 (fresh inputs, several roles)
    for m in (r0, r1):
        assert m["q_scale"] == pytest.approx(448.0 / m["q_amax_whole"], rel=1e-6)  # E4M3 max over the whole q
    assert min(r0["q_amax_local"], r1["q_amax_local"]) < r0["q_amax_whole"]  # one rank saw less on its own


@pytest.mark.parametrize("name", ERRORS)
def test_fp8_cp_refusals_raise_on_both_ranks_and_keep_the_state(name, tmp_path_factory):
    per_rank = _results(tmp_path_factory)
    for rank, results in enumerate(per_rank):
        errors = results["errors"]
        assert "error" not in errors, f"rank {rank}:\n{errors.get('error')}"
        outcome = errors[name]
        assert outcome["raised"] is not None and outcome["found"], (rank, outcome)
        assert outcome["state_kept"], (rank, outcome)
        assert errors["module_states_none"], rank
