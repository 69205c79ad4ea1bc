"""The default `auto` policy: the shipped profile's lookup and prediction, its fallbacks, the explanation, the
environment variable, and that selection and policy import in one direction only."""
from __future__ import annotations

import ast
import dataclasses
import json
import math
import time
from pathlib import Path

import pytest

from attn_dispatch import AttentionParams, Platform, explain, selection
from attn_dispatch.env import EnvFlags
from attn_dispatch.policy import AutoPolicy, Profile, profile_for
from attn_dispatch.policy.profile import PROFILE_DIR
from attn_dispatch.policy.cost_model import COST_MODEL, features, provider_work, tiled_pairs, unwindowed_work
from attn_dispatch.policy.cost_model import work as profile_work
from attn_dispatch.policy.profile_build import build, with_settled_flex

H100 = Platform.parse("h100-cudnn9")
A100 = Platform.parse("a100-cudnn9")
NO_ENV = EnvFlags.from_environ({})
PACKAGE = Path(selection.__file__).parent


def synthetic_profile(tmp_path: Path, rows: list[tuple[dict, dict]], arch: str = "sm90",
                      machine: str = "test GPU", more_runs: list[dict] = ()) -> Path:
    """A profile from (params keywords, {provider: ms}) rows of one run on `machine` (and more runs), as build()
    writes it."""
    run = {"machine": machine, "rows": [{"label": f"row{i}", "params": AttentionParams(**kw).to_dict(), "times_ms": t}
                                        for i, (kw, t) in enumerate(rows)]}
    data = build([run, *more_runs], arch=arch, stack={"torch": "2.11.0"}, date="2026-11-23")
    (tmp_path / f"{arch}.json").write_text(json.dumps(data))
    return tmp_path


def test_the_shipped_profile_covers_sm90_and_names_its_stack():
    profile = profile_for(H100)
    assert profile is not None and profile.arch == "sm90" and len(profile.entries) >= 100
    assert {"torch", "cuDNN", "cudnn-frontend", "flash-attn-4"} <= set(profile.stack)
    assert all(ms > 0 for e in profile.entries for ms in e.times_ms.values())
    assert profile_for(A100) is None and profile_for(Platform.parse("cpu")) is None


def test_prediction_reproduces_a_measured_call_and_follows_the_work(tmp_path):
    # engine 'a' is fast on big calls, 'b' has a lower host floor: the crossing must show in the prediction
    rows = []
    for s in (256, 1024, 4096, 16384):
        work = s * s / 256 ** 2
        rows.append((dict(max_seqlen_q=s, batch_size=1, attn_mask_type="causal"),
                     {"x:a": max(0.5, 0.01 * work), "x:b": max(0.1, 0.02 * work)}))
    profile = Profile(json.loads((synthetic_profile(tmp_path, rows) / "sm90.json").read_text()))
    small = profile.predict(AttentionParams(max_seqlen_q=256, attn_mask_type="causal"))
    big = profile.predict(AttentionParams(max_seqlen_q=16384, attn_mask_type="causal"))
    assert small.best(["x:a", "x:b"]) == "x:b" and big.best(["x:a", "x:b"]) == "x:a"
    assert math.isclose(big.times_ms["x:a"], 40.96, rel_tol=0.1)  # its own measurement, nearly recovered
    # an unmeasured length in between is interpolated, not copied from a neighbour
    mid = profile.predict(AttentionParams(max_seqlen_q=8192, attn_mask_type="causal"))
    assert 2.0 < mid.times_ms["x:a"] < 40.0


def test_only_calls_of_the_same_kind_are_neighbours(tmp_path):
    rows = [(dict(max_seqlen_q=1024, attn_mask_type="causal"), {"x:a": 1.0, "x:b": 2.0}),
            (dict(max_seqlen_q=1024, attn_mask_type="no_mask"), {"x:a": 2.0, "x:b": 1.0})]
    profile = Profile(json.loads((synthetic_profile(tmp_path, rows) / "sm90.json").read_text()))
    assert profile.predict(AttentionParams(max_seqlen_q=1024, attn_mask_type="causal")).best(["x:a", "x:b"]) == "x:a"
    assert profile.predict(AttentionParams(max_seqlen_q=1024)).best(["x:a", "x:b"]) == "x:b"
    inference = profile.predict(AttentionParams(max_seqlen_q=1024, is_training=False))
    assert inference.times_ms == {} and inference.best(["x:a"]) is None
    kind, log2, fmt = features(AttentionParams(qkv_format="sbhd", window_size=(128, 0), attn_mask_type="causal"))
    assert kind == (True, "window", False) and fmt == "sbhd" and log2["span"] == math.log2(129)


def test_packed_calls_have_their_own_host_floor_and_leave_one_out_leaves_the_floor_out(tmp_path):
    # 'x:a' costs 0.5 ms per packed (thd) call whatever its size, 0.05 ms per small dense call
    dense = dict(max_seqlen_q=512, attn_mask_type="causal", is_training=False)
    packed = dict(dense, qkv_format="thd", attn_mask_type="padding_causal")
    rows = [(dict(dense, max_seqlen_q=s), {"x:a": max(0.05, 0.1 * (s / 2048) ** 2), "x:b": 0.2})
            for s in (512, 2048)]
    rows += [(dict(packed, max_seqlen_q=s), {"x:a": max(0.5, 0.1 * (s / 2048) ** 2), "x:b": 0.45})
             for s in (512, 1024, 4096)]
    profile = Profile(json.loads((synthetic_profile(tmp_path, rows) / "sm90.json").read_text()))
    small_packed = profile.predict(AttentionParams(**dict(packed, max_seqlen_q=768)))
    assert small_packed.times_ms["x:a"] >= 0.5 and small_packed.best(["x:a", "x:b"]) == "x:b"
    small_dense = profile.predict(AttentionParams(**dict(dense, max_seqlen_q=256)))
    assert small_dense.times_ms["x:a"] < 0.1 and small_dense.best(["x:a", "x:b"]) == "x:a"
    # leave-one-out leaves a call out of the floor too: without row0 (0.05 ms) x:a's dense floor is row1's 0.1 ms
    assert profile._host("x:a", (False, "causal", False)) == 0.05
    assert profile.predict(AttentionParams(**dense)).times_ms["x:a"] < 0.06
    assert profile.predict(AttentionParams(**dense), leave_out=True).times_ms["x:a"] >= 0.1


def test_auto_picks_the_predicted_fastest_and_explains_why(tmp_path):
    rows = [(dict(max_seqlen_q=s, attn_mask_type="causal"),
             {"cudnn_fused:frontend": 2.0 * s / 1024, "flash_attn_4:cute": 1.0 * s / 1024}) for s in (1024, 4096)]
    policy = AutoPolicy(directory=synthetic_profile(tmp_path, rows))
    p = AttentionParams(max_seqlen_q=2048, attn_mask_type="causal")
    choice = policy.choose(p, H100, ["cudnn_fused:frontend", "flash_attn_4:cute", "flash_attn_2:torch"])
    assert choice.chosen == "flash_attn_4:cute"
    assert "predicted fastest" in choice.reason and "cudnn_fused:frontend 2.00x" in choice.reason
    assert "not in the profile: flash_attn_2:torch" in choice.reason and "test GPU" in choice.reason
    assert set(choice.estimates) == {"cudnn_fused:frontend", "flash_attn_4:cute"}
    # only one candidate: no prediction needed
    assert policy.choose(p, H100, ["flash_attn_2:torch"]).chosen == "flash_attn_2:torch"


