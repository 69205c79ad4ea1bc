"""The timer's controls (issue 12) on the CPU: cuts need confirmation, block timing's arithmetic, the benchmark's
A/A twin column and its measured column.

The arithmetic tests drive time_interleaved with a clock of their own (timing._clock): each function advances it
by a known cost, so every figure can be checked exactly. The rest time real engines on the CPU, a real timing
target (see tests/test_policy.py)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from attn_dispatch import Platform, selection
from attn_dispatch.benchmarking.cases import Case
from attn_dispatch.policy import BucketScheme, MeasuredPolicy, TimerSettings
from attn_dispatch.policy import timing
from attn_dispatch.policy.timing import block_calls, time_interleaved
from tests.test_policy import BOTH, FAST, CountingEngine, cpu_params, two_engines  # noqa: F401 - a fixture
from tests.test_policy import _one_thread  # noqa: F401 - autouse: steady CPU timings on a shared machine

ROOT = Path(__file__).resolve().parents[1]


class FakeClock:
    """time_interleaved's CPU clock, advanced only by the functions below (in milliseconds)."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.log: list[str] = []

    def __call__(self) -> float:
        return self.now_ms / 1e3

    def function(self, name: str, cost_ms):
        """A function costing cost_ms(call index, name of the function called just before) each call."""
        def fn() -> None:
            before = self.log[-1] if self.log else None
            self.now_ms += cost_ms(sum(1 for n in self.log if n == name), before)
            self.log.append(name)
        return fn


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timing, "_clock", fake)
    return fake


# --- cutting short needs confirmation ---------------------------------------------------------------------

def test_a_slow_estimate_alone_does_not_cut_a_function(clock):
    """A function whose first timed call is slow (a JIT compile or graph build finishing late) and which is the
    fastest afterwards: one estimate cut it (the old rule); confirmation keeps it and finds it fastest."""
    def late_compile(i, _before):
        return 10.0 if i == 1 else 0.1  # call 0: untimed first call; call 1: the estimate

    def run(confirm: int):
        clock.log.clear()
        fns = {"late": clock.function("late", late_compile), "steady": clock.function("steady", lambda i, b: 0.2)}
        settings = TimerSettings(warmup=2, reps=4, max_reps=4, target_ms=0.0, confirm=confirm)
        timings, errors = time_interleaved(fns, "cpu", settings, cutoff_ratio=2.0)
        assert not errors
        return timings

    without = run(confirm=0)
    assert without["late"].cut_short and without["late"].median_ms == 10.0  # the miss confirmation prevents
    with_confirmation = run(confirm=2)
    late, steady = with_confirmation["late"], with_confirmation["steady"]
    assert not late.cut_short and late.median_ms == pytest.approx(0.1) and steady.median_ms == pytest.approx(0.2)
    assert clock.log.count("late") == 1 + 1 + 2 + 4  # first call, estimate, confirmation, timed rounds


def test_a_function_slow_on_every_call_is_cut_after_its_confirmation(clock):
    fns = {"slow": clock.function("slow", lambda i, b: 5.0), "fast": clock.function("fast", lambda i, b: 1.0)}
    settings = TimerSettings(warmup=2, reps=3, max_reps=3, target_ms=0.0, confirm=2)
    timings, _ = time_interleaved(fns, "cpu", settings, cutoff_ratio=2.0)
    assert timings["slow"].cut_short and timings["slow"].reps == 3
    assert timings["slow"].samples_ms == pytest.approx([5.0] * 3)
    assert clock.log.count("slow") == 1 + 3 and clock.log.count("fast") == 1 + 3 + 3
    # a function cut by an absolute cutoff is confirmed the same way; never_cut names are timed in full
    clock.log.clear()
    timings, _ = time_interleaved(fns, "cpu", settings, cutoff_ms=2.0, never_cut=frozenset({"fast"}))
    assert timings["slow"].cut_short and not timings["fast"].cut_short
    timings, _ = time_interleaved(fns, "cpu", settings, cutoff_ratio=2.0, never_cut=frozenset({"slow"}))
    assert not timings["slow"].cut_short and timings["slow"].median_ms == pytest.approx(5.0)


