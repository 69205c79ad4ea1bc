"""benchmarks/bench_cp_fp8.py: what its checks fail on (built from real scaling states and the FP8 criterion), its
timing order, its exit status, and its dry run over gloo (the whole pipeline, calls outside FP8)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attn_dispatch.fp8 import DelayedScaling, FP8ScalingState, Float8CurrentScaling
from attn_dispatch.fp8.state import BACKWARD, FORWARD, SLOTS

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_cp_fp8 as bench  # noqa: E402

AMAXES = {"q": 3.0, "k": 2.5, "v": 4.0, "s": 0.2, "o": 1.7, "do": 0.9, "dp": 0.3, "dq": 0.6, "dk": 0.8, "dv": 1.1}


def _trained(recipe, steps=3, scale_amax=None):
    """A state after `steps` forward and backward updates with AMAXES (times scale_amax[slot] where given)."""
    st = FP8ScalingState(recipe)
    for step in range(steps):
        for name in SLOTS:
            st.amax_slot(name).fill_(AMAXES[name] * (1 + 0.1 * step) * (scale_amax or {}).get(name, 1.0))
        st.update(FORWARD)
        st.update(BACKWARD)
    return st


def _report(cp_state, one_state, other_rank=None):
    mine = (cp_state.scale, cp_state.amax_history)
    return bench.state_report(cp_state, one_state, [mine, other_rank or (mine[0].clone(), mine[1].clone())])


def _metrics(rel_noise, seed=0):
    g = torch.Generator().manual_seed(seed)
    want = torch.randn(4, 64, 8, generator=g, dtype=torch.float64)
    return bench.metrics(want + rel_noise * torch.randn(want.shape, generator=g, dtype=torch.float64), want)


def _row(state, same=0.0, own=0.05, cp_noise=0.05, engine=bench.FP8_ENGINE):
    return {"rank": 0, "mask": "causal", "recipe": "delayed_hybrid", "engine": engine,
            "single_engine": bench.FP8_ENGINE,
            "vs_fp32": {n: _metrics(cp_noise) for n in bench.TENSORS},
            "single_vs_fp32": {n: dict(_metrics(0.05), rel_l2=own) for n in bench.TENSORS},
            "vs_single": {n: {"rel_l2": same, "bit_equal": same == 0.0} for n in bench.TENSORS}, "state": state}


@pytest.mark.parametrize("recipe", [DelayedScaling(fp8_dpa=True, amax_history_len=16),
                                    Float8CurrentScaling(fp8_dpa=True)], ids=["delayed", "current"])
def test_a_cp_run_that_tracks_the_single_gpu_run_passes(recipe):
    state = _report(_trained(recipe), _trained(recipe))
    assert state["ranks_equal"] and state["bit_equal_single"] and state["steps"] == 3
    assert bench.check_failures(_row(state, same=0.03), fp8=True) == []
    # the kernel-reported amaxes may round otherwise for h/2 heads: within STATE_RTOL
    near = _report(_trained(recipe), _trained(recipe, scale_amax={"o": 1.1, "dq": 0.95}))
    assert not near["bit_equal_single"] and near["scale_vs_single"]["o"] == pytest.approx(0.1)
    assert bench.check_failures(_row(near), fp8=True) == []


def test_what_a_check_fails_on():
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=16)
    ok = _report(_trained(recipe), _trained(recipe))

    def fails(row, *needles):
        found = bench.check_failures(row, fp8=True)
        assert found and all(any(n in f for f in found) for n in needles), found

    fails(_row(ok, cp_noise=3.0), "CP out vs float32 fails Transformer Engine's FP8 criterion")
    fails(_row(ok, same=0.06, own=0.05), "differs from the one-GPU FP8 call by 0.0600")
    fails(_row(ok, engine="flash_attn_4:cute"), "the CP module ran flash_attn_4:cute")
    fails(_row(None), "no FP8 scaling state")
    # a q amax that is not the max over both ranks' shards: its scale and history must match exactly
    fails(_row(_report(_trained(recipe), _trained(recipe, scale_amax={"q": 1 + 1e-6}))), "q scale differs",
          "q history differs")
    fails(_row(_report(_trained(recipe), _trained(recipe, scale_amax={"dv": 2.0}))), "dv scale differs")
    other = _trained(recipe, scale_amax={"o": 1.5})
    fails(_row(_report(_trained(recipe), _trained(recipe), (other.scale, other.amax_history))),
          "the ranks' scales or amax histories differ")
    fails(_row(_report(_trained(recipe), _trained(recipe, steps=4))), "recorded 3 (CP) and 4 (one GPU) steps")
    # the dry run's calls are not FP8: no engine or state to check, the numbers still are
    assert bench.check_failures(_row(None, engine="unfused:pytorch"), fp8=False) == []
    assert bench.check_failures(_row(None, same=0.2, engine="unfused:pytorch"), fp8=False)


def test_slot_differences():
    want = torch.zeros(2, len(SLOTS))
    want[:, 0] = torch.tensor([2.0, 4.0])
    got = want.clone()
    got[1, 0] = 3.0
    got[0, 3] = 1.0  # s: 0 where the reference has 0
    diff = bench.slot_rel_diff(got, want)
    assert diff["q"] == pytest.approx(0.25) and diff["k"] == 0.0 and diff["s"] == float("inf")


def test_timing_order_rotates():
    names = ["a", "b", "c", "d"]
    orders = [bench.rotated(names, r) for r in range(8)]
    assert all(sorted(o) == names for o in orders)
    for name in names:
        assert {o.index(name) for o in orders} == set(range(4))  # every position
        assert len({o[o.index(name) - 1] for o in orders if o.index(name)}) > 1  # not always after the same one


def test_exit_status_and_summary():
    assert bench.exit_status({"unable": "no GPU", "ok": False}) == 2
    assert bench.exit_status({"ok": True}) == 0 and bench.exit_status({"ok": False}) == 1
    ranks = [{"checks": [{"failures": []}], "timing": [{"failures": ["S=32768: the FP8 step ran x"]}],
              "errors": [{"rank": 1, "what": "check causal current_hybrid", "error": "RuntimeError: boom"}]},
             {"checks": [{"failures": ["rank 1 ..."]}], "timing": [], "errors": []}]
    s = bench.summarise(ranks)
    assert len(s["checks"]) == 2 and s["failures"] == [
        "rank 1 ...", "S=32768: the FP8 step ran x", "rank 1: check causal current_hybrid raised RuntimeError: boom"]


def test_cannot_run_without_cudnn_frontend(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn raises ImportError
    out = tmp_path / "x.json"
    assert bench.main(["--out", str(out)]) == 2
    assert "cudnn-frontend is not importable" in json.loads(out.read_text())["unable"]
    assert "CANNOT RUN: cudnn-frontend" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert bench.main(["--out", str(out)]) == 2
    assert "1 GPU(s) visible" in json.loads(out.read_text())["unable"]


def test_ranks_that_die_fail_the_run(monkeypatch, tmp_path):
    def die(*args, **kwargs):
        raise RuntimeError("process 1 terminated with signal SIGABRT")
    monkeypatch.setattr(bench.mp, "start_processes", die)
    out = tmp_path / "x.json"
    assert bench.main(["--device", "cpu", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["ok"] is False and "SIGABRT" in report["failures"][0]


def test_dry_run_on_cpu(tmp_path):
    """The whole pipeline (spawn, gloo, the modules with cp_group, checks, interleaved timing, JSON, tables)."""
    out = tmp_path / "cp_fp8.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_cp_fp8.py"), "--device", "cpu", "--out", str(out),
                           "--recipes", "delayed_hybrid,current_hybrid"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and not report["failures"] and report["machine"]["date"]
    recipes = ("delayed_hybrid", "current_hybrid")
    assert {(r["rank"], r["mask"], r["recipe"]) for r in report["checks"]} == {
        (rank, mask, recipe) for rank in (0, 1) for mask in bench.MASKS for recipe in recipes}
    assert all(r["state"] is None and r["vs_single"]["out"]["rel_l2"] < 1e-5 for r in report["checks"])
    assert [t["seqlen"] for t in report["timing"]] == [128, 256]
    for t in report["timing"]:
        assert len(t["samples_ms"]) == 2 and all(len(xs) == 5 for r in t["samples_ms"] for xs in r.values())
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| 256 |")  # the timing table is printed last