def test_without_a_profile_the_order_decides_and_says_so(tmp_path):
    policy = AutoPolicy(directory=tmp_path)
    choice = policy.choose(AttentionParams(), A100, ["flash_attn_2:package", "cudnn_fused:frontend"])
    assert choice.chosen == "flash_attn_2:package"
    assert "no performance profile for sm80" in choice.reason and "preference order decides" in choice.reason
    d = explain(AttentionParams(), A100, NO_ENV)
    assert d.policy == "auto" and "no performance profile for sm80" in d.policy_reason


def test_default_decision_on_hopper_uses_the_profile_and_env_selects_the_order(monkeypatch):
    p = AttentionParams(max_seqlen_q=8192, batch_size=4, attn_mask_type="causal")
    d = explain(p, H100, NO_ENV)
    assert d.policy == "auto" and d.chosen in d.estimates and "predicted fastest" in d.policy_reason
    assert "estimate_unit" in d.model_dump() and d.estimate_unit.startswith("ms per step")
    assert "why:" in d.summary()
    order = explain(p, H100, EnvFlags.from_environ({"ATTN_DISPATCH_POLICY": "order"}))
    assert order.policy == "order" and order.chosen == "cudnn_fused:frontend"  # Transformer Engine's pick, exactly
    with pytest.raises(ValueError, match="ATTN_DISPATCH_POLICY='fastest' is not accepted"):
        EnvFlags.from_environ({"ATTN_DISPATCH_POLICY": "fastest"})


def test_forced_backend_overrides_the_profile():
    p = AttentionParams(max_seqlen_q=8192, attn_mask_type="causal")
    d = explain(p, H100, NO_ENV, force="cudnn_fused:torch")
    assert d.chosen == "cudnn_fused:torch" and "forced" in d.policy_reason


def test_a_locally_tuned_bucket_overrides_the_profile(tmp_path):
    class Tuned:  # the measured policy's lookup: a cache entry on disk, no timing
        scheme = type("S", (), {"key": staticmethod(lambda p: "bucket-1")})()

        def lookup(self, params, platform):
            return {"times_ms": {"cudnn_fused:frontend": 1.0, "flash_attn_4:cute": 1.5}}

    rows = [(dict(max_seqlen_q=1024), {"cudnn_fused:frontend": 2.0, "flash_attn_4:cute": 1.0})]
    policy = AutoPolicy(directory=synthetic_profile(tmp_path, rows), measured=Tuned())
    choice = policy.choose(AttentionParams(max_seqlen_q=1024), H100, ["cudnn_fused:frontend", "flash_attn_4:cute"])
    assert choice.chosen == "cudnn_fused:frontend" and "tuned on this machine" in choice.reason
    # a tuned entry missing a candidate does not decide: the profile does
    choice = policy.choose(AttentionParams(max_seqlen_q=1024), H100,
                           ["cudnn_fused:frontend", "flash_attn_4:cute", "flash_attn_2:torch"])
    assert choice.chosen == "flash_attn_4:cute"