def test_confirmation_takes_blocks_of_cheap_functions_and_single_calls_of_slow_ones(clock):
    """In block mode a cut is confirmed the way the timed rounds sample (a block of a cheap function), but a slow
    function costs one call per confirmation: confirming that it is far slower stays cheap."""
    fns = {"cheap": clock.function("cheap", lambda i, b: 0.1), "slow": clock.function("slow", lambda i, b: 5.0)}
    settings = TimerSettings(warmup=2, reps=3, max_reps=3, target_ms=0.0, confirm=2, block_ms=1.0)
    timings, _ = time_interleaved(fns, "cpu", settings, cutoff_ratio=2.0)
    assert timings["slow"].cut_short and clock.log.count("slow") == 1 + 1 + 2
    # cheap: first call, estimate, 2 confirming blocks and 3 timed blocks of a lead-in + 10 calls
    assert clock.log.count("cheap") == 1 + 1 + 5 * (1 + 10) and timings["cheap"].calls_per_sample == 10
    assert timings["cheap"].median_ms == pytest.approx(0.1)


def test_no_confirmation_rounds_when_nothing_is_over_a_cutoff(clock):
    fns = {"a": clock.function("a", lambda i, b: 1.0), "b": clock.function("b", lambda i, b: 1.5)}
    time_interleaved(fns, "cpu", TimerSettings(warmup=1, reps=2, max_reps=2, target_ms=0.0, confirm=5),
                     cutoff_ratio=2.0)
    assert clock.log.count("a") == 1 + 1 + 1  # first call, estimate (also the first sample: warmup=1), one more rep


# --- block timing -----------------------------------------------------------------------------------------

def test_block_calls_fill_the_block_and_stay_in_bounds():
    assert block_calls(0.05, 1.0) == 20 and block_calls(0.3, 1.0) == 3 and block_calls(0.7, 1.0) == 1
    assert block_calls(5.0, 1.0) == 1 and block_calls(0.0, 1.0) == timing.MAX_BLOCK_CALLS
    assert block_calls(1e-9, 1.0) == timing.MAX_BLOCK_CALLS
    with pytest.raises(ValueError, match="block_ms=-1"):
        TimerSettings(block_ms=-1)
    with pytest.raises(ValueError, match="confirm=-1"):
        TimerSettings(confirm=-1)


def test_block_samples_are_block_time_over_calls_and_count_every_call(clock):
    fns = {"a": clock.function("a", lambda i, b: 0.1), "b": clock.function("b", lambda i, b: 0.25),
           "long": clock.function("long", lambda i, b: 0.8)}
    settings = TimerSettings(warmup=1, reps=3, max_reps=3, target_ms=0.0, confirm=0, block_ms=1.0)
    timings, errors = time_interleaved(fns, "cpu", settings)
    assert not errors
    assert [timings[n].calls_per_sample for n in ("a", "b", "long")] == [10, 4, 1]
    assert timings["a"].samples_ms == pytest.approx([0.1] * 3) and timings["b"].samples_ms == pytest.approx([0.25] * 3)
    # too long for two calls in a block: one call per sample, no lead-in
    assert timings["long"].samples_ms == pytest.approx([0.8] * 3) and clock.log.count("long") == 2 + 3
    assert timings["a"].to_dict()["calls_per_sample"] == 10 and "calls_per_sample" not in \
        timing.Timing(1.0, 1.0, 1).to_dict()
    # first call + estimate (not a sample in block mode) + 3 blocks of (lead-in + n calls)
    assert clock.log.count("a") == 2 + 3 * (1 + 10) and clock.log.count("b") == 2 + 3 * (1 + 4)
    # each block's calls run back to back (a lead-in and n calls): after the first call and the estimate, runs of
    # 11 and 5 calls (two blocks in a row where one round ends and the next begins with the same function)
    runs, tail = [], [name for name in clock.log if name != "long"][4:]
    while tail:
        n = next((i for i, name in enumerate(tail) if name != tail[0]), len(tail))
        runs.append((tail[0], n))
        tail = tail[n:]
    assert all(n % (11 if name == "a" else 5) == 0 for name, n in runs), runs


