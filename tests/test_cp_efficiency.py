"""The CP efficiency model (context_parallel/efficiency.py) against the recorded runs it is sourced from.

The one-GPU rates must be the files' one-GPU rows; the fitted link rate and per-call / per-step costs must be the
least-squares fit to cp_h100x2.json's 2-GPU rows (a local minimum on the fit's grid); every recorded row, the
4-GPU rows the fit never saw included, must be predicted within a stated error. The recorded p2p runs ran the
backward before the reversed ring (an exposed dK/dV hop after the last step): they are predicted with that schedule.
The H200 rates: fitted to the newest 4x H200 run timed as a model's layers run (calls back to back), each row with the
transport it ran; every other such run is held out and predicted within a stated error, and the runs timed one call
from an idle GPU are predicted with the idle cost measured between two builds' runs timed both ways.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from attn_dispatch import AttentionParams
from attn_dispatch.backends import AttnAux, get_engine
from attn_dispatch.backends.base import AttnConfig
from attn_dispatch.cli import main
from attn_dispatch.context_parallel import efficiency as eff
from attn_dispatch.context_parallel import _comm, head_groups
from attn_dispatch.context_parallel._comm import GroupInfo

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "cp"
FILES = ("cp_h100x2.json", "cp_h100x4.json")
WORST_ERROR = 0.12     # efficiency points (0.12 = 12%) on any row, as the user guide states them
MEAN_ERROR = 0.04


def _rows(name: str, world_sizes=(2, 4)):
    return _rows_of(name, world_sizes)


def _call(row, cfg) -> eff.Call:
    return eff.Call(row["world_size"], row["seqlen"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["batch"],
                    True, tuple(row["window"]) if row["window"] else None)


def _recorded(row, cfg, rates: eff.Rates = eff.H100_NVLINK) -> eff.Prediction:
    """The prediction for a recorded row, with the p2p backward it ran."""
    return eff.predict(row["comm"], _call(row, cfg), rates, exposed_dkv_hop=True)


def _fit_error(rates: eff.Rates) -> float:
    return sum((_recorded(row, cfg, rates).efficiency - row["efficiency"]) ** 2
               for row, cfg in _rows("cp_h100x2.json", (2,)) if row.get("cp_checks", True))


def _rows_of(name: str, world_sizes):
    report = json.loads((RESULTS / name).read_text())
    return [(row, report["config"]) for row in report["summary"] if row["world_size"] in world_sizes]


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
    recorded = [comm for comm in eff.MODELLED if (comm, 32768) in rows]
    assert recorded == ["p2p", "a2a", "all_gather"]
    preds = {comm: _recorded(rows[(comm, 32768)], cfg).efficiency for comm in recorded}
    measured = {comm: rows[(comm, 32768)]["efficiency"] for comm in recorded}
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
    with pytest.raises(ValueError, match="comm='ring' has no efficiency model"):
        eff.predict("ring", call)


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
    assert eff.explain_lines(params, a2a_head_groups=1)[4].count("1 head groups") == 1
    assert "timing: one fwd+bwd from an idle GPU, the only timing recorded on this GPU" in text  # H100: no chained run
    assert main(["explain", "--seqlen", "8192", "--platform", "h100-cudnn9"]) == 0
    assert "predicted CP efficiency" not in capsys.readouterr().out  # no CP, no prediction


# --- H200 ---------------------------------------------------------------------------------------------------------
# Timed as a model's layers run (bench_cp.py --chain N > 1): the fit, and every other such run, held out. The a2a
# rows ran their exchanges by NCCL's all-to-all or (cp_h200x2_ce_a2a*.json) by the copy engines; the model has one
# a2a exchange for both.
H200_FIT = "cp_h200x4_sm_copy.json"
H200_EARLIER = "cp_h200x2_head_groups.json"  # p2p's backward before the reversed ring; a2a with 1 and 2 head groups
# One fwd+bwd from an idle GPU: two builds' --chain 1 runs, each against its chained run, then runs from before
# --chain existed, whose agreement check synced every call.
H200_IDLE_PAIRS = {"cp_h200x4_sm_copy_chain1.json": H200_FIT, "cp_h200x4_chain1.json": "cp_h200x4_chain4.json"}
H200_FROM_IDLE = (*H200_IDLE_PAIRS, "cp_h200x4.json", "cp_h200x4_transport.json", "cp_h200x4_transport_host.json",
                  "cp_h200x2.json", H200_EARLIER)
H200_NOT_PREDICTED = ("cp_h200x2_before.json",)  # a2a's host-side reorder regression, fixed before any other run
# efficiency points per file, (mean, worst) over its CP rows, as efficiency.py's notes and the user guide state them
H200_ERRORS = {H200_FIT: (0.019, 0.054),
               "cp_h200x4_zero_copy.json": (0.028, 0.068), "cp_h200x4_chain4.json": (0.031, 0.079),
               "cp_h200x2_ce_a2a.json": (0.055, 0.11), "cp_h200x2_ce_a2a_read.json": (0.04, 0.072),
               "cp_h200x2_ce_a2a_own.json": (0.039, 0.094),
               "cp_h200x4_sm_copy_chain1.json": (0.04, 0.076), "cp_h200x4_chain1.json": (0.037, 0.068),
               "cp_h200x4.json": (0.023, 0.054), "cp_h200x4_transport.json": (0.022, 0.049),
               "cp_h200x4_transport_host.json": (0.021, 0.027), "cp_h200x2.json": (0.018, 0.052),
               H200_EARLIER: (0.028, 0.069),
               # a2a with its one-pass row copies (the default) and, for the A/B, the per-chunk copies before them
               "cp_h200x2_fused_a2a.json": (0.01, 0.02), "cp_h200x2_pieces_a2a.json": (0.013, 0.018),
               "cp_h200x4_fused_a2a.json": (0.036, 0.092)}


def _chained(name: str) -> bool:
    return json.loads((RESULTS / name).read_text())["config"].get("chain", 1) > 1


def _h200_files() -> list[str]:
    return sorted(p.name for p in RESULTS.glob("cp_h200*.json") if p.name not in H200_NOT_PREDICTED)


def _h200_predicted(name: str, row, cfg, rates: eff.Rates = eff.H200_NVLINK) -> eff.Prediction:
    """Each row with the timing, schedule and ring transport it ran (rows without one: NCCL's send/recv)."""
    transport = "auto" if row["comm"] == "a2a" else row.get("transport", "nccl")
    return eff.predict(row["comm"], _call(row, cfg), rates, row.get("a2a_head_groups") or 1, transport=transport,
                       exposed_dkv_hop=name == H200_EARLIER, from_idle=not _chained(name))


def _h200_rows(names=None):
    """Every 2- and 4-GPU row the model has the schedule of: the earlier run's windowed a2a rows ran Ulysses, which a
    window within the neighbouring chunks no longer runs (cp_bands.key_exchange), so they are left out."""
    for name in _h200_files() if names is None else names:
        for row, cfg in _rows_of(name, (2, 4)):
            if not (name == H200_EARLIER and row["comm"] == "a2a" and row["window"]):
                yield name, row, cfg


def _h200_fit_error(rates: eff.Rates) -> float:
    return sum((_h200_predicted(name, row, cfg, rates).efficiency - row["efficiency"]) ** 2
               for name, row, cfg in _h200_rows((H200_FIT,)) if row["cp_checks"])


def test_h200_runs_are_sorted_by_timing():
    """A new run is fitted, held out or checked by its timing, never silently skipped."""
    files = _h200_files()
    assert H200_FIT in files and _chained(H200_FIT)
    assert {name for name in files if not _chained(name)} == set(H200_FROM_IDLE)
    assert set(H200_ERRORS) == set(files)
    assert "cp_h200x4_zero_copy.json" in files and _chained("cp_h200x4_zero_copy.json")


def test_h200_one_gpu_rates_are_the_recorded_baselines():
    """Unwindowed rows ran cuDNN SDPA: one forward rate for 32k (662 TFLOP/s) and 128k (555) is within 10% of each,
    fwd+bwd within 4% (the runs of the same call differ by up to 3%, chained or not); the windowed rows ran
    FlashAttention-2, whose own rates the windowed calls take."""
    seen = set()
    for name in _h200_files():
        for row, cfg in _rows_of(name, (1,)):
            call = dataclasses.replace(_call(row, cfg), cp_size=1)
            fwd, bwd = eff.one_gpu_ms(call, eff.H200_NVLINK)
            seen.add((name, row["engine"], bool(row["window"])))
            assert fwd == pytest.approx(row["fwd_ms"], rel=0.03 if row["window"] else 0.1), (name, row["seqlen"])
            assert fwd + bwd == pytest.approx(row["fwd_bwd_ms"], rel=0.04), (name, row["seqlen"], row["window"])
    assert {(engine, windowed) for _, engine, windowed in seen} == {("cudnn_fused:torch", False),
                                                                    ("flash_attn_2:torch", True)}
    assert {name for name, _, _ in seen} == set(_h200_files())
    windowed = eff.Call(1, 131072, 16, 16, 128, window=(4096, 0))
    at_cudnn_rates = dataclasses.replace(eff.H200_NVLINK, windowed_fwd_tflops=None, windowed_bwd_tflops=None)
    assert sum(eff.one_gpu_ms(windowed, eff.H200_NVLINK)) > 1.5 * sum(eff.one_gpu_ms(windowed, at_cudnn_rates))


@pytest.mark.parametrize("field,step", [("link_gbps", 5.0), ("nccl_ring_gbps", 5.0), ("call_ms", 0.01),
                                        ("step_ms", 0.01)])
def test_h200_fitted_rates_minimise_the_error_on_the_chained_run(field, step):
    shipped = eff.H200_NVLINK
    best = _h200_fit_error(shipped)
    assert len([row for _, row, _ in _h200_rows((H200_FIT,)) if row["cp_checks"]]) == 18
    for delta in (-step, step):
        moved = dataclasses.replace(shipped, **{field: getattr(shipped, field) + delta})
        assert _h200_fit_error(moved) >= best, f"{field} {getattr(moved, field)} fits {H200_FIT} better"


def test_h200_link_rate_and_call_cost_trade_off():
    """What efficiency.py says of the fit: other link rates, each with its best call cost, fit within 1% of the least
    squared error from 310 to 400 GB/s; the rate fitted to the runs that synced every call, 185, does not."""
    best = _h200_fit_error(eff.H200_NVLINK)

    def least(link):
        return min(_h200_fit_error(dataclasses.replace(eff.H200_NVLINK, link_gbps=link, call_ms=c / 100))
                   for c in range(20, 71))
    assert all(least(link) <= 1.01 * best for link in (310.0, 400.0))
    assert least(185.0) > 1.3 * best


def test_h200_idle_cost_is_the_same_builds_difference():
    """idle_ms: the mean fwd+bwd difference between a build's --chain 1 run and its chained run, row by row."""
    def key(row):
        return (row["world_size"], row["seqlen"], row["comm"], str(row["window"]), row.get("transport"),
                row["cp_checks"])
    diffs = []
    for idle_name, chained_name in H200_IDLE_PAIRS.items():
        assert not _chained(idle_name) and _chained(chained_name)
        chained = {key(row): row for row, _ in _rows_of(chained_name, (2, 4))}
        diffs += [row["fwd_bwd_ms"] - chained[key(row)]["fwd_bwd_ms"] for row, _ in _rows_of(idle_name, (2, 4))]
    assert len(diffs) == 4 and min(diffs) > 0
    assert eff.H200_NVLINK.idle_ms == pytest.approx(sum(diffs) / len(diffs), abs=0.005)


@pytest.mark.parametrize("rates", [eff.H100_NVLINK, eff.H200_NVLINK], ids=["h100", "h200"])
def test_from_idle_adds_the_idle_cost_to_the_backward(rates):
    """A fwd+bwd from an idle GPU costs idle_ms more, all of it after the forward; without a chained run on the GPU
    (the H100) its costs are already from-idle ones, and both timings are predicted alike."""
    for comm in eff.MODELLED:
        for call in (eff.Call(4, 32768, 16, 16, 128), eff.Call(2, 131072, 16, 16, 128, window=(4096, 0))):
            chained, idle = eff.predict(comm, call, rates), eff.predict(comm, call, rates, from_idle=True)
            assert idle.fwd_ms == chained.fwd_ms
            assert idle.fwd_bwd_ms == pytest.approx(chained.fwd_bwd_ms + (rates.idle_ms or 0.0))
            assert idle.efficiency <= chained.efficiency


def test_h200_copy_engine_rate_is_the_measured_hop_and_hidden_in_every_row():
    """64 MiB pulled in 0.21 ms beside matmuls; no recorded row could have fitted it: halving it changes none."""
    assert eff.H200_NVLINK.copy_engine_gbps == pytest.approx(64 * 2 ** 20 / 0.21e-3 / 1e9, rel=0.01)
    halved = dataclasses.replace(eff.H200_NVLINK, copy_engine_gbps=eff.H200_NVLINK.copy_engine_gbps / 2)
    rows = [(name, row, cfg) for name, row, cfg in _h200_rows()
            if row.get("transport") == "copy_engine" and row["comm"] != "a2a"]
    assert sum(name == H200_FIT for name, _, _ in rows) == 6
    for name, row, cfg in rows:
        assert _h200_predicted(name, row, cfg, halved) == _h200_predicted(name, row, cfg)


def test_every_h200_row_is_predicted():
    errors = {name: [] for name in _h200_files()}
    for name, row, cfg in _h200_rows():
        pred = _h200_predicted(name, row, cfg)
        errors[name].append((abs(pred.efficiency - row["efficiency"]), row["world_size"], row["seqlen"], row["comm"],
                             row["window"], row.get("transport"), row.get("a2a_head_groups"),
                             round(pred.efficiency, 3), round(row["efficiency"], 3)))
    for name, rows in errors.items():
        mean, worst = H200_ERRORS[name]
        assert rows, name
        assert max(rows)[0] <= worst, (name, max(rows))
        assert sum(e[0] for e in rows) / len(rows) <= mean, name
    chained = [e for name, rows in errors.items() if _chained(name) for e in rows]
    one_group = [e[0] for e in chained if (e[6] or 1) == 1]
    assert sum(e[0] for e in chained) / len(chained) <= 0.033
    # the worst: a2a+p2p on 4 GPUs at 32k, predicted 81% and measured 72% (no fitted row ran a2a+p2p)
    assert sum(one_group) / len(one_group) <= 0.026 and max(one_group) <= 0.092
    # head groups (opt-in) are predicted high: attention on fewer heads per call runs slower than the model has it
    assert all(eff_pred >= measured for *_, groups, eff_pred, measured in chained if (groups or 1) > 1)


def test_h200_4_gpu_32k_rows():
    """4 GPUs at 32k, back to back, where the comm types and ring transports differ most: each prediction within 3
    points of the fit run's row, in the measured order (a2a, then p2p by the copy engines, then by NCCL)."""
    call = eff.Call(4, 32768, 16, 16, 128)
    measured = {(row["comm"], row.get("transport")): row["efficiency"] for row, _ in _rows_of(H200_FIT, (4,))
                if row["seqlen"] == 32768}
    preds = {("p2p", "copy_engine"): eff.predict("p2p", call, eff.H200_NVLINK).efficiency,
             ("p2p", "nccl"): eff.predict("p2p", call, eff.H200_NVLINK, transport="nccl").efficiency,
             ("a2a", "nccl collectives"): eff.predict("a2a", call, eff.H200_NVLINK).efficiency}
    assert set(preds) == set(measured)
    for key, pred in preds.items():
        assert pred == pytest.approx(measured[key], abs=0.03), key
    assert sorted(preds, key=preds.get) == sorted(measured, key=measured.get)
    assert eff.predict("p2p", call, eff.H200_NVLINK, transport="copy_engine").efficiency == preds["p2p",
                                                                                                  "copy_engine"]
    modelled = {comm: eff.predict(comm, call, eff.H200_NVLINK).efficiency for comm in eff.MODELLED}
    assert max(modelled, key=modelled.get) == "a2a"
    long_call = dataclasses.replace(call, seqlen=131072)  # 7 ms forward blocks hide either transport's hops
    assert (eff.predict("p2p", long_call, eff.H200_NVLINK, transport="nccl")
            == eff.predict("p2p", long_call, eff.H200_NVLINK, transport="copy_engine"))


def test_transport_choice():
    assert eff.ring_transport(eff.H200_NVLINK) == "copy_engine"  # what auto runs on NVLink
    assert eff.ring_transport(eff.H100_NVLINK) == "nccl"  # no copy-engine rate measured there
    assert eff.ring_transport(eff.H200_NVLINK, "nccl") == "nccl"
    with pytest.raises(ValueError, match="transport='copy_engine': no copy-engine rate was measured on H100"):
        eff.predict("p2p", eff.Call(4, 32768, 16, 16, 128), eff.H100_NVLINK, transport="copy_engine")
    with pytest.raises(ValueError, match="transport='nvlink' is not modelled; use one of auto, copy_engine, nccl"):
        eff.predict("p2p", eff.Call(4, 32768, 16, 16, 128), eff.H200_NVLINK, transport="nvlink")


def test_a2a_counts_the_bytes_its_all_to_alls_send(monkeypatch):
    """The model's a2a exchanges are the bytes A2AAttention hands its all-to-alls (q, k, v, then out forward; dout,
    then dq, dk, dv backward), less the slice each rank keeps: with compute free and no fixed costs, a direction's
    time is its bytes x (P-1)/P at the link rate. GQA, so that q's and k/v's sizes differ."""
    sent: dict[str, int] = {}

    class Counted:  # stands in for the all-to-all: counts what is sent, hands it back as received (same shape)
        def __init__(self, send, info, label):
            direction = label.split("_")[0]
            sent[direction] = sent.get(direction, 0) + send.numel() * send.element_size()
            self.recv = send.clone()

        def wait(self):
            return self.recv

    monkeypatch.setattr(_comm, "AllToAll", Counted)
    size, batch, seqlen, heads, kv_heads, head_dim = 2, 2, 16, 8, 4, 16
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(batch, seqlen // size, heads, head_dim, generator=gen)
    k, v = (torch.randn(batch, seqlen // size, kv_heads, head_dim, generator=gen) for _ in range(2))
    order = head_groups.seq_order("bshd", size, seqlen // size, True)
    a2a = head_groups.A2AAttention(get_engine("unfused:pytorch"), AttnConfig("bshd", "causal", (-1, 0), 0.25),
                                   AttnAux(), "bshd", GroupInfo(None, size, 0, (0, 1)), order, 1)
    out, saved, states = a2a.forward(q, k, v, None)
    a2a.backward(torch.randn(out.shape, generator=gen), saved, states, None)
    comm_only = dataclasses.replace(eff.H200_NVLINK, fwd_tflops=1e30, bwd_tflops=1e30, call_ms=0.0, step_ms=0.0)
    pred = eff.predict("a2a", eff.Call(size, seqlen, heads, kv_heads, head_dim, batch, elem_bytes=4), comm_only)
    to_bytes = comm_only.link_gbps * 1e6 * size / (size - 1)
    assert pred.fwd_ms * to_bytes == pytest.approx(sent["fwd"])
    assert (pred.fwd_bwd_ms - pred.fwd_ms) * to_bytes == pytest.approx(sent["bwd"])


@pytest.mark.parametrize("rates", [eff.H100_NVLINK, eff.H200_NVLINK], ids=["h100", "h200"])
def test_a2a_p2p_composes_its_two_schedules(rates):
    """a2a+p2p with an a2a group of one is p2p; with the whole group as its a2a group, it is a2a in one head group:
    the same bytes each way (q, k, v in and out back; dout in and dq, dk, dv back)."""
    for size, seqlen, window in ((2, 32768, None), (4, 32768, None), (4, 131072, None), (8, 65536, (16384, 0))):
        call = eff.Call(size, seqlen, 16, 16, 128, window=window)
        single = eff.predict("a2a+p2p", dataclasses.replace(call, a2a_size=1), rates)
        assert single.fwd_bwd_ms == pytest.approx(eff.predict("p2p", call, rates).fwd_bwd_ms)
        if window is None:
            whole = eff.predict("a2a+p2p", dataclasses.replace(call, a2a_size=size), rates)
            a2a = eff.predict("a2a", call, rates, 1)
            assert whole.fwd_ms == pytest.approx(a2a.fwd_ms) and whole.fwd_bwd_ms == pytest.approx(a2a.fwd_bwd_ms)
    with pytest.raises(ValueError, match="call.a2a_size=3 must divide call.cp_size=4"):
        eff.predict("a2a+p2p", eff.Call(4, 32768, 16, 16, 128, a2a_size=3), rates)


def test_rates_follow_the_platform(capsys, monkeypatch):
    monkeypatch.delenv("ATTN_DISPATCH_CP_TRANSPORT", raising=False)
    assert eff.rates_for("NVIDIA H200") is eff.H200_NVLINK
    assert eff.rates_for("NVIDIA H100 80GB HBM3") is eff.rates_for("NVIDIA A100-SXM4-80GB") is eff.H100_NVLINK
    assert main(["explain", "--cp-size", "2", "--seqlen", "16384", "--mask", "causal", "--batch", "1",
                 "--platform", "h200-cudnn9"]) == 0
    text = capsys.readouterr().out
    assert "rates of H200" in text and f"benchmarks/results/cp/{H200_FIT}" in text and "cp_h100x2" not in text
    assert "timing: a model's layers back to back (bench_cp.py --chain 4)" in text
    assert f"from an idle GPU takes {eff.H200_NVLINK.idle_ms:.2f} ms more" in text
    for comm in eff.MODELLED:
        want = eff.predict(comm, eff.Call(2, 32768, 16, 16, 128), eff.H200_NVLINK)
        assert f"{comm:<10} {100 * want.efficiency:5.1f}%" in text
    assert main(["explain", "--cp-size", "2", "--seqlen", "16384", "--platform", "h100-cudnn9"]) == 0
    text = capsys.readouterr().out
    assert "rates of H100" in text and "cp_h200x" not in text


@pytest.mark.parametrize("env,shown,other", [(None, "copy_engine", "nccl"), ("nccl", "nccl", "copy_engine")])
def test_explain_predicts_the_transport_that_runs(capsys, monkeypatch, env, shown, other):
    """4 GPUs at 32k, where the transports differ: the ring lines take the transport the environment lets run, and
    name the other's prediction."""
    if env:
        monkeypatch.setenv("ATTN_DISPATCH_CP_TRANSPORT", env)
    else:
        monkeypatch.delenv("ATTN_DISPATCH_CP_TRANSPORT", raising=False)
    assert main(["explain", "--cp-size", "4", "--seqlen", "8192", "--mask", "causal", "--batch", "1",
                 "--platform", "h200-cudnn9"]) == 0
    text = capsys.readouterr().out
    call = eff.Call(4, 32768, 16, 16, 128)
    runs, alternative = (eff.predict("p2p", call, eff.H200_NVLINK, transport=t).efficiency for t in (shown, other))
    assert runs != alternative
    label = "NCCL send/recv" if other == "nccl" else "copy engines"
    assert f"p2p        {100 * runs:5.1f}%" in text and f"({label}: {100 * alternative:.1f}%)" in text
    assert ("pulled by the copy engines" if shown == "copy_engine" else "NCCL's send/recv") in text.splitlines()[-1]