def test_a_fresh_decision_under_auto_costs_under_a_millisecond_of_host_time():
    p = AttentionParams(max_seqlen_q=3000, batch_size=3, num_heads=24, num_gqa_groups=8, attn_mask_type="causal")
    explain(p, H100, NO_ENV, use_cache=False)  # profile loaded once per process
    times = []
    for i in range(20):
        q = p.replace(max_seqlen_q=3000 + i)
        start = time.perf_counter()
        explain(q, H100, NO_ENV, use_cache=False)
        times.append(time.perf_counter() - start)
    # the whole decision (every table) is timed; a generous bound for a loaded 2-core CI machine
    assert sorted(times)[len(times) // 2] < 0.005


def test_policies_never_import_selection():
    """Selection is the one place that composes tables and policy: the policies import neither it nor its callers."""
    callers = {"selection", "module", "benchmarking", "commands", "cli", "integrations"}
    for package in ("policy",):
        for path in (PACKAGE / package).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level >= 2:
                    top = (node.module or "").split(".")[0]
                    names = {a.name for a in node.names} if not node.module else {top}
                    assert not (names & callers), f"{path.name} imports {names & callers}"


def test_attended_pairs_closed_form_matches_counting_rows():
    """The default policy's work estimate counts attended (query, key) pairs in closed form; check it against a
    row-by-row count over masks, windows and lengths."""
    import random

    from attn_dispatch.policy.timing import attended_pairs

    def by_rows(p):
        return sum(max(0, hi - lo + 1) for lo, hi in _key_ranges(p))

    rng = random.Random(0)
    for p in _random_masked_calls(rng, 2000, 50):
        assert attended_pairs(p) == by_rows(p), p.describe()


def _key_ranges(p):
    """Each query row's first and last visible key, walking the rows (the closed forms' reference)."""
    sq, skv = p.max_seqlen_q, p.max_seqlen_kv
    left, right = p.window_size
    offset = 0 if p.attn_mask_type in ("causal", "padding_causal") else skv - sq
    for i in range(sq):
        yield (0 if left < 0 else max(0, i + offset - left),
               skv - 1 if right < 0 else min(skv - 1, i + offset + right))


def _random_masked_calls(rng, count: int, longest: int):
    """count valid calls over masks, windows and lengths up to longest (invalid draws are drawn again)."""
    made = 0
    while made < count:
        mask = rng.choice(["no_mask", "causal", "causal_bottom_right", "padding_causal", "padding"])
        window = (rng.choice([-1, rng.randint(0, 40)]), rng.choice([-1, rng.randint(0, 40)]))
        try:
            p = AttentionParams(max_seqlen_q=rng.randint(1, longest), max_seqlen_kv=rng.randint(1, longest),
                                attn_mask_type=mask, window_size=window)
        except ValueError:
            continue
        made += 1
        yield p


# --- machines of one architecture, and profiles built from several runs ------------------------------------------

H200 = Platform.parse("h200-cudnn9")
ENOUGH = COST_MODEL.min_own + 2  # entries of a kind for a machine to be predicted from its own alone


def two_machine_rows(lengths):
    """Causal training calls on which 'x:a' is 1.5x faster on the H100 and 'x:b' 1.5x faster on the H200."""
    h100 = [(dict(max_seqlen_q=s, attn_mask_type="causal"), {"x:a": s / 1000, "x:b": 1.5 * s / 1000})
            for s in lengths]
    h200 = {"machine": H200.device_name,
            "rows": [{"label": f"h200 row{i}", "params": AttentionParams(**kw).to_dict(),
                      "times_ms": {"x:a": 0.9 * t["x:b"], "x:b": 0.6 * t["x:a"]}} for i, (kw, t) in enumerate(h100)]}
    return h100, h200


def test_a_machine_with_enough_entries_of_a_kind_is_predicted_from_its_own(tmp_path):
    h100, h200 = two_machine_rows([512 * (i + 1) for i in range(ENOUGH)])
    directory = synthetic_profile(tmp_path, h100, machine=H100.device_name, more_runs=[h200])
    profile = Profile(json.loads((directory / "sm90.json").read_text()))
    assert sorted(profile.machines) == [H100.device_name, H200.device_name]
    p = AttentionParams(max_seqlen_q=3000, attn_mask_type="causal")
    on_h100, on_h200 = profile.predict(p, machine=H100.device_name), profile.predict(p, machine=H200.device_name)
    assert on_h100.machine == H100.device_name and on_h100.best(["x:a", "x:b"]) == "x:a"
    assert on_h200.machine == H200.device_name and on_h200.best(["x:a", "x:b"]) == "x:b"
    policy = AutoPolicy(directory=directory)
    choice = policy.choose(p, H200, ["x:a", "x:b"])
    assert choice.chosen == "x:b" and f"this machine's ({H200.device_name}) {ENOUGH} measured calls" in choice.reason
    assert policy.choose(p, H100, ["x:a", "x:b"]).chosen == "x:a"


def test_a_machine_with_few_entries_of_a_kind_is_predicted_from_every_machine(tmp_path):
    h100, h200 = two_machine_rows([512 * (i + 1) for i in range(ENOUGH)])
    h200["rows"] = h200["rows"][:2]  # the H200 measured 2 calls of this kind: too few to stand alone
    directory = synthetic_profile(tmp_path, h100, machine=H100.device_name, more_runs=[h200])
    policy = AutoPolicy(directory=directory)
    near_h100_only = AttentionParams(max_seqlen_q=4800, attn_mask_type="causal")
    choice = policy.choose(near_h100_only, H200, ["x:a", "x:b"])
    assert choice.chosen == "x:a"  # the H100's neighbours decide
    assert "using every sm90 machine's measured calls (NVIDIA H200 has 2 of this kind" in choice.reason
    assert f"({H100.device_name})" in choice.reason  # each neighbour names its machine
    # a neighbour measured on the H200 itself wins a tie of distance
    on_its_own_row = AttentionParams(max_seqlen_q=512, attn_mask_type="causal")
    assert Profile(json.loads((directory / "sm90.json").read_text())).predict(
        on_its_own_row, machine=H200.device_name).neighbours[0].startswith("h200 row0")
    # a machine the profile has never seen (same architecture) uses every machine's entries
    other = Platform.parse("h100-cudnn9,name=NVIDIA H100 PCIe")
    assert "NVIDIA H100 PCIe has 0 of this kind" in policy.choose(near_h100_only, other, ["x:a", "x:b"]).reason


def test_leaving_a_call_out_leaves_it_out_on_every_machine(tmp_path):
    h100, h200 = two_machine_rows([512 * (i + 1) for i in range(COST_MODEL.min_own + 1)])
    profile = Profile(json.loads((synthetic_profile(tmp_path, h100, machine=H100.device_name, more_runs=[h200])
                                  / "sm90.json").read_text()))
    p = AttentionParams(max_seqlen_q=2048, attn_mask_type="causal")
    assert profile.predict(p, machine=H200.device_name).neighbours[0] == "h200 row3"
    kept = profile.predict(p, machine=H200.device_name, leave_out=True).neighbours[0]
    assert kept != "h200 row3" and kept.startswith("h200 row")
    # min_own H200 entries of the kind remain: still its own; one fewer and every machine's are used (the count
    # leaves the call out too)
    assert profile.predict(p, machine=H200.device_name, leave_out=True).machine == H200.device_name
    h200["rows"] = h200["rows"][1:]
    fewer = Profile(json.loads((synthetic_profile(tmp_path, h100, machine=H100.device_name, more_runs=[h200])
                                / "sm90.json").read_text()))
    assert fewer.predict(p, machine=H200.device_name).machine == H200.device_name
    assert fewer.predict(p, machine=H200.device_name, leave_out=True).machine is None


def test_a_profile_built_from_several_runs_combines_them_per_call_and_machine():
    call = AttentionParams(max_seqlen_q=1024, attn_mask_type="causal").to_dict()
    other = AttentionParams(max_seqlen_q=2048, attn_mask_type="causal").to_dict()
    row = lambda label, params, times: {"label": label, "params": params, "times_ms": times}  # noqa: E731
    runs = [
        {"machine": "GPU A", "rows": [row("first", call, {"x:a": 1.0, "x:b": 2.0, "x:c": 4.0, "sdpa": 0.1}),
                                      row("other", other, {"x:a": 3.0})]},
        # a run whose clock ran 10% slow: scaled onto the first by the median ratio of the providers both timed
        {"machine": "GPU A", "rows": [row("second", call, {"x:a": 1.1, "x:b": 2.42, "x:c": 4.4})]},
        # a stock run (only some providers), also 10% slow, with a time the full runs lack
        {"machine": "GPU A", "rows": [row("stock", call, {"x:a": 1.1, "x:d": 5.5})]},
        {"machine": "GPU B", "rows": [row("first", call, {"x:a": 0.5, "x:b": 0.7})]},
    ]
    data = build(runs, arch="sm90", stack={}, date="2026-11-25")
    assert data["machines"] == ["GPU A", "GPU B"]
    entries = {(data["machines"][e["machine"]], e["label"]): e for e in data["entries"]}
    assert set(entries) == {("GPU A", "first"), ("GPU A", "other"), ("GPU B", "first")}
    combined = entries[("GPU A", "first")]
    assert combined["runs"] == 3 and "sdpa" not in combined["times_ms"]
    assert math.isclose(combined["times_ms"]["x:a"], 1.0, rel_tol=1e-6)
    assert math.isclose(combined["times_ms"]["x:b"], 2.1, rel_tol=1e-4)  # median of 2.0 and 2.42 / 1.1
    assert math.isclose(combined["times_ms"]["x:d"], 5.0, rel_tol=1e-4)  # 5.5 scaled by 1.0 / 1.1
    assert entries[("GPU B", "first")]["times_ms"] == {"x:a": 0.5, "x:b": 0.7}
    profile = Profile(data)
    assert {e.machine for e in profile.entries} == {"GPU A", "GPU B"}
    assert profile.predict(AttentionParams(max_seqlen_q=1024, attn_mask_type="causal"), machine="GPU B").machine \
        is None  # one entry of the kind: every machine's entries predict


def test_tiled_work_closed_form_matches_counting_tiles():
    """The work is counted in the tiles of the score matrix that hold an attended pair: check the closed form
    against a pair-by-pair count over masks, windows, lengths and tile sizes."""
    import random

    def by_pairs(p, tile):
        tiles = set()
        for i, (lo, hi) in enumerate(_key_ranges(p)):
            tiles.update((i // tile, j // tile) for j in range(lo, hi + 1))
        return len(tiles) * tile * tile

    rng = random.Random(1)
    for p in _random_masked_calls(rng, 1500, 70):
        tile = rng.choice([4, 8, 16])
        assert tiled_pairs(p, tile) == by_pairs(p, tile), (p.describe(), tile)
    # a 257-key band over 4096 queries: 3 key tiles of 128 per query tile (2 at the edges), not 257 / 128
    band = AttentionParams(max_seqlen_q=4096, window_size=(128, 128))
    assert tiled_pairs(band, 128) == (32 * 3 - 2) * 128 * 128


def test_a_host_bound_neighbour_gives_no_rate_to_a_bigger_call(tmp_path):
    # 'x:a' has a 0.5 ms host floor and the GPU rate of 'x:b' (0.1 ms of GPU time at s1024). At s1024 it cost
    # 0.52 ms: the smooth max would call 0.44 ms of that GPU time, and predict 1.8 ms for 4x the work. Its floor
    # hides its rate, so the next nearest call (s8192, far above the floor) gives it.
    gpu = lambda s: 0.1 * (s / 1024) ** 2  # noqa: E731
    causal = dict(batch_size=1, attn_mask_type="causal")
    rows = [(dict(causal, max_seqlen_q=256), {"x:a": 0.5, "x:b": 0.05}),
            (dict(causal, max_seqlen_q=1024), {"x:a": 0.52, "x:b": 0.2})]
    rows += [(dict(causal, max_seqlen_q=s), {"x:a": gpu(s), "x:b": 2 * gpu(s)}) for s in (8192, 16384)]
    profile = Profile(json.loads((synthetic_profile(tmp_path, rows) / "sm90.json").read_text()))
    mid = profile.predict(AttentionParams(**dict(causal, max_seqlen_q=2048)))
    assert mid.neighbours[0] == "row1"
    assert mid.times_ms["x:a"] == pytest.approx(0.52, rel=0.05)  # the floor and s8192's rate: 0.4 ms of GPU time
    # row1 is 4x x:b's floor: its rate stands, scaled by the causal tiles' work (136 tiles of 128 at s2048, 36 at 1024)
    assert mid.times_ms["x:b"] == pytest.approx(0.2 * 136 / 36, rel=0.02)
    assert mid.best(["x:b", "x:a"]) == "x:a"
    # a call no bigger than the host-bound neighbour takes its rate (it is at the floor anyway)
    small = profile.predict(AttentionParams(**dict(causal, max_seqlen_q=768)))
    assert small.times_ms["x:a"] == pytest.approx(0.5, rel=0.05)


def test_causal_and_two_sided_windows_are_different_kinds_of_call(tmp_path):
    # the same key span (2049), one causal window, one two-sided: engines rank them differently (fit-drawn grids:
    # cuDNN fastest on causal windows, 1.2-3.5x slower than flash-attn-4 on two-sided ones)
    causal = dict(max_seqlen_q=4096, attn_mask_type="causal", window_size=(2048, 0))
    two_sided = dict(max_seqlen_q=4096, attn_mask_type="no_mask", window_size=(1024, 1024))
    assert features(AttentionParams(**causal))[0] != features(AttentionParams(**two_sided))[0]
    rows = [(causal, {"x:a": 1.0, "x:b": 2.0}), (two_sided, {"x:a": 3.0, "x:b": 1.0})]
    profile = Profile(json.loads((synthetic_profile(tmp_path, rows) / "sm90.json").read_text()))
    near_two_sided = AttentionParams(max_seqlen_q=3000, attn_mask_type="no_mask", window_size=(900, 900))
    assert profile.predict(near_two_sided).best(["x:a", "x:b"]) == "x:b"
    near_causal = AttentionParams(max_seqlen_q=3000, attn_mask_type="causal", window_size=(1800, 0))
    assert profile.predict(near_causal).best(["x:a", "x:b"]) == "x:a"


def test_a_training_time_under_its_own_forward_is_left_out_of_the_profile():
    call = dict(max_seqlen_q=2048, attn_mask_type="causal")
    run = {"machine": "test GPU", "rows": [
        {"label": "train", "params": AttentionParams(**call).to_dict(), "times_ms": {"x:a": 0.2, "x:b": 0.9}},
        {"label": "infer", "params": AttentionParams(**call, is_training=False).to_dict(),
         "times_ms": {"x:a": 0.3, "x:b": 0.3}}]}
    entries = {e["label"]: e["times_ms"] for e in build([run], arch="sm90", stack={}, date="")["entries"]}
    assert entries["train"] == {"x:b": 0.9} and entries["infer"] == {"x:a": 0.3, "x:b": 0.3}


def test_one_outlier_does_not_set_the_host_floor_once_a_kind_has_enough_calls(tmp_path):
    rows = [(dict(max_seqlen_q=256 * (i + 1), attn_mask_type="causal"), {"x:a": 0.5 + 0.01 * i}) for i in range(40)]
    rows[7] = (rows[7][0], {"x:a": 0.05})  # one timer outlier, 10x under every other call
    profile = Profile(json.loads((synthetic_profile(tmp_path, rows) / "sm90.json").read_text()))
    assert profile._host("x:a", features(AttentionParams(max_seqlen_q=256, attn_mask_type="causal"))[0]) >= 0.5
    few = Profile(json.loads((synthetic_profile(tmp_path, rows[:5]) / "sm90.json").read_text()))
    assert few._host("x:a", features(AttentionParams(max_seqlen_q=256, attn_mask_type="causal"))[0]) == 0.5


def test_a_refresh_run_replaces_the_earlier_runs_of_its_calls_on_its_machine_only():
    packed = AttentionParams(qkv_format="thd", attn_mask_type="padding", max_seqlen_q=2048).to_dict()
    dense = AttentionParams(max_seqlen_q=2048, attn_mask_type="causal").to_dict()
    row = lambda label, params, times: {"label": label, "params": params, "times_ms": times}  # noqa: E731
    runs = [
        {"machine": "GPU A", "rows": [row("packed", packed, {"x:a": 0.9, "x:b": 0.5}),
                                      row("dense", dense, {"x:a": 2.0})]},
        {"machine": "GPU B", "rows": [row("packed", packed, {"x:a": 0.8, "x:b": 0.6})]},
        {"machine": "GPU A", "replaces": True, "rows": [row("packed again", packed, {"x:a": 0.3, "x:b": 0.45})]},
    ]
    entries = {(e["machine"], e["label"]): e for e in build(runs, arch="sm90", stack={}, date="")["entries"]}
    a, b = 0, 1  # machine indices, sorted names
    assert (a, "packed") not in entries
    assert entries[(a, "packed again")]["times_ms"] == {"x:a": 0.3, "x:b": 0.45}
    assert entries[(a, "packed again")]["runs"] == 1
    assert entries[(b, "packed")]["times_ms"] == {"x:a": 0.8, "x:b": 0.6}  # another machine's run stays
    assert entries[(a, "dense")]["times_ms"] == {"x:a": 2.0}  # a call the refresh did not measure stays


def test_a_flex_time_settled_on_its_dynamic_compile_replaces_unsettled_ones_of_the_same_call():
    packed = AttentionParams(qkv_format="thd", attn_mask_type="padding", max_seqlen_q=2048).to_dict()
    other = AttentionParams(qkv_format="thd", attn_mask_type="padding", max_seqlen_q=4096).to_dict()
    row = lambda label, params, times, **kw: {"label": label, "params": params, "times_ms": times, **kw}  # noqa: E731
    grid = {"machine": "m", "rows": [row("p", packed, {"x:fa": 1.0, "flex:t": 0.8, "x:f4": 0.9}),
                                     row("q", other, {"x:fa": 2.0, "flex:t": 1.6})]}
    # timed again on a clock 10% slower, flex settled on its dynamic compile: 1.6x FA's, not 0.8x
    again = {"machine": "m", "rows": [row("p", packed, {"x:fa": 1.1, "flex:t": 1.76},
                                          flex_settled_dynamic=["flex:t"])]}
    elsewhere = {"machine": "n", "rows": [row("p", packed, {"x:fa": 1.0, "flex:t": 0.8})]}
    data = build([grid, again, elsewhere], arch="sm90", stack={}, date="")
    entries = {(data["machines"][e["machine"]], e["label"]): e["times_ms"] for e in data["entries"]}
    assert entries[("m", "p")]["flex:t"] == pytest.approx(1.6)  # the settled time alone, on the grid's clock
    assert entries[("m", "p")]["x:fa"] == pytest.approx(1.0) and entries[("m", "p")]["x:f4"] == 0.9
    assert entries[("m", "q")]["flex:t"] == 1.6  # a call not timed again keeps its time
    assert entries[("n", "p")]["flex:t"] == 0.8  # another machine's run is not replaced
    # scoring a run against what a user's loop runs: its flex time replaced by the settled one, on its own clock
    scored = {r["label"]: r["times_ms"] for r in with_settled_flex(grid, [grid, again, elsewhere])}
    assert scored["p"]["flex:t"] == pytest.approx(1.6) and scored["p"]["x:f4"] == 0.9
    assert scored["q"] == {"x:fa": 2.0, "flex:t": 1.6}
    assert with_settled_flex(elsewhere, [grid, again, elsewhere]) == elsewhere["rows"]


def test_a_packed_provider_read_relative_to_others_is_picked_only_where_it_reads_clearly_faster():
    profile = Profile(json.loads((PROFILE_DIR / "sm90.json").read_text()))
    plain = Profile(json.loads((PROFILE_DIR / "sm90.json").read_text()),
                    model=dataclasses.replace(COST_MODEL, relative_packed_margin=1.0))
    call = AttentionParams(qkv_format="thd", attn_mask_type="padding_causal", max_seqlen_q=4096, max_seqlen_kv=4096,
                           batch_size=4, num_heads=16, num_gqa_groups=4, head_dim_qk=128, head_dim_v=128)
    among = ["flash_attn_2:torch", "flex_attention:torch"]
    margined = profile.predict(call, machine="NVIDIA H200", among=among).times_ms
    unmargined = plain.predict(call, machine="NVIDIA H200", among=among).times_ms
    assert margined["flash_attn_2:torch"] == unmargined["flash_attn_2:torch"]
    assert margined["flex_attention:torch"] == pytest.approx(
        unmargined["flex_attention:torch"] * COST_MODEL.relative_packed_margin)
    assert COST_MODEL.relative_packed_margin > 1.0


def _split_run(machine: str, rows: list[tuple[dict, dict]]) -> dict:
    """A bench_user_step.py --split-only run: per call, {provider: (host ms, GPU ms, covered)}."""
    return {"machine": machine, "rows": [
        {"label": f"split{i}", "params": AttentionParams(**kw).to_dict(), "times_ms": {},
         "split": {p: {"step_ms": max(h, g), "host_ms": h, "gpu_ms": g, "covered": c} for p, (h, g, c) in s.items()}}
        for i, (kw, s) in enumerate(rows)]}


def test_a_run_refreshing_a_provider_replaces_its_splits_of_the_calls_it_measured_only():
    """After a provider's host path changed (the torch FA2 bound call on bshd, session 11), a split run with
    refreshes=[that provider] is the only source of its split for the calls the run covered on its machine, its
    host times scaled onto the other runs' lease by the median ratio of F.sdpa's host times ('sdpa', split in both);
    other calls, other machines and the step times are pooled as before."""
    calls = [dict(max_seqlen_q=512 * (i + 1), attn_mask_type="causal") for i in range(5)]
    uncovered = dict(max_seqlen_q=8192)
    timed = {"machine": "m", "rows": [{"label": f"c{i}", "params": AttentionParams(**kw).to_dict(),
                                       "times_ms": {"x:a": 1.0, "x:b": 2.0}} for i, kw in enumerate(calls)]}
    old = _split_run("m", [(kw, {"x:a": (0.5, 0.9, 1.0), "x:b": (0.6, 1.9, 1.0), "sdpa": (0.4, 0.9, 1.0)})
                           for kw in calls] + [(uncovered, {"x:a": (0.7, 1.5, 1.0), "sdpa": (0.4, 1.5, 1.0)})])
    old_elsewhere = _split_run("n", [(calls[0], {"x:a": (0.9, 0.9, 1.0)})])
    # this lease's host runs F.sdpa 2x faster (ratios 2, 2, 2, 1.6, 4: median 2)
    fast_lease = [(kw, {"x:a": (0.1, 0.9, 1.0), "x:b": (0.05, 1.9, 1.0), "sdpa": (0.4 / r, 0.9, 1.0)})
                  for kw, r in zip(calls, (2, 2, 2, 1.6, 4))]
    refresh = {**_split_run("m", fast_lease + [(uncovered, {"x:a": (0.3, 1.5, 0.0), "sdpa": (0.2, 1.5, 1.0)})]),
               "refreshes": ["x:a"]}
    data = build([timed, old, old_elsewhere, refresh], arch="sm90", stack={}, date="")
    entries = {(data["machines"][e["machine"]], e["label"]): e for e in data["entries"]}
    # x:a refreshed, scaled x2; x:b pooled with the old run's (median of 0.6 and 0.05 x 2)
    assert entries[("m", "c0")]["host_ms"] == {"x:a": 0.2, "x:b": 0.35}
    assert entries[("m", "c0")]["gpu_ms"] == {"x:a": 0.9, "x:b": 1.9}  # GPU times are not scaled
    assert entries[("m", "split5")]["host_ms"] == {"x:a": 0.7}  # the refresh's split was not covered: old stays
    assert entries[("m", "c0")]["times_ms"] == {"x:a": 1.0, "x:b": 2.0}
    assert entries[("n", "split0")]["host_ms"] == {"x:a": 0.9}  # another machine: untouched
    # a newer refresh of x:a (the same lease speed) replaces the older refresh on the calls it covers, only those
    newer = {**_split_run("m", [(kw, {"x:a": (0.15, 0.8, 1.0), "sdpa": (0.4 / r, 0.9, 1.0)})
                                for kw, r in zip(calls[:4] + calls[:1], (2, 2, 2, 1.6, 2))]),
             "refreshes": ["x:a"], "date": "2026-11-27"}
    refresh["date"] = "2026-11-26"
    data = build([timed, old, old_elsewhere, refresh, newer], arch="sm90", stack={}, date="")
    entries = {(data["machines"][e["machine"]], e["label"]): e for e in data["entries"]}
    assert entries[("m", "c0")]["host_ms"]["x:a"] == 0.3 and entries[("m", "c0")]["gpu_ms"]["x:a"] == 0.8
    assert entries[("m", "c4")]["host_ms"]["x:a"] == pytest.approx(0.1 * 2)  # not in the newer run: the older's


def test_a_refresh_without_enough_reference_calls_is_refused():
    """A refresh whose lease cannot be read (fewer than MIN_REFERENCE_CALLS calls with an F.sdpa split shared with
    the other runs, per pass) would mix two leases' host speeds: the build says which run and why."""
    calls = [dict(max_seqlen_q=512 * (i + 1)) for i in range(5)]
    old = _split_run("m", [(kw, {"x:a": (0.5, 0.9, 1.0), "sdpa": (0.4, 0.9, 1.0)}) for kw in calls])
    refresh = {**_split_run("m", [(kw, {"x:a": (0.1, 0.9, 1.0)} if i else {"x:a": (0.1, 0.9, 1.0),
                                                                         "sdpa": (0.2, 0.9, 1.0)})
                                  for i, kw in enumerate(calls)]), "refreshes": ["x:a"], "path": "refresh.json"}
    with pytest.raises(ValueError, match=r"refresh run 'refresh.json': 1 training calls with a 'sdpa' split"):
        build([old, refresh], arch="sm90", stack={}, date="")


def test_a_provider_whose_backward_skips_no_window_tile_is_charged_the_unwindowed_backward(tmp_path):
    # 'x:skips' does the windowed work in both passes; 'x:full' (declared in unwindowed_backward) the windowed
    # forward and the unwindowed backward, at a 1.25x higher rate. Measured with a window that covers every key
    # (no difference), they predict a narrow window: x:full must lose there.
    model = dataclasses.replace(COST_MODEL, unwindowed_backward=("x:full",))
    rate = 1e9  # flops per ms
    full_window = dict(max_seqlen_q=4096, attn_mask_type="no_mask", window_size=(4096, 4096), batch_size=4)
    narrow = AttentionParams(**dict(full_window, window_size=(256, 256)))
    rows = [(dict(max_seqlen_q=128, attn_mask_type="causal"), {"x:skips": 1e-3, "x:full": 1e-3})]  # the host floor
    for b in (2, 4, 8):
        kw = dict(full_window, batch_size=b)
        w = profile_work(AttentionParams(**kw))
        rows.append((kw, {"x:skips": 10.0 * w / rate, "x:full": 8.0 * w / rate}))
    data = build([{"machine": "test GPU", "rows": [{"label": f"row{i}", "params": AttentionParams(**kw).to_dict(),
                                                     "times_ms": t} for i, (kw, t) in enumerate(rows)]}],
                 arch="sm90", stack={}, date="", model=model)
    assert not any("work_unwindowed" in e for e in data["entries"])  # the window covers every key: no difference
    windowed, unwindowed = profile_work(narrow), unwindowed_work(narrow)
    assert unwindowed > 5 * windowed
    predicted = Profile(data, model=model).predict(narrow)
    assert predicted.times_ms["x:skips"] == pytest.approx(10.0 * windowed / rate, rel=0.05)
    assert predicted.times_ms["x:full"] == pytest.approx(8.0 * (windowed + 2.5 * unwindowed) / 3.5 / rate, rel=0.05)
    assert predicted.best(["x:full", "x:skips"]) == "x:skips"
    # declared for no provider, the two scale alike and x:full wins; an inference call is never charged so
    assert Profile(data, model=dataclasses.replace(model, unwindowed_backward=())).predict(narrow).best(
        ["x:full", "x:skips"]) == "x:full"
    inference = dataclasses.replace(narrow, is_training=False)
    assert provider_work("x:full", profile_work(inference), profile_work(inference), model) == profile_work(inference)
    # a narrow window's entry stores its unwindowed work, and a neighbour's rate is read over the same work
    data = build([{"machine": "test GPU", "rows": [{"label": "narrow", "params": narrow.to_dict(),
                                                     "times_ms": {"x:full": 2.0}}]}], arch="sm90", stack={}, date="")
    assert data["entries"][0]["work_unwindowed"] == pytest.approx(unwindowed)


def test_split_runs_add_host_and_gpu_times_to_the_entries_they_measured():
    call = dict(max_seqlen_q=1024, attn_mask_type="causal")
    timed = {"machine": "m", "rows": [{"label": "c", "params": AttentionParams(**call).to_dict(),
                                       "times_ms": {"x:a": 1.0, "x:b": 2.0}}]}
    split = [_split_run("m", [(call, {"x:a": (0.3, 0.9, 1.0), "x:b": (0.5, 1.9, 0.0)})]),
             _split_run("m", [(call, {"x:a": (0.5, 1.1, 1.0)})]),
             _split_run("other", [(call, {"x:b": (0.1, 0.1, 1.0)})])]
    data = build([timed, *split], arch="sm90", stack={}, date="")
    entry, other = sorted(data["entries"], key=lambda e: data["machines"][e["machine"]] != "m")
    # x:a: the median of its two covered runs; x:b: its only run on this machine synchronised (covered 0)
    assert entry["host_ms"] == {"x:a": 0.4} and entry["gpu_ms"] == {"x:a": 1.0}
    assert entry["times_ms"] == {"x:a": 1.0, "x:b": 2.0}  # a timed run's steps, not the split runs'
    # 'other' timed nothing: its entry takes the split run's steps (max(host, GPU) in _split_run)
    assert data["machines"][other["machine"]] == "other"
    assert other["times_ms"] == {"x:b": 0.1} and other["host_ms"] == {"x:b": 0.1}


def test_a_split_run_alone_makes_entries_a_machine_can_predict_from():
    calls = [dict(max_seqlen_q=s, attn_mask_type="causal") for s in (512, 1024, 2048, 4096)]
    split = _split_run("only split", [(kw, {"x:a": (0.2, 0.1 * i + 0.1, 1.0), "x:b": (0.05, 0.3 * i + 0.3, 1.0)})
                                      for i, kw in enumerate(calls)])
    data = build([split], arch="sm90", stack={}, date="")
    assert len(data["entries"]) == 4 and all(e["gpu_ms"] and e["host_ms"] for e in data["entries"])
    assert [e["times_ms"]["x:b"] for e in data["entries"]] == pytest.approx([0.3, 0.6, 0.9, 1.2])
    profile = Profile(data, model=dataclasses.replace(COST_MODEL, min_own=4))
    pred = profile.predict(AttentionParams(max_seqlen_q=2048, attn_mask_type="causal"), machine="only split")
    assert pred.machine == "only split" and pred.best(["x:a", "x:b"]) == "x:a"


def test_split_model_charges_each_provider_its_host_time_on_small_calls(tmp_path):
    # 'x:fast' has the faster GPU kernel (2x) but 0.8 ms of host time a call; 'x:lean' 0.2 ms
    sizes = (256, 512, 1024, 2048, 4096, 8192, 16384)
    kw = [dict(max_seqlen_q=s, attn_mask_type="causal") for s in sizes]
    gpu = {s: 0.02 * (s / 256) ** 2 for s in sizes}
    steps = [(k, {"x:fast": max(0.8, gpu[s] / 2), "x:lean": max(0.2, gpu[s])}) for k, s in zip(kw, sizes)]
    split = _split_run("test GPU", [(k, {"x:fast": (0.8, gpu[s] / 2, 1.0), "x:lean": (0.2, gpu[s], 1.0)})
                                    for k, s in zip(kw, sizes)])
    data = json.loads((synthetic_profile(tmp_path, steps, more_runs=[split]) / "sm90.json").read_text())
    profile = Profile(data)
    assert all(e.gpu_ms and e.host_ms for e in profile.entries)
    small = profile.predict(AttentionParams(max_seqlen_q=768, attn_mask_type="causal"))
    big = profile.predict(AttentionParams(max_seqlen_q=12288, attn_mask_type="causal"))
    assert small.best(["x:fast", "x:lean"]) == "x:lean" and big.best(["x:fast", "x:lean"]) == "x:fast"
    # its host time (x the model's host_scale), not its (tiny) GPU time
    assert small.times_ms["x:fast"] >= 0.8 * COST_MODEL.host_scale
    # a big call costs its GPU time: 2304 * 0.02 / 2 ms for x:fast, within the smooth maximum's margin
    assert math.isclose(big.times_ms["x:fast"], 0.01 * (12288 / 256) ** 2, rel_tol=0.05)
    # without the split the step times alone predict (the model's setting, not the data, decides)
    plain = Profile(data, model=dataclasses.replace(COST_MODEL, use_split=False))
    assert plain.predict(AttentionParams(max_seqlen_q=768, attn_mask_type="causal")).times_ms != small.times_ms


def test_the_shipped_profile_holds_host_and_gpu_splits_from_its_listed_sources():
    import sys
    sys.path.insert(0, str(PACKAGE.parent / "benchmarks"))
    import build_profile

    names = [Path(p).name for p in build_profile.shipped_sources()]
    assert any(n.startswith("split_fit_") for n in names) and "fit_h100.json.gz" in names
    assert not any("blind" in n or n.startswith("fit_h200") or (n.startswith("split_") and "h200" in n)
                   or "host_" in n or "session3_first" in n
                   for n in names)
    profile = profile_for(H100)
    split = [e for e in profile.entries if e.gpu_ms]
    assert len(split) >= 0.9 * sum(e.machine.startswith("NVIDIA H100") for e in profile.entries)
    assert all(e.host_ms.keys() == e.gpu_ms.keys() and min(e.gpu_ms.values()) > 0 for e in split)



# --- the checked policy: the profile, timing only what it cannot separate ----------------------------------

class RecordingMeasured:
    """The measured policy's tune_bucket, recording what it is asked to time and answering with given times; its
    lookup answers with `earlier` (a bucket timed before), else nothing."""

    scheme = type("Scheme", (), {"key": staticmethod(lambda params: "bucket-1")})()

    def __init__(self, times: dict[str, float] | None, earlier: dict | None = None):
        self.times, self.earlier, self.asked = times, earlier, []

    def lookup(self, params, platform):
        return self.earlier

    def tune_bucket(self, params, platform, candidates, *, lengths=None):
        from attn_dispatch.policy import TuneResult

        self.asked.append(list(candidates))
        if self.times is None:  # nothing timed (a described platform, say)
            return TuneResult("bucket-1", params, {}, None, False)
        entry = {"times_ms": {p: self.times[p] for p in candidates}}
        return TuneResult("bucket-1", params, entry, min(candidates, key=self.times.get), True)


def checked_policy(tmp_path, times_ms: dict[str, float], measured, margin=0.10):
    from attn_dispatch.policy import CheckedPolicy

    rows = [(dict(max_seqlen_q=s, attn_mask_type="causal"), {p: t * s / 1024 for p, t in times_ms.items()})
            for s in (1024, 4096)]
    directory = synthetic_profile(tmp_path, rows)
    return CheckedPolicy(AutoPolicy(directory=directory, measured=measured), measured, margin)


CALL = AttentionParams(max_seqlen_q=2048, attn_mask_type="causal")


@pytest.fixture
def timing_allowed(monkeypatch):
    """The described H100 stands for this machine: the checked policy may time (the stand-in tuner answers)."""
    from attn_dispatch.policy import checked

    monkeypatch.setattr(checked, "why_not_tunable", lambda params, platform: None)


def test_checked_keeps_a_clear_prediction_untimed(tmp_path):
    measured = RecordingMeasured({"cudnn_fused:frontend": 0.5, "flash_attn_4:cute": 1.0})
    policy = checked_policy(tmp_path, {"cudnn_fused:frontend": 2.0, "flash_attn_4:cute": 1.0}, measured)
    choice = policy.choose(CALL, H100, ["cudnn_fused:frontend", "flash_attn_4:cute"])
    assert choice.chosen == "flash_attn_4:cute" and measured.asked == []
    assert "predicted fastest" in choice.reason and "not timed: every other provider is predicted 10% or more" \
        in choice.reason and choice.unit == "ms per step, predicted"


def test_checked_times_only_the_providers_within_the_margin_and_takes_the_measured_fastest(tmp_path, timing_allowed):
    measured = RecordingMeasured({"cudnn_fused:frontend": 0.9, "cudnn_fused:torch": 0.8, "flash_attn_4:cute": 1.0})
    predicted = {"cudnn_fused:frontend": 1.05, "cudnn_fused:torch": 1.5, "flash_attn_4:cute": 1.0}
    policy = checked_policy(tmp_path, predicted, measured)
    eligible = ["cudnn_fused:frontend", "cudnn_fused:torch", "flash_attn_4:cute"]
    choice = policy.choose(CALL, H100, eligible)
    # cuDNN (torch), predicted 1.5x, is not timed although it would have measured fastest: only the close ones are
    assert measured.asked == [["cudnn_fused:frontend", "flash_attn_4:cute"]]
    assert choice.chosen == "cudnn_fused:frontend" and choice.unit == "ms per step, measured here"
    assert choice.estimates == {"cudnn_fused:frontend": 0.9, "flash_attn_4:cute": 1.0}
    assert "measured fastest of the providers the profile could not separate (predicted within 10%" in choice.reason
    # a wider margin takes the third in too
    wide = checked_policy(tmp_path, predicted, RecordingMeasured(measured.times), margin=0.6)
    assert wide.choose(CALL, H100, eligible).chosen == "cudnn_fused:torch"


def test_checked_keeps_the_prediction_where_it_cannot_time_and_says_why(tmp_path, caplog):
    from attn_dispatch.policy import MeasuredPolicy

    measured = MeasuredPolicy(directory=str(tmp_path / "cache"))
    policy = checked_policy(tmp_path, {"cudnn_fused:frontend": 1.02, "flash_attn_4:cute": 1.0}, measured)
    choice = policy.choose(CALL, H100, ["cudnn_fused:frontend", "flash_attn_4:cute"])  # a described H100
    assert choice.chosen == "flash_attn_4:cute" and choice.unit == "ms per step, predicted"
    assert "were not timed (the platform is not this machine" in choice.reason
    assert measured.cache_for(H100).entries() == {}  # nothing written
    assert "preference order decides" not in caplog.text  # the measured policy's fallback is not this one's


def test_checked_uses_a_bucket_timed_earlier_where_it_cannot_time_now(tmp_path):
    """A bucket timed before for the close providers answers on a platform that cannot time now (auto would not use
    it: it lacks FA2, predicted far slower and never timed)."""
    earlier = {"times_ms": {"cudnn_fused:frontend": 0.8}, "probe_ms": {"flash_attn_4:cute": 1.9}}
    measured = RecordingMeasured(None, earlier)
    predicted = {"cudnn_fused:frontend": 1.02, "flash_attn_4:cute": 1.0, "flash_attn_2:torch": 1.5}
    policy = checked_policy(tmp_path, predicted, measured)
    eligible = ["cudnn_fused:frontend", "flash_attn_4:cute", "flash_attn_2:torch"]
    choice = policy.choose(CALL, H100, eligible)
    assert choice.chosen == "cudnn_fused:frontend" and measured.asked == []
    assert "timed earlier on this machine, bucket bucket-1" in choice.reason
    # a bucket missing one of the close providers does not decide
    measured.earlier = {"times_ms": {"cudnn_fused:frontend": 0.8}}
    assert policy.choose(CALL, H100, eligible).chosen == "flash_attn_4:cute"


def test_checked_defers_to_auto_where_auto_does_not_predict_and_rejects_a_bad_margin(tmp_path):
    from attn_dispatch.policy import CheckedPolicy

    measured = RecordingMeasured({"flash_attn_2:package": 1.0, "cudnn_fused:frontend": 2.0})
    policy = CheckedPolicy(AutoPolicy(directory=tmp_path), measured)  # no profile for the architecture
    choice = policy.choose(AttentionParams(), A100, ["flash_attn_2:package", "cudnn_fused:frontend"])
    assert choice.chosen == "flash_attn_2:package" and "no performance profile for sm80" in choice.reason
    assert measured.asked == []
    with pytest.raises(ValueError, match="margin=0 must be > 0"):
        CheckedPolicy(AutoPolicy(directory=tmp_path), measured, margin=0)


def test_env_selects_the_checked_policy_and_set_policy_keeps_it_on_the_measured_one(monkeypatch):
    from attn_dispatch.policy import MeasuredPolicy

    p = AttentionParams(max_seqlen_q=8192, batch_size=4, attn_mask_type="causal")
    d = explain(p, H100, EnvFlags.from_environ({"ATTN_DISPATCH_POLICY": "checked"}))
    assert d.policy == "checked" and d.chosen in d.estimates and "predicted fastest" in d.policy_reason
    assert "not timed" in d.policy_reason  # a described platform is never timed
    monkeypatch.setattr(selection, "_POLICIES", {})
    mine = MeasuredPolicy(directory="/nonexistent/attn-dispatch-test")
    selection.set_policy("measured", mine)
    checked = selection.policy_named("checked")
    assert checked.measured is mine and checked.auto.measured is mine


def test_flex_on_dense_calls_is_predicted_relative_to_the_others_never_from_a_rate_of_its_own(tmp_path):
    # flex takes 0.8x FA2's time on every measured windowed call: read as a rate off the nearest call of 1/4 the work,
    # its low host floor would have it predicted far faster on a bigger call; relative, it stays at 0.8x FA2's
    flex, fa2 = "flex_attention:torch", "flash_attn_2:torch"
    base = dict(attn_mask_type="causal", window_size=(256, 0), head_dim_qk=64, head_dim_v=64)
    rows = [(dict(base, max_seqlen_q=s), {fa2: 0.1 * s / 1024, flex: 0.08 * s / 1024}) for s in (1024, 2048, 4096)]
    profile = Profile(json.loads((synthetic_profile(tmp_path, rows) / "sm90.json").read_text()))
    assert all(flex not in e.times_ms for e in profile.entries)  # no rate of its own
    p = AttentionParams(**dict(base, max_seqlen_q=8192))
    assert flex not in profile.predict(p).times_ms
    found = profile.predict(p, among=[fa2, flex])
    assert found.times_ms[flex] == pytest.approx(0.8 * found.times_ms[fa2], rel=1e-6)
    assert len(found.relative[flex]) == COST_MODEL.relative_k and found.best([fa2, flex]) == flex
    # fewer measured calls than relative_k: no prediction, so the rated provider is picked
    profile = Profile(json.loads((synthetic_profile(tmp_path, rows[:2]) / "sm90.json").read_text()))
    assert flex not in profile.predict(p, among=[fa2, flex]).times_ms


def test_flex_is_read_relative_to_the_others_on_windowed_dense_calls_alone(tmp_path):
    # the same measured ratio on unmasked and causal calls predicts nothing: there the tiled engines run the same
    # kernels without a mask function, and far-off measured calls would read flex faster than them
    flex, fa2 = "flex_attention:torch", "flash_attn_2:torch"
    for mask, window in (("no_mask", (-1, -1)), ("causal", (-1, -1)), ("causal", (256, 0))):
        base = dict(attn_mask_type=mask, window_size=window, head_dim_qk=64, head_dim_v=64)
        rows = [(dict(base, max_seqlen_q=s), {fa2: 0.1 * s / 1024, flex: 0.08 * s / 1024}) for s in (1024, 2048, 4096)]
        profile = Profile(json.loads((synthetic_profile(tmp_path, rows) / "sm90.json").read_text()))
        found = profile.predict(AttentionParams(**dict(base, max_seqlen_q=8192)), among=[fa2, flex])
        assert (flex in found.times_ms) == (window != (-1, -1)), (mask, window)
        assert fa2 in found.times_ms


def test_flex_read_relative_to_an_engine_that_skips_no_window_tile_follows_their_work_ratio(tmp_path):
    # cuDNN's backward under a two-sided window computes every tile, flex's skips the band's outside: on a longer
    # call under the same window flex's share of cuDNN's time shrinks with the work, not with the nearest ratio
    flex, cudnn = "flex_attention:torch", "cudnn_fused:frontend"
    base = dict(attn_mask_type="no_mask", window_size=(128, 128), is_training=True, head_dim_qk=64, head_dim_v=64)

    def works(s: int) -> tuple[float, float]:
        p = AttentionParams(**dict(base, max_seqlen_q=s, max_seqlen_kv=s))
        windowed, unwindowed = profile_work(p), unwindowed_work(p)
        return provider_work(flex, windowed, unwindowed), provider_work(cudnn, windowed, unwindowed)

    rows = [(dict(base, max_seqlen_q=s, max_seqlen_kv=s), {cudnn: 1e-9 * works(s)[1], flex: 1e-8 * works(s)[0]})
            for s in (1024, 2048, 4096)]
    profile = Profile(json.loads((synthetic_profile(tmp_path, rows) / "sm90.json").read_text()))
    found = profile.predict(AttentionParams(**dict(base, max_seqlen_q=16384, max_seqlen_kv=16384)),
                            among=[cudnn, flex])
    flex_work, cudnn_work = works(16384)
    assert flex_work < 0.05 * cudnn_work
    assert found.times_ms[flex] == pytest.approx(found.times_ms[cudnn] * 10.0 * flex_work / cudnn_work, rel=1e-4)
    assert found.best([cudnn, flex]) == flex  # the nearest calls' ratios alone read flex slower (1.2-4x)
    assert all(r[flex] > r[cudnn] for _, r in rows)
    choice = AutoPolicy(directory=tmp_path).choose(AttentionParams(**dict(base, max_seqlen_q=16384,
                                                                          max_seqlen_kv=16384)), H100, [cudnn, flex])
    assert choice.chosen == flex and f"x their work ratio here over there ({cudnn}" in choice.reason


def test_a_re_measure_of_one_provider_alone_joins_the_calls_times():
    # a run that timed flex alone (settled on its dynamic compile) shares no provider with the others of the call
    packed = AttentionParams(qkv_format="thd", attn_mask_type="padding", max_seqlen_q=2048).to_dict()
    row = lambda times, **kw: {"label": "p", "params": packed, "times_ms": times, **kw}  # noqa: E731
    full = {"machine": "m", "rows": [row({"x:cudnn": 1.0, "flex:t": 3.0})]}
    settled = {"machine": "m", "rows": [row({"flex:t": 2.0}, flex_settled_dynamic=["flex:t"])]}
    data = build([full, settled], arch="sm90", stack={}, date="")
    assert data["entries"][0]["times_ms"] == {"x:cudnn": 1.0, "flex:t": 2.0}


def test_an_unsplit_gpu_bound_step_gives_a_gpu_rate_and_a_short_one_does_not():
    # split entries read 'x:a' at one rate; the call's nearest entry, measured without a split, ran it twice as fast
    def entry(label: str, s: int, ms: float, split: bool) -> dict:
        params = AttentionParams(max_seqlen_q=s, batch_size=4, attn_mask_type="causal")
        kind, log2, fmt = features(params)
        found = {"label": label, "machine": 0, "kind": list(kind), "log2": log2, "fmt": fmt,
                 "work": profile_work(params), "times_ms": {"x:a": ms}}
        if split:
            found.update(host_ms={"x:a": 0.05}, gpu_ms={"x:a": ms})
        return found

    def predicted(unsplit_ms: float, bound_ms: float) -> float:
        entries = [entry(f"split{s}", s, 2.0 * (s / 1024) ** 2, True) for s in (1024, 2048)]
        entries.append(entry("unsplit", 8192, unsplit_ms, False))
        data = {"arch": "sm90", "machines": ["test GPU"], "entries": entries}
        profile = Profile(data, model=dataclasses.replace(COST_MODEL, unsplit_gpu_bound_ms=bound_ms, k=1))
        return profile.predict(AttentionParams(max_seqlen_q=8192, batch_size=4, attn_mask_type="causal"),
                               machine="test GPU").times_ms["x:a"]

    split_only = predicted(64.0, 0.0)
    assert 110.0 < split_only < 135.0  # the split entries' rate: about 2 ms at 1024 tokens times the work's 64x
    assert predicted(64.0, 5.0) == pytest.approx(64.0, rel=0.02)  # its own measured step, GPU-bound
    assert predicted(4.0, 5.0) == pytest.approx(split_only)  # a step under the bound may be partly host: not read