def test_block_samples_leave_out_what_the_previous_function_left_behind(clock):
    """A cost that depends on what ran just before (a queue that hides host time, a clock a heavy kernel left):
    per-call samples carry it, so two copies of one function differ by where the rotation put them; block samples
    (after a lead-in call of the function itself) do not."""
    def after_other(i, before):
        return 1.0 if before not in (None, "a", "a_twin") else 0.5  # slower after "heavy"

    def make():
        clock.log.clear()
        return {"a": clock.function("a", after_other), "a_twin": clock.function("a_twin", after_other),
                "heavy": clock.function("heavy", lambda i, b: 3.0)}

    per_call, _ = time_interleaved(make(), "cpu", TimerSettings(warmup=1, reps=12, max_reps=12, target_ms=0.0))
    spread = {per_call["a"].samples_ms.count(1.0), per_call["a_twin"].samples_ms.count(1.0)}
    assert spread != {0}  # per call, some samples followed "heavy"
    blocks, _ = time_interleaved(make(), "cpu", TimerSettings(warmup=1, reps=12, max_reps=12, target_ms=0.0,
                                                              block_ms=2.0))
    for name in ("a", "a_twin"):
        assert blocks[name].samples_ms == pytest.approx([0.5] * 12), name


# --- the measured policy: a late compile no longer loses the bucket ------------------------------------

class LateCompileEngine(CountingEngine):
    """The fastest engine, but its second forward is slow (as a JIT compile finishing on the second call)."""

    def forward(self, q, k, v, aux, cfg):
        if self.forwards == 1:
            import time

            time.sleep(0.3)
        return super().forward(q, k, v, aux, cfg)


def test_measured_policy_confirms_before_pruning(two_engines, monkeypatch, tmp_path):  # noqa: F811
    from attn_dispatch import backends

    late = LateCompileEngine()
    late.provider = "fast"
    monkeypatch.setitem(backends._INSTANCES, "unfused:fast", late)
    two_engines["unfused:slow"].delay_s = 0.03
    policy = MeasuredPolicy(settings=FAST, directory=str(tmp_path))
    result = policy.tune(cpu_params(is_training=False), Platform.detect(), BOTH)
    assert result.chosen == "unfused:fast", result.entry
    assert "unfused:fast" in result.entry["times_ms"] and result.entry["times_ms"]["unfused:fast"] < 30.0
    assert result.entry["tuning_s"] > 0


def test_measured_policy_with_block_timing_picks_the_faster_engine(two_engines, tmp_path):  # noqa: F811
    two_engines["unfused:slow"].delay_s = 0.02
    settings = TimerSettings(warmup=1, reps=3, max_reps=3, target_ms=0.0, confirm=1, block_ms=5.0)
    policy = MeasuredPolicy(settings=settings, directory=str(tmp_path), prune_ratio=1000.0)
    params = cpu_params(is_training=False)
    result = policy.tune(params, Platform.detect(), BOTH)
    assert result.chosen == "unfused:fast" and set(result.entry["times_ms"]) == set(BOTH)
    assert result.entry["settings"]["block_ms"] == 5.0
    assert policy.lookup(params, Platform.detect()) == result.entry
    assert BucketScheme().key(params) == result.bucket


