"""Measured policy (issue 8) on the CPU: buckets, timing, the persistent cache, the policy's pick, tune and bench.

Two test engines wrap the real unfused engine (one deliberately slowed) and get their own constraint tables,
so selection, timing, pruning and caching run their real code paths."""
from __future__ import annotations

import json
import math
import time

import pytest
import torch

from attn_dispatch import AttentionParams, DotProductAttention, Platform, backends, constraints, select, selection
from attn_dispatch.backends.unfused import UnfusedEngine
from attn_dispatch.cli import main
from attn_dispatch.constraints.base import Table, fail
from attn_dispatch.policy import BucketScheme, MeasuredPolicy, TimerSettings, TuningCache
from attn_dispatch.policy.buckets import round_up_steps
from attn_dispatch.policy.cache import CorruptCacheWarning, cache_dir, platform_key
from attn_dispatch.benchmarking.grid import load_shapes, shape_label
from attn_dispatch.policy.measured import why_not_tunable
from attn_dispatch.policy.timing import (attended_pairs, attention_flops, build_inputs, engine_step, time_engine,
                                        time_interleaved)
from spawn_ranks import run_ranks

FAST = TimerSettings(warmup=1, reps=3, max_reps=5, target_ms=0.0, confirm=1)


@pytest.fixture(autouse=True)
def _one_thread():
    """Timing tests compare engines: on a busy CI machine, intra-op threads waiting on each other turn a 0.5 ms
    call into tens of ms. One thread keeps the timings steady."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cpu_params(**kw) -> AttentionParams:
    base = dict(dtype="float32", batch_size=2, num_heads=2, head_dim_qk=16, max_seqlen_q=32, device_type="cpu")
    return AttentionParams(**{**base, **kw})


# --- buckets --------------------------------------------------------------------------------------------

def test_seqlen_steps_round_up_keep_powers_of_two_and_multiples_of_64():
    for n in range(1, 5000):
        r = round_up_steps(n, 4)
        assert r >= n and (n < 17 or r < n * 1.26), (n, r)
        if n % 64 == 0:
            assert r % 64 == 0, (n, r)
    assert [round_up_steps(2 ** k, 4) for k in range(15)] == [2 ** k for k in range(15)]
    assert len({round_up_steps(n, 4) for n in range(1024, 2048 + 1)}) == 5  # 4 per octave (+ 2048 itself)
    assert round_up_steps(3000, 1) == 4096 and round_up_steps(3000, 4) == 3072 and round_up_steps(16534, 4) == 20480


def test_bucket_representative_is_the_largest_shape_and_keeps_the_kernel_choosing_fields():
    scheme = BucketScheme()
    p = AttentionParams(batch_size=6, max_seqlen_q=3000, max_seqlen_kv=1000, num_heads=16, num_gqa_groups=4,
                        head_dim_qk=128, attn_mask_type="causal", dtype="bf16")
    rep = scheme.representative(p)
    # off the 128 grid, the representative stays off it (the tail-masking kernels are what runs)
    assert (rep.batch_size, rep.max_seqlen_q, rep.max_seqlen_kv) == (8, 3071, 1023)
    aligned = scheme.representative(p.replace(max_seqlen_q=2944, max_seqlen_kv=960))
    assert (aligned.max_seqlen_q, aligned.max_seqlen_kv) == (3072, 960)  # 2944 = 23 * 128; 960 = 7.5 * 128
    assert scheme.representative(p.replace(max_seqlen_q=2880)).max_seqlen_q == 3008  # multiple of 64, not of 128
    assert scheme.key(p) != scheme.key(p.replace(max_seqlen_q=3072))
    assert rep.replace(batch_size=6, max_seqlen_q=3000, max_seqlen_kv=1000) == p
    assert scheme.key(p) == scheme.key(p.replace(batch_size=7, max_seqlen_q=2900))
    for change in (dict(dtype="fp16"), dict(attn_mask_type="no_mask"), dict(is_training=False),
                   dict(num_gqa_groups=2), dict(head_dim_qk=64), dict(max_seqlen_q=3100), dict(batch_size=9)):
        assert scheme.key(p.replace(**change)) != scheme.key(p), change
    assert BucketScheme(seq_steps_per_octave=1).representative(p).max_seqlen_q == 4095  # powers of two, off-grid kept
    with pytest.raises(ValueError, match="seq_steps_per_octave=3"):
        BucketScheme(seq_steps_per_octave=3)


# --- timing ---------------------------------------------------------------------------------------------

def test_flops_count_attended_pairs():
    s = 64
    causal = cpu_params(max_seqlen_q=s, attn_mask_type="causal")
    assert attended_pairs(causal) == s * (s + 1) // 2
    assert attended_pairs(cpu_params(max_seqlen_q=s, window_size=(3, 0), attn_mask_type="causal")) == \
        sum(min(i, 3) + 1 for i in range(s))
    assert attended_pairs(cpu_params(max_seqlen_q=4, max_seqlen_kv=6, attn_mask_type="causal_bottom_right")) == \
        3 + 4 + 5 + 6
    full = cpu_params(max_seqlen_q=s, head_dim_qk=16, head_dim_v=32)
    assert attention_flops(full, "fwd") == 2 * s * s * (16 + 32) * 2 * 2
    assert attention_flops(full, "fwd_bwd") == pytest.approx(3.5 * attention_flops(full, "fwd"))
    with pytest.raises(ValueError, match="mode='bwd'"):
        attention_flops(full, "bwd")


@pytest.mark.parametrize("fmt,shape", [("bshd", (3, 40, 4, 16)), ("sbhd", (40, 3, 4, 16)), ("thd", (120, 4, 16))])
def test_synthetic_inputs_follow_layout_gqa_and_mask(fmt, shape):
    p = cpu_params(qkv_format=fmt, batch_size=3, max_seqlen_q=40, num_heads=4, num_gqa_groups=2,
                   attn_mask_type="padding_causal" if fmt != "thd" else "padding")
    call = build_inputs(p, seed=1, with_dout=True)
    assert tuple(call.q.shape) == shape and call.k.shape[-2] == 2 and call.dout.shape == call.q.shape
    assert call.aux.cu_seqlens_q.tolist() == [0, 40, 80, 120]
    assert call.cfg.softmax_scale == pytest.approx(1 / math.sqrt(16)) and call.cfg.qkv_format == fmt
    assert call.q.std() > 0.5  # random, not zeros
    with pytest.raises(ValueError, match="dtype='fp8'"):
        build_inputs(cpu_params(dtype="fp8"))


class CountingEngine(UnfusedEngine):
    provider = "counting"

    def __init__(self, delay_s: float = 0.0, fail: bool = False):
        super().__init__()
        self.delay_s, self.fail, self.forwards, self.backwards = delay_s, fail, 0, 0

    def forward(self, q, k, v, aux, cfg):
        self.forwards += 1
        if self.fail:
            raise RuntimeError("deliberate failure")
        if self.delay_s:
            time.sleep(self.delay_s)
        return super().forward(q, k, v, aux, cfg)

    def backward(self, *args):
        self.backwards += 1
        return super().backward(*args)


def test_timing_runs_the_engine_warmup_plus_reps_and_leaves_the_random_state_alone():
    engine = CountingEngine(delay_s=0.002)
    state = torch.get_rng_state()
    timing = time_engine(engine, cpu_params(dropout=0.1), "fwd_bwd", TimerSettings(warmup=2, reps=4, max_reps=4,
                                                                                  target_ms=0))
    assert torch.equal(state, torch.get_rng_state())
    assert (engine.forwards, engine.backwards, timing.reps) == (6, 6, 4)
    assert 2.0 <= timing.min_ms <= timing.median_ms
    inference = CountingEngine()
    time_engine(inference, cpu_params(is_training=False), None, TimerSettings(warmup=1, reps=2, max_reps=2))
    assert (inference.forwards, inference.backwards) == (3, 0)
    cut = CountingEngine(delay_s=0.01)
    timing = time_engine(cut, cpu_params(is_training=False), None, TimerSettings(warmup=3, reps=5), cutoff_ms=5.0)
    # the first call, the estimate and two confirming calls (TimerSettings.confirm)
    assert timing.cut_short and timing.reps == 3 and timing.min_ms >= 10.0 and cut.forwards == 4
    with pytest.raises(ValueError, match="max_reps=2 must be >= reps=3"):
        TimerSettings(reps=3, max_reps=2)
    with pytest.raises(ValueError, match="warm_ms=-1"):
        TimerSettings(warm_ms=-1)


def test_interleaved_timing_rotates_the_order_and_settles_before_timing():
    """Each function takes each position in a round equally often (so that no engine always runs first, after
    a pause), a warm period runs them all before the timed rounds, and times match what each function costs."""
    calls: list[str] = []

    def sleeper(name: str, seconds: float):
        def fn() -> None:
            calls.append(name)
            time.sleep(seconds)
        return fn

    fns = {"a": sleeper("a", 0.004), "b": sleeper("b", 0.001), "c": sleeper("c", 0.002)}
    settings = TimerSettings(warmup=1, reps=6, max_reps=6, target_ms=0.0, warm_ms=30.0)
    timings, errors = time_interleaved(fns, "cpu", settings)
    assert not errors and {name: t.reps for name, t in timings.items()} == {"a": 6, "b": 6, "c": 6}
    assert timings["b"].min_ms < timings["c"].min_ms < timings["a"].min_ms
    assert timings["a"].min_ms >= 4.0 and timings["b"].min_ms >= 1.0
    timed = calls[-18:]  # the six timed rounds
    firsts = [timed[i] for i in range(0, 18, 3)]
    assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]
    warm = calls[3 + 3:-18]  # after the first calls and the estimate: ceil(30 ms / (a + b + c)) rounds, at most 5
    rounds = len(warm) // 3
    assert 1 <= rounds <= 5 and all(warm.count(name) == rounds for name in "abc")


def test_interleaved_timing_cuts_far_slower_functions_and_survives_a_failing_one():
    def fail() -> None:
        raise RuntimeError("deliberate")

    counts = {"fast": 0, "slow": 0}

    def make(name: str, seconds: float):
        def fn() -> None:
            counts[name] += 1
            time.sleep(seconds)
        return fn

    fns = {"fast": make("fast", 0.001), "slow": make("slow", 0.05), "broken": fail}
    timings, errors = time_interleaved(fns, "cpu", TimerSettings(warmup=2, reps=4, max_reps=4, target_ms=0.0),
                                       cutoff_ratio=3.0)
    assert set(errors) == {"broken"} and "deliberate" in str(errors["broken"])
    # the first call, the estimate, two confirming calls (fast is timed with them: the best is re-measured)
    assert timings["slow"].cut_short and timings["slow"].reps == 3 and counts["slow"] == 4
    assert not timings["fast"].cut_short and timings["fast"].reps == 4 and counts["fast"] == 4 + 4  # + reps


def test_timed_step_computes_real_attention():
    """The timed unit is the engine's real work: its output matches a float64 softmax(QK^T)V on the inputs."""
    p = cpu_params(num_heads=4, num_gqa_groups=2, attn_mask_type="causal", is_training=False)
    call = build_inputs(p, seed=3)
    out = UnfusedEngine().forward(call.q, call.k, call.v, call.aux, call.cfg).out
    q, k, v = (t.double().permute(0, 2, 1, 3) for t in (call.q, call.k, call.v))
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-1, -2) * call.cfg.softmax_scale
    scores = scores.masked_fill(torch.ones(32, 32, dtype=torch.bool).triu(1), float("-inf"))
    ref = (scores.softmax(-1) @ v).permute(0, 2, 1, 3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    engine_step(UnfusedEngine(), call, "fwd")()
    with pytest.raises(ValueError, match="with_dout=True"):
        engine_step(UnfusedEngine(), call, "fwd_bwd")


# --- persistent cache -----------------------------------------------------------------------------------

H100 = Platform.parse("h100-cudnn9")


def test_cache_round_trip_and_location(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_DISPATCH_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("ATTN_DISPATCH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "attn-dispatch"
    cache = TuningCache(H100)
    assert cache.path.parent == tmp_path / "xdg" / "attn-dispatch"
    cache.put("bucket-a", {"times_ms": {"x:y": 1.5}, "chosen": "x:y"})
    again = TuningCache(H100)
    assert again.get("bucket-a") == {"times_ms": {"x:y": 1.5}, "chosen": "x:y"}
    assert again.get("bucket-b") is None
    data = json.loads(cache.path.read_text())
    assert data["platform"]["device_name"] == H100.device_name and data["platform"]["cudnn"] == H100.cudnn_version


def test_cache_key_includes_device_and_versions(tmp_path):
    base = TuningCache(H100, tmp_path)
    variants = [Platform.parse("h100-cudnn9,cudnn=9.1.0"), Platform.parse("h100-cudnn9,torch=2.5.1"),
                Platform.parse("h100-cudnn9,cuda=12.4"), Platform.parse("sm80,cudnn=9.5.0"),
                H100.with_packages(flash_attn_4="4.0.0b1"), H100.with_packages(cudnn_frontend="1.8.0")]
    paths = {TuningCache(p, tmp_path).path for p in variants}
    assert base.path not in paths and len(paths) == len(variants)
    assert TuningCache(Platform.parse("h100-cudnn9"), tmp_path).path == base.path
    key = platform_key(H100)
    assert {"device_name", "compute_capability", "cuda", "cudnn", "torch", "packages", "attn_dispatch"} <= set(key)


def test_corrupt_cache_file_is_moved_aside_and_rebuilt(tmp_path):
    cache = TuningCache(H100, tmp_path)
    cache.put("a", {"times_ms": {"p": 1.0}})
    for garbage in ('{"format": 1, "entr', json.dumps({"format": 1, "platform": {}, "entries": {}}),
                    json.dumps({"format": 1, "platform": cache.key, "entries": {"a": 3}})):
        cache.path.write_text(garbage)
        fresh = TuningCache(H100, tmp_path)
        with pytest.warns(CorruptCacheWarning, match="moved to"):
            assert fresh.get("a") is None
        fresh.put("b", {"times_ms": {"p": 2.0}})
        assert TuningCache(H100, tmp_path).entries() == {"b": {"times_ms": {"p": 2.0}}}
    assert len(list(tmp_path.glob("*.corrupt-*"))) == 3


def test_unwritable_cache_directory_keeps_results_in_memory(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = TuningCache(H100, blocker / "sub")
    cache.put("a", {"times_ms": {"p": 1.0}})  # mkdir fails: logged, not raised
    assert cache.get("a") == {"times_ms": {"p": 1.0}}
    assert "cannot use its measured-policy cache" in caplog.text


def _write_cache_entries(worker: int, directory: str, start) -> None:
    start.wait(timeout=60)  # every writer ready: their puts overlap
    for i in range(25):
        TuningCache(Platform.parse("h100-cudnn9"), directory).put(f"w{worker}-{i}", {"times_ms": {"p": i}})


def test_concurrent_writers_lose_nothing(tmp_path):
    import multiprocessing

    # four processes of their own, forked from a server that has imported torch (not four fresh interpreters)
    start = multiprocessing.get_context("forkserver").Barrier(4)
    failure = run_ranks(_write_cache_entries, (str(tmp_path), start), 4, "cache writer", 120)
    assert failure is None, failure
    entries = TuningCache(H100, tmp_path).entries()
    assert set(entries) == {f"w{w}-{i}" for w in range(4) for i in range(25)}
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


# --- the measured policy --------------------------------------------------------------------------------

def _test_table(provider: str) -> Table:
    table = Table("unfused", provider, f"test engine {provider}")

    @table.check("cpu_only_" + provider, requires="CPU", topic="platform", source="tests/test_policy.py")
    def _cpu(p, plat, env):
        return fail("test engines run on the CPU") if p.device_type != "cpu" else None
    return table


@pytest.fixture
def two_engines(monkeypatch, tmp_path):
    """'unfused:slow' first in the preference order, 'unfused:fast' second; a fresh cache directory."""
    engines = {"unfused:slow": CountingEngine(delay_s=0.06), "unfused:fast": CountingEngine()}
    for pid, engine in engines.items():
        engine.provider = pid.partition(":")[2]
        monkeypatch.setitem(backends._INSTANCES, pid, engine)
        monkeypatch.setitem(backends.ENGINE_CLASSES, pid, "tests.test_policy:CountingEngine")
    tables = {pid: _test_table(pid.partition(":")[2]) for pid in engines}
    monkeypatch.setattr(selection, "TABLES", tables)
    monkeypatch.setattr(constraints, "TABLES", tables)
    monkeypatch.setattr(selection, "_POLICIES", {})
    monkeypatch.setenv("ATTN_DISPATCH_CACHE_DIR", str(tmp_path))
    return engines


def _policy(**kw) -> MeasuredPolicy:
    policy = MeasuredPolicy(settings=FAST, **kw)
    selection.set_policy("measured", policy)
    return policy


BOTH = ["unfused:slow", "unfused:fast"]


def test_measured_policy_picks_the_faster_engine_and_remembers_it(two_engines, tmp_path):
    slow, fast = two_engines["unfused:slow"], two_engines["unfused:fast"]
    slow.delay_s = 0.25  # far beyond any noise on a busy CI machine, so that pruning is certain
    params = cpu_params()
    assert select(params, policy="order").chosen == "unfused:slow"  # the preference order
    _policy()
    assert select(params, policy="measured").chosen == "unfused:fast"
    entry = TuningCache(Platform.detect(), tmp_path).get(BucketScheme().key(params))
    assert entry["chosen"] == "unfused:fast" and entry["mode"] == "fwd_bwd"
    assert set(entry["times_ms"]) | set(entry["probe_ms"]) == {"unfused:slow", "unfused:fast"}
    assert entry["probe_ms"].get("unfused:slow", entry["times_ms"].get("unfused:slow")) >= 250.0
    # the slow engine lost the probe by far: pruned after one warm-up call, the estimate and its confirmation
    assert "unfused:slow" in entry["probe_ms"] and slow.forwards == 2 + FAST.confirm
    calls = (slow.forwards, fast.forwards)
    # a new process (fresh policy, empty decision cache) reads the file; a shape in the same bucket too
    selection.clear_cache()
    _policy()
    assert select(params.replace(max_seqlen_q=29, batch_size=2), policy="measured").chosen == "unfused:fast"
    assert (slow.forwards, fast.forwards) == calls


def test_a_bucket_is_timed_at_the_shape_of_the_call_that_reached_it(two_engines, monkeypatch):
    """The bucket's largest shape is its name, not what is timed: a host-bound engine's floor hides behind a larger
    shape's GPU time (blind7: flash-attn-4 picked at b42 from timings at b64, 1.59x cuDNN there). The first call's
    own shape is timed and recorded; a later call of the bucket reuses it and says at which shape it was timed."""
    from attn_dispatch.policy import measured

    timed = []
    through = measured.time_engines
    monkeypatch.setattr(measured, "time_engines", lambda engines, shape, *a, **kw: (timed.append(shape),
                                                                                     through(engines, shape, *a,
                                                                                             **kw))[1])
    two_engines["unfused:slow"].delay_s = 0.25
    policy = _policy()
    call = cpu_params().replace(batch_size=3, max_seqlen_q=29, max_seqlen_kv=29)
    assert BucketScheme().representative(call) != call
    decision = select(call, policy="measured")
    assert decision.chosen == "unfused:fast" and timed == [call]
    assert policy.lookup(call, Platform.detect())["shape"] == call.to_dict()
    other = call.replace(batch_size=4, max_seqlen_q=31, max_seqlen_kv=31)  # the same bucket
    again = select(other, policy="measured")
    assert again.chosen == "unfused:fast" and timed == [call]  # no new timing
    assert call.describe() in again.policy_reason


def test_on_a_gpu_the_unfused_engine_is_not_timed_beside_a_fused_one(monkeypatch, tmp_path):
    """Its probe at long lengths cost minutes per bucket and it never came within 4.1x of a fused engine on the
    H100/H200: the bucket records why it was left untimed, times the fused engines, and does not retime for it.
    Where nothing else is eligible (and on the CPU) it is timed as before."""
    from attn_dispatch.policy import measured
    from attn_dispatch.policy.timing import Timing

    timed = []

    def fake_time_engines(engines, shape, mode, settings, cutoff_ratio=None, lengths=None):
        timed.append(sorted(engines))
        return {pid: Timing(1.0 + i, 1.0 + i, 3) for i, pid in enumerate(sorted(engines))}, {}
    monkeypatch.setattr(measured, "time_engines", fake_time_engines)
    monkeypatch.setattr(measured, "why_not_tunable", lambda params, platform: None)
    monkeypatch.setattr(measured, "get_engine", lambda pid: object())
    gpu_call = cpu_params(device_type="cuda", dtype="bfloat16", max_seqlen_q=28672)
    both = ["cudnn_fused:torch", "flash_attn_2:torch", "unfused:pytorch"]
    policy = MeasuredPolicy(settings=FAST, directory=str(tmp_path))
    result = policy.tune_bucket(gpu_call, Platform.detect(), both)
    assert timed == [["cudnn_fused:torch", "flash_attn_2:torch"]] and result.chosen == "cudnn_fused:torch"
    assert "4.1x" in result.entry["skipped"]["unfused:pytorch"]
    policy.tune_bucket(gpu_call, Platform.detect(), both)
    assert len(timed) == 1  # skipped counts as settled: no retiming
    assert measured.left_untimed(gpu_call, ["unfused:pytorch"]) == {}
    assert measured.left_untimed(cpu_params(), ["unfused:pytorch", "cudnn_fused:torch"]) == {}


def test_a_packed_call_is_timed_on_its_own_sequence_lengths(two_engines, monkeypatch):
    """On a small packed call the engines rank by the tokens present (eval-blind16: full-length timing picked cuDNN
    at 2.2x FA2's time): the module hands selection the call's validated lengths, the measured policy times on
    them and records them; a dense call, or a packed one described without its lengths (the CLI's tune), is timed
    on full-length sequences. The decision's cache does not key on them: the bucket is timed once."""
    from attn_dispatch.policy import measured

    seen = []
    through = measured.time_engines

    def spy(engines, shape, *args, lengths=None, **kw):
        seen.append((shape.qkv_format, lengths))
        return through(engines, shape, *args, lengths=lengths, **kw)
    monkeypatch.setattr(measured, "time_engines", spy)
    two_engines["unfused:slow"].delay_s = 0.25
    policy = _policy()
    monkeypatch.setenv("ATTN_DISPATCH_POLICY", "measured")
    lens = [5, 9, 3]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    q, k, v = (torch.randn(17, 2, 16) for _ in range(3))
    module = DotProductAttention(2, 16, qkv_format="thd", attn_mask_type="padding_causal").eval()
    with torch.no_grad():
        out = module(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    assert out.shape == (17, 32) and module.last_decision.chosen == "unfused:fast"
    assert seen == [("thd", ((5, 9, 3), (5, 9, 3)))]
    params = AttentionParams(**module.last_decision.params)
    assert policy.lookup(params, Platform.detect())["lengths"] == [lens, lens]
    # what the timer builds from them: those sequences, with those offsets
    call = build_inputs(params, lengths=((5, 9, 3), (5, 9, 3)))
    assert call.aux.cu_seqlens_q.tolist() == [0, 5, 14, 17] and call.q.shape[0] == 17
    with pytest.raises(ValueError, match=r"query lengths \[5, 9\] do not fit batch_size=3"):
        build_inputs(params, lengths=((5, 9), (5, 9)))
    with pytest.raises(ValueError, match="lengths are given for a call without padding"):
        build_inputs(cpu_params(), lengths=((5,), (5,)))
    # a dense call: full lengths
    select(cpu_params(max_seqlen_q=48), policy="measured")
    assert seen[-1] == ("bshd", None)
    # an entry from before entries recorded their lengths (timed on full lengths) is timed again, once
    bucket = BucketScheme().key(params)
    old = dict(policy.lookup(params, Platform.detect()))
    del old["lengths"]
    policy.cache_for(Platform.detect()).put(bucket, old)
    for _ in range(2):
        policy.tune_bucket(params, Platform.detect(), BOTH, lengths=((5, 9, 3), (5, 9, 3)))
    assert seen[-2:] == [("bshd", None), ("thd", ((5, 9, 3), (5, 9, 3)))]
    policy.tune_bucket(params, Platform.detect(), BOTH, lengths=((9, 9, 9), (9, 9, 9)))  # other lengths: reused
    assert len(seen) == 3


def test_env_var_selects_the_measured_policy_and_inference_is_tuned_apart(two_engines, monkeypatch):
    _policy()
    monkeypatch.setenv("ATTN_DISPATCH_POLICY", "measured")
    decision = select(cpu_params(is_training=False))
    assert decision.policy == "measured" and decision.chosen == "unfused:fast"
    assert two_engines["unfused:fast"].backwards == 0


def test_close_engines_are_both_timed_fully(two_engines, tmp_path):
    two_engines["unfused:slow"].delay_s = 0.0
    policy = _policy(prune_ratio=100.0)
    result = policy.tune(cpu_params(), Platform.detect(), BOTH)
    assert set(result.entry["times_ms"]) == {"unfused:slow", "unfused:fast"} and not result.entry["probe_ms"]
    assert result.chosen == min(result.entry["times_ms"], key=result.entry["times_ms"].get)
    assert result.tuned_now and not policy.tune(cpu_params(), Platform.detect(), BOTH).tuned_now
    assert policy.tune(cpu_params(), Platform.detect(), BOTH, retune=True).tuned_now


def test_a_failing_engine_is_left_out_not_fatal(two_engines, caplog):
    two_engines["unfused:fast"].fail = True
    policy = _policy()
    assert select(cpu_params(), policy="measured").chosen == "unfused:slow"
    entry = policy.cache_for(Platform.detect()).get(BucketScheme().key(cpu_params()))
    assert "deliberate failure" in entry["errors"]["unfused:fast"]
    assert "failed while being timed" in caplog.text


def test_no_timing_for_a_described_platform_or_while_compiling(two_engines):
    policy = _policy()
    other = Platform.parse("cpu,torch=2.4.0")
    assert why_not_tunable(cpu_params(), other) is not None
    decision = select(cpu_params(), other, policy="measured")
    assert decision.chosen == "unfused:slow"  # nothing timed: the preference order decides
    assert two_engines["unfused:fast"].forwards == 0
    with pytest.raises(ValueError, match="not this machine"):
        policy.tune(cpu_params(), other, BOTH)
    assert why_not_tunable(cpu_params(), Platform.detect()) is None


def test_forced_backend_is_respected_by_the_measured_policy(two_engines):
    _policy()
    assert select(cpu_params(), policy="measured", force="unfused:slow").chosen == "unfused:slow"


def test_checked_policy_times_the_close_engines_for_real_through_selection(two_engines):
    """`checked` on the test engines: a stand-in profile predicts the slow engine fastest by 5% (too close to call),
    so both are timed for real (the measured policy's timer and cache) and the fast one wins; at a 20x prediction
    nothing is timed and the prediction stands."""
    from attn_dispatch.policy import AutoPolicy, CheckedPolicy, Choice
    from attn_dispatch.policy.auto import PREDICTED

    class Predicting(AutoPolicy):
        ratio = 1.05

        def choose(self, params, platform, eligible, lengths=None):
            return Choice("unfused:slow", "stand-in prediction",
                          {"unfused:slow": 1.0, "unfused:fast": self.ratio}, PREDICTED)

    two_engines["unfused:slow"].delay_s = 0.25
    measured = _policy()
    auto = Predicting(measured=measured)
    selection.set_policy("checked", CheckedPolicy(auto, measured))
    decision = select(cpu_params(), policy="checked")
    assert decision.policy == "checked" and decision.chosen == "unfused:fast"
    assert "measured fastest of the providers the profile could not separate" in decision.policy_reason
    assert two_engines["unfused:fast"].forwards > 0
    auto.ratio = 20.0
    selection.clear_cache()
    calls = two_engines["unfused:fast"].forwards
    decision = select(cpu_params(max_seqlen_q=256), policy="checked")  # another bucket, nothing timed
    assert decision.chosen == "unfused:slow" and "not timed" in decision.policy_reason
    assert two_engines["unfused:fast"].forwards == calls


# --- tune and bench commands ----------------------------------------------------------------------------

def test_tune_command(two_engines, tmp_path, capsys):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([
        {"dtype": "fp32", "batch_size": 2, "num_heads": 2, "head_dim_qk": 16, "max_seqlen_q": 30, "device_type": "cpu"},
        {"dtype": "fp32", "batch_size": 2, "num_heads": 2, "head_dim_qk": 16, "max_seqlen_q": 32, "device_type": "cpu"},
        {"dtype": "fp32", "batch_size": 1, "num_heads": 2, "head_dim_qk": 16, "max_seqlen_q": 8, "device_type": "cpu",
         "is_training": False, "window_size": [2, 0], "attn_mask_type": "causal"}]))
    assert main(["tune", "--shapes", str(shapes), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["chosen"] for r in out["results"]] == ["unfused:fast"] * 3
    assert [r["tuned_now"] for r in out["results"]] == [True, False, True]  # 30 and 32 share a bucket
    assert all(r["tuning_s"] > 0 for r in out["results"])  # what tuning each bucket cost
    assert main(["tune", "--shapes", str(shapes)]) == 0
    assert "[cached in " in capsys.readouterr().out
    assert main(["tune", "--show"]) == 0
    assert "2 buckets" in capsys.readouterr().out
    shapes.write_text(json.dumps([{"dtype": "fp32", "seqlen": 8}]))
    assert main(["tune", "--shapes", str(shapes)]) == 2
    assert "key 'seqlen' is not an AttentionParams field" in capsys.readouterr().err


def test_shapes_file_errors_name_the_problem(tmp_path):
    bad = tmp_path / "s.json"
    for text, message in (("[", "not valid JSON"), ("{}", "non-empty JSON list"), ("[3]", "entry 0 is int"),
                          ('[{"num_heads": 3, "num_gqa_groups": 2}]', "entry 0: num_heads=3")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_shapes(bad)


def test_bench_one_shape_on_the_cpu_writes_json_png_and_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ATTN_DISPATCH_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    args = ["bench", "--device", "cpu", "--dtype", "fp32", "--batch", "1", "--seqlen", "32", "--heads", "2",
            "--head-dim", "16", "--mask", "causal", "--warmup", "1", "--reps", "2", "--max-reps", "2",
            "--no-progress", "--out", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["rows"]] == ["fwd", "fwd_bwd"]
    for row in result["rows"]:
        timed = row["engines"]["unfused:pytorch"]
        assert timed["median_ms"] > 0 and timed["tflops"] > 0 and timed["reps"] == 2
        assert row["picks"] == {"auto": "unfused:pytorch", "order": "unfused:pytorch", "measured": "unfused:pytorch"}
        assert row["ratios"] == {"auto": 1.0, "order": 1.0, "measured": 1.0}
    assert result["rows"][1]["flops"] == pytest.approx(3.5 * result["rows"][0]["flops"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "d16 s32 b1 h2 causal fwd_bwd" in printed and "unfused:pytorch" in printed


def test_bench_rates_each_policy_pick_against_the_fastest(two_engines, tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["bench", "--grid", "quick", "--modes", "fwd", "--warmup", "1", "--reps", "3", "--max-reps", "3",
                 "--no-progress", "--out", str(out), "--plot", str(tmp_path / "p.png")]) == 0  # auto, order, measured
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 4 and (tmp_path / "p.png").exists()
    for row in result["rows"]:
        assert row["fastest"] == "unfused:fast" and row["picks"]["order"] == "unfused:slow"
        assert row["ratios"]["order"] > 1.5 and row["ratios"]["measured"] == 1.0
        assert row["measured"]["tuning_times_ms"]["unfused:fast"] > 0
    assert result["summary"]["order"]["worst_ratio"] > 1.5 and result["summary"]["measured"]["worst_ratio"] == 1.0
    # the default policy is rated too: on the CPU there is no profile, so auto (and checked) take the order's pick
    assert {row["picks"]["auto"] for row in result["rows"]} == {"unfused:slow"}
    assert "no performance profile" in result["rows"][0]["auto"]["reason"]
    assert main(["bench", "--grid", "quick", "--seqlen", "64"]) == 2
    assert "--grid cannot be combined" in capsys.readouterr().err
    assert main(["bench", "--grid", "quick", "--policies", "auto,fastest"]) == 2
    assert "policy='fastest' is not supported; expected one of auto, order, measured, checked" in \
        capsys.readouterr().err


def test_bench_rates_the_checked_policy_with_a_cache_of_its_own(two_engines, tmp_path):
    """`checked` in bench decides through selection with its own tuning cache: with a stand-in prediction that
    cannot separate the engines it times both and picks the fast one; nothing lands in the measured cache."""
    from attn_dispatch.benchmarking import bench
    from attn_dispatch.env import EnvFlags
    from attn_dispatch.policy import AutoPolicy, Choice
    from attn_dispatch.policy.auto import PREDICTED

    class CloseCall(AutoPolicy):
        def choose(self, params, platform, eligible, lengths=None):
            return Choice("unfused:slow", "stand-in prediction", {"unfused:slow": 1.0, "unfused:fast": 1.02},
                          PREDICTED)

    two_engines["unfused:slow"].delay_s = 0.25
    made = bench._checked_policy(None)
    checked = type(made)(CloseCall(measured=made.measured), made.measured)
    config = bench.BenchConfig(modes=("fwd",), settings=FAST, policies=("order", "checked"), show_progress=False)
    row = bench.bench_row(cpu_params(), Platform.detect(), EnvFlags.from_environ(), config, None, checked)
    assert row["picks"] == {"order": "unfused:slow", "checked": "unfused:fast"}
    assert row["checked"]["tuning_times_ms"]["unfused:fast"] > 0 and "could not separate" in row["checked"]["reason"]
    assert TuningCache(Platform.detect(), tmp_path).entries() == {}  # the usual cache (the fixture's) is untouched


def test_default_grid_covers_issue_8():
    from attn_dispatch.benchmarking.grid import default_grid

    grid = default_grid()
    assert len(grid) >= 30
    assert {p.head_dim_qk for p in grid} == {64, 128, 256}
    assert min(p.max_seqlen_q for p in grid) == 512 and max(p.max_seqlen_q for p in grid) == 16384
    assert {p.attn_mask_type for p in grid} == {"causal", "no_mask"}
    assert any(p.num_gqa_groups < p.num_heads for p in grid)
    assert any(BucketScheme().representative(p) != p for p in grid)  # off-bucket shapes test bucketing
    assert len({shape_label(p) for p in grid}) == len(grid)


# --- hot-path harness (the GPU figures come from benchmarks/bench_policy.py) -----------------------------

TINY = dict(batch=1, seqlen=16, heads=2, head_dim=16)


def test_overhead_harness_times_module_and_engine_on_the_same_inputs():
    from attn_dispatch.benchmarking import hotpath

    result = hotpath.overhead(torch.device("cpu"), torch.float32, calls=20, repeats=3, shape=TINY)
    assert result["chosen"] == "unfused:pytorch"
    assert set(result["results_us"]) == {"module", "engine_call", "engine_forward"}
    for figures in result["results_us"].values():
        assert len(figures["loop_us"]) == 3 and all(x > 0 for x in figures["loop_us"])
        assert all(value > 0 for name, value in figures.items() if name != "loop_us")
    module, engine = result["results_us"]["module"], result["results_us"]["engine_call"]
    added = result["module_over_engine_us"]
    assert added["loop_us_min"] == pytest.approx(module["loop_us_min"] - engine["loop_us_min"])
    paired = sorted(m - e for m, e in zip(module["loop_us"], engine["loop_us"]))
    assert added["paired_loop_us_median"] == pytest.approx(paired[1], abs=1e-2)  # loop_us is rounded to 1e-3


class _Scaled(torch.nn.Module):
    def __init__(self, recompile_each_call: bool):
        super().__init__()
        self.recompile_each_call, self.calls = recompile_each_call, 0

    def forward(self, q, k, v):
        scale = 1.0
        if self.recompile_each_call:
            self.calls += 1  # a changing int attribute is guarded on: each call compiles anew
            scale = float(self.calls)
        return torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v


@pytest.mark.parametrize("recompile", [False, True])
def test_compile_check_counts_compilations_after_the_first_call(recompile):
    from attn_dispatch.benchmarking import hotpath

    result = hotpath.check_compile(torch.device("cpu"), torch.float32, compiler="eager", calls=3, shape=TINY,
                                   factory=lambda: _Scaled(recompile))
    assert "error" not in result, result
    assert result["graphs_first_call"] >= 1
    assert (result["graphs_after_first_call"] > 0) is recompile
    assert result["ok"] is (not recompile) and result["matches_eager"] is (not recompile)
