"""The CP efficiency model (context_parallel/efficiency.py) against the recorded runs it is sourced from.

The one-GPU rates must be the files' one-GPU rows; the fitted link rate and per-call / per-step costs must be the
least-squares fit to cp_h100x2.json's 2-GPU rows (a local minimum on the fit's grid); every recorded row, the
4-GPU rows the fit never saw included, must be predicted within a stated error. The recorded p2p runs ran the
backward before the reversed ring (an exposed dK/dV hop after the last step): they are predicted with that schedule.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from attn_dispatch import AttentionParams
from attn_dispatch.cli import main
from attn_dispatch.context_parallel import efficiency as eff

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "cp"
FILES = ("cp_h100x2.json", "cp_h100x4.json")
WORST_ERROR = 0.13     # efficiency points (0.13 = 13%) on any row
MEAN_ERROR = 0.05


def _rows(name: str, world_sizes=(2, 4)):
    report = json.loads((RESULTS / name).read_text())
    cfg = report["config"]
    return [(row, cfg) for row in report["summary"] if row["world_size"] in world_sizes]


def _call(row, cfg) -> eff.Call:
    return eff.Call(row["world_size"], row["seqlen"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["batch"],
                    True, tuple(row["window"]) if row["window"] else None)


def _recorded(row, cfg, rates: eff.Rates = eff.H100_NVLINK) -> eff.Prediction:
    """The prediction for a recorded row, with the p2p backward it ran."""
    return eff.predict(row["comm"], _call(row, cfg), rates, exposed_dkv_hop=True)


def _fit_error(rates: eff.Rates) -> float:
    return sum((_recorded(row, cfg, rates).efficiency - row["efficiency"]) ** 2
               for row, cfg in _rows("cp_h100x2.json", (2,)) if row.get("cp_checks", True))


def test_one_gpu_rates_are_the_recorded_baselines():
    for name in FILES:
        for row, cfg in _rows(name, (1,)):
            call = dataclasses.replace(_call(row, cfg), cp_size=1)
            fwd, bwd = eff.one_gpu_ms(call, eff.H100_NVLINK)
            rel = 0.12 if row["window"] else 0.03  # the rates are the unwindowed rows'; a window runs 6-10% slower
            assert fwd == pytest.approx(row["fwd_ms"], rel=rel), (name, row["seqlen"], row["window"])
            assert fwd + bwd == pytest.approx(row["fwd_bwd_ms"], rel=rel), (name, row["seqlen"], row["window"])


@pytest.mark.parametrize("field,step", [("link_gbps", 10.0), ("call_ms", 0.05), ("step_ms", 0.02)])
def test_fitted_rates_minimise_the_error_on_the_2_gpu_runs(field, step):
    shipped = eff.H100_NVLINK
    best = _fit_error(shipped)
    for delta in (-step, step):
        moved = dataclasses.replace(shipped, **{field: getattr(shipped, field) + delta})
        assert _fit_error(moved) >= best, f"{field} {getattr(moved, field)} fits cp_h100x2.json better"


def test_every_recorded_row_is_predicted():
    errors = []
    for name in FILES:
        for row, cfg in _rows(name):
            pred = _recorded(row, cfg)
            errors.append((abs(pred.efficiency - row["efficiency"]), name, row["world_size"], row["seqlen"],
                           row["comm"], row["window"], round(pred.efficiency, 3), round(row["efficiency"], 3)))
    assert len(errors) == 27
    worst = max(errors)
    assert worst[0] <= WORST_ERROR, worst
    assert sum(e[0] for e in errors) / len(errors) <= MEAN_ERROR


def test_model_picks_the_measured_best_where_the_gap_is_wide():
    """4 GPUs at 32k: a2a measured 73% against 47% (p2p) and 53% (all_gather)."""
    rows = {(row["comm"], row["seqlen"]): row for row, _ in _rows("cp_h100x4.json", (4,)) if row["cp_checks"]}
    cfg = _rows("cp_h100x4.json")[0][1]
    preds = {comm: _recorded(rows[(comm, 32768)], cfg).efficiency for comm in eff.MODELLED}
    measured = {comm: rows[(comm, 32768)]["efficiency"] for comm in eff.MODELLED}
    assert max(preds, key=preds.get) == max(measured, key=measured.get) == "a2a"


def test_model_properties():
    call = eff.Call(4, 32768, 16, 16, 128)
    by_groups = [eff.predict("a2a", call, a2a_head_groups=g).efficiency for g in (1, 2, 4)]
    assert by_groups == sorted(by_groups) and by_groups[0] < by_groups[-1]  # overlap only helps
    for comm in eff.MODELLED:
        for size in (2, 4, 8):
            effs = [eff.predict(comm, dataclasses.replace(call, cp_size=size, seqlen=s)).efficiency
                    for s in (16384, 65536, 262144)]
            assert all(0 < e < 1 for e in effs) and effs == sorted(effs), (comm, size, effs)  # longer: better
    windowed = dataclasses.replace(call, cp_size=2, seqlen=131072, window=(4096, 0))
    assert eff.predict("p2p", windowed).one_gpu_fwd_bwd_ms < eff.predict("p2p", call).one_gpu_fwd_bwd_ms * 4
    with pytest.raises(ValueError, match="comm='a2a\\+p2p' has no efficiency model"):
        eff.predict("a2a+p2p", call)


def test_reversed_ring_hides_the_last_dkv_hop():
    """p2p's backward ends on the local diagonal block, under which the last dK/dV sum reaches its owner: less time
    than the schedule with that hop exposed at every ring size, and on 2 GPUs, where a step's compute covers each
    transfer, exactly one K/V block's transfer less. A window keeps the exposed hop (window_ring.py)."""
    for size in (2, 3, 4, 8):
        for seqlen in (32768, 131072):
            call = eff.Call(size, seqlen, 16, 16, 128)
            reversed_ring = eff.predict("p2p", call)
            exposed = eff.predict("p2p", call, exposed_dkv_hop=True)
            assert reversed_ring.fwd_ms == exposed.fwd_ms and reversed_ring.fwd_bwd_ms < exposed.fwd_bwd_ms
    call = eff.Call(2, 32768, 16, 16, 128)
    kv_ms = 2 * 16384 * 16 * 128 * 2 / (eff.H100_NVLINK.link_gbps * 1e6)
    gain = eff.predict("p2p", call, exposed_dkv_hop=True).fwd_bwd_ms - eff.predict("p2p", call).fwd_bwd_ms
    assert gain == pytest.approx(kv_ms)
    windowed = eff.Call(4, 131072, 16, 16, 128, window=(32768, 0))
    assert eff.predict("p2p", windowed) == eff.predict("p2p", windowed, exposed_dkv_hop=True)


def test_explain_prints_the_prediction(capsys):
    assert main(["explain", "--cp-size", "4", "--seqlen", "8192", "--mask", "causal", "--batch", "1",
                 "--platform", "h100-cudnn9"]) == 0
    text = capsys.readouterr().out
    assert "predicted CP efficiency on 4 GPUs" in text and "32768 tokens" in text
    assert "benchmarks/results/cp/cp_h100x2.json" in text
    params = AttentionParams(dtype="bf16", num_heads=16, max_seqlen_q=8192, attn_mask_type="causal", cp_size=4,
                             batch_size=1)
    for comm in eff.MODELLED:
        want = eff.predict(comm, eff.Call(4, 32768, 16, 16, 128), a2a_head_groups=1)  # the default: unpipelined
        assert f"{comm:<10} {100 * want.efficiency:5.1f}%" in text
    assert eff.explain_lines(params, a2a_head_groups=1)[3].count("1 head groups") == 1
    assert main(["explain", "--seqlen", "8192", "--platform", "h100-cudnn9"]) == 0
    assert "predicted CP efficiency" not in capsys.readouterr().out  # no CP, no prediction