def test_the_tuned_step_takes_the_modules_bound_call_where_the_module_does(monkeypatch):
    """engine_step calls bind_fast's function where DotProductAttention's repeat calls would (dense, no dropout)
    and the engine's autograd wrapper where they would not (packed calls); both compute the same attention."""
    from attn_dispatch.backends.unfused import UnfusedEngine

    bound_calls = []

    class Binding(UnfusedEngine):
        def bind_fast(self, q, k, v, aux, cfg):
            def call(q, k, v):
                bound_calls.append(1)
                return self(q, k, v, aux, cfg, flatten_heads=True)[0]
            return call

    engine = Binding()
    dense = cpu_params(is_training=True)
    call = timing.build_inputs(dense, seed=2, with_dout=True)
    timing.engine_step(engine, call, "fwd_bwd")()
    assert len(bound_calls) == 1
    packed = cpu_params(qkv_format="thd", attn_mask_type="padding", is_training=True)
    timing.engine_step(engine, timing.build_inputs(packed, seed=2, with_dout=True), "fwd_bwd")()
    assert len(bound_calls) == 1  # thd: the module plans each call (cu_seqlens are read per call)
    # the bound and unbound steps leave the same gradients
    grads = []
    for step_engine in (engine, UnfusedEngine()):
        step = timing.engine_step(step_engine, call, "fwd_bwd")
        step()
        leaves = step.__closure__  # the step's q, k, v leaves hold the gradients
        grads.append([c.cell_contents.grad.clone() for c in leaves
                      if isinstance(c.cell_contents, torch.Tensor) and c.cell_contents.grad is not None])
    assert len(grads[0]) == 3 and all(torch.equal(a, b) for a, b in zip(*grads))


# --- the benchmark's A/A twin and measured columns -----------------------------------------------------------

def _bench_user_step():
    """The script as it runs: its own folder on sys.path (it imports its sibling host_probe)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_user_step", ROOT / "benchmarks" / "bench_user_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_row_has_an_aa_twin_and_its_measured_column_runs_the_measured_pick(two_engines, tmp_path,  # noqa: F811
                                                                                 monkeypatch):
    """On the CPU with two test engines ('slow' first in the order, so the default picks it; the measured policy
    picks 'fast'): the twin is the default's pick forced again, and the measured column times the measured pick.
    The session-4 harness planned that module again after a decision-cache clear and timed the default's pick."""
    bench = _bench_user_step()
    two_engines["unfused:slow"].delay_s = 0.02
    monkeypatch.setattr(bench, "DTYPE", torch.float32)
    selection.set_policy("measured", MeasuredPolicy(settings=FAST))
    monkeypatch.setenv("ATTN_DISPATCH_CACHE_DIR", str(tmp_path / "auto"))
    case = Case(b=2, s=32, h=2, d=16, mask="no_mask", train=False, name="cpu")
    settings = TimerSettings(warmup=1, reps=3, max_reps=3, target_ms=0.0, confirm=1, block_ms=10.0)
    row = bench.run_case(case, True, 0, None, torch.device("cpu"), str(tmp_path / "measured"), settings)
    times = row["times_ms"]
    assert row["default_pick"] == "unfused:slow" and row["measured_pick"] == "unfused:fast"
    assert {"unfused:slow", "unfused:fast", "default", "pick_twin", "measured", "sdpa"} <= set(times)
    assert "measured" not in row["errors"], row["errors"]
    assert times["measured"] < times["unfused:slow"] / 4  # it ran 'fast', not the default's 'slow'
    assert row["aa_ratio"] == pytest.approx(times["pick_twin"] / times["unfused:slow"])
    assert 0.7 < row["aa_ratio"] < 1.4  # 20 ms of sleep each: the same engine twice
    # a 20 ms call is sampled one call at a time (the block arithmetic itself: the fake-clock tests above; how many
    # calls the fast engine's blocks hold depends on its one-call estimate, which a loaded CI host can stretch)
    assert row.get("calls_per_sample", {}).get("unfused:slow", 1) == 1


def test_bench_timer_settings():
    bench = _bench_user_step()
    assert bench.settings_for("block").block_ms == bench.BLOCK_MS > 0
    assert bench.settings_for("call").block_ms == 0.0 and bench.settings_for("call").reps == bench.SETTINGS.reps
    with pytest.raises(ValueError, match="timer='fast'"):
        bench.settings_for("fast")


@pytest.mark.parametrize("n", range(2, 10))
def test_round_order_balances_who_goes_first_and_who_follows_whom(n):
    """Over a full cycle of rounds (n, or 2n for an odd count) every name goes first equally often and follows
    every other name equally often: a carryover from the call before (a GPU clock a heavy kernel leaves) then
    lands on every column alike. The rotation used before failed this (the default's column followed its twin,
    running the same engine, in most rounds, the forced pick's in none)."""
    from collections import Counter

    from attn_dispatch.policy.timing import round_order

    names = [f"f{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    rounds = [round_order(names, r) for r in range(cycle)]
    assert all(sorted(order) == names for order in rounds)
    assert set(Counter(order[0] for order in rounds).values()) == {cycle // n}
    follows = Counter(pair for order in rounds for pair in zip(order, order[1:]))
    assert len(follows) == n * (n - 1) and set(follows.values()) == {cycle // n}


def test_a_rows_error_for_a_forced_refusal_keeps_the_forced_providers_reasons():
    """A forced provider's refusal is recorded as its own reasons (the message's head, which repeats the call and
    platform, cut a 400-character record before them)."""
    from attn_dispatch import DotProductAttention
    from attn_dispatch.decision import NoBackendAvailableError

    bench = _bench_user_step()
    module = DotProductAttention(4, 64, attn_mask_type="causal", qkv_format="bshd", backend="flash_attn_2:torch")
    q = torch.randn(1, 128, 4, 64)
    with pytest.raises(NoBackendAvailableError) as info:
        module(q, q, q)
    text = bench.error_text(info.value)
    assert text.startswith("NoBackendAvailableError: flash_attn_2:torch refused: [flash_attn_2.")
    assert "call:" not in text and "float32" in text
    assert bench.error_text(ValueError("x" * 500)) == "ValueError: " + "x" * 388


def test_a_packed_row_settles_flex_on_a_pack_of_another_length_first(monkeypatch):
    """FlexAttention's compiled copy turns dynamic at a second length; the bench steps each flex provider once on the
    pack one token shorter before timing, so every row times the graph a training loop's varying packs run."""
    bench = _bench_user_step()
    seen = []

    def fake_module(case, provider, device):
        def call(q, k, v, **kwargs):
            seen.append((provider, q.shape[0], kwargs["cu_seqlens_q"].tolist(), torch.is_grad_enabled()))
            return q.sum(-1, keepdim=True).flatten(1)
        return call
    monkeypatch.setattr(bench, "module_for", fake_module)
    lens = (5, 9, 4)
    case = Case(b=3, s=9, h=2, d=4, mask="padding", fmt="thd", seqlens=lens, train=True, name="cpu")
    q, k, v, dout, kwargs = bench.make_tensors(case, torch.device("cpu"), 0)
    dout = dout[:, :case.h]  # the fake module returns [t, h]
    eligible = ["flash_attn_2:torch", "flex_attention:torch", "flex_attention:flash_attn_4"]
    assert bench.settle_flex_on_packs(case, eligible, q, k, v, dout, kwargs) == eligible[1:]
    assert [s[0] for s in seen] == eligible[1:]
    assert all(s[1:] == (17, [0, 5, 14, 17], True) for s in seen)  # 18 tokens, the last sequence one shorter
    assert q.grad is None and kwargs["cu_seqlens_q"].tolist() == [0, 5, 14, 18]  # the timed inputs untouched
    # a one-token last sequence is dropped; a dense call is not settled
    q1, _, _, _, kw1 = bench.one_token_shorter(q[:15], k[:15], v[:15], dout[:15],
                                               {**kwargs, "cu_seqlens_q": torch.tensor([0, 5, 14, 15]),
                                                "cu_seqlens_kv": torch.tensor([0, 5, 14, 15])})
    assert q1.shape[0] == 14 and kw1["cu_seqlens_kv"].tolist() == [0, 5, 14]
    dense = Case(b=2, s=8, h=2, d=4, mask="causal", train=False, name="cpu")
    assert bench.settle_flex_on_packs(dense, eligible, q, k, v, dout, kwargs) == []
