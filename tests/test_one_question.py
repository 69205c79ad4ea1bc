"""What explain() says is what forward runs, in every mode: after a forward, explain() on the same module and
arguments names the same engine for the same params, or refuses in the same way.

Covers plain dense, padded and packed calls (with sequence counts that change between calls), KV-cache steps,
FP8 regions (refused on the CPU), FP8 with a KV cache, context parallelism over gloo, and environment changes
between calls; a hypothesis property test draws sequences of such calls.
"""
from __future__ import annotations

import datetime
import os
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attn_dispatch as ad
from attn_dispatch import DotProductAttention, NoBackendAvailableError, Platform, selection
from attn_dispatch.fp8 import DelayedScaling, fp8_autocast
from attn_dispatch.params import AttentionParams

from spawn_ranks import free_port, spawn_ranks, teardown, write_gathered

H, HKV, D = 4, 2, 8
ENV_NAMES = ("NVTE_UNFUSED_ATTN", "NVTE_FLASH_ATTN", "ATTN_DISPATCH_BACKEND", "ATTN_DISPATCH_POLICY")


def _outcome(run):
    """('ok', chosen, params) or ('refused', None, None) for 'nothing qualifies', or (error type, message)."""
    try:
        decision = run()
    except NoBackendAvailableError:
        return ("refused", None, None)
    except (ValueError, TypeError) as exc:
        return (type(exc).__name__, str(exc), None)
    if decision is None or decision.chosen is None:
        return ("refused", None, None)
    return ("ok", decision.chosen, decision.params)


def assert_explain_agrees(module, q, k, v, **kwargs):
    """Run forward, then explain() with the same arguments; both must give the same answer."""
    def forward():
        module(q, k, v, **kwargs)
        return module.last_decision

    ran = _outcome(forward)
    said = _outcome(lambda: module.explain(q, k, v, **kwargs))
    assert said == ran, f"forward: {ran}\nexplain: {said}"
    return ran


def _packed(counts_and_len, seed=0, rows=None):
    """count sequences, the first of the longest length; rows: the tensors' token rows (>= the tokens used)."""
    count, longest = counts_and_len
    g = torch.Generator().manual_seed(seed)
    lengths = [longest] + [int(x) for x in torch.randint(1, longest + 1, (count - 1,), generator=g)]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    t = int(cu[-1]) if rows is None else rows
    return (torch.randn(t, H, D, generator=g), torch.randn(t, HKV, D, generator=g),
            torch.randn(t, HKV, D, generator=g), cu)


# --- the reproductions --------------------------------------------------------------------------------------
def test_packed_calls_plan_per_sequence_count():
    """A module called with 2 sequences, then 33 of the same longest length, in tensors of the same shape: the
    second call's decision describes 33 sequences, as explain() does (the policy's pick can depend on the count)."""
    module = DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="thd", attn_mask_type="padding_causal")
    for count in (2, 33, 2):
        q, k, v, cu = _packed((count, 16), seed=count, rows=33 * 16)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
        ran = assert_explain_agrees(module, q, k, v, **kwargs)
        assert ran[0] == "ok" and ran[2]["batch_size"] == count


def test_the_shipped_profile_picks_by_sequence_count_on_a_described_h100():
    """Why the count belongs in the plan's key: on a described H100 the default's pick for a packed call changes
    with the number of sequences alone."""
    h100 = Platform.parse("h100-cudnn9")
    picks = set()
    for count in (1, 2, 8, 32, 64):
        params = AttentionParams(dtype=torch.bfloat16, qkv_format="thd", batch_size=count, num_heads=16,
                                 num_gqa_groups=16, head_dim_qk=128, head_dim_v=128, max_seqlen_q=2048,
                                 max_seqlen_kv=2048, attn_mask_type="padding_causal", is_training=True,
                                 device_type="cuda")
        picks.add(selection.explain(params, h100).chosen)
    assert len(picks) > 1, picks


def test_fp8_with_a_kv_cache_is_refused_by_explain_as_by_forward():
    ip = ad.InferenceParams(2, 16, HKV, D, torch.float32, device="cpu")
    module = DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="bshd", attn_mask_type="causal").eval()
    ip.pre_step(OrderedDict(a=3, b=3))
    q, k, v = torch.randn(2, 3, H, D), torch.randn(2, 3, HKV, D), torch.randn(2, 3, HKV, D)
    with torch.no_grad(), fp8_autocast(recipe=DelayedScaling(fp8_dpa=True)):
        ran = assert_explain_agrees(module, q, k, v, inference_params=ip)
    assert ran[0] == "ValueError" and "KV cache" in ran[1]
    assert not ip._caches, "a refused step writes nothing to the cache"


# --- context parallelism over gloo ----------------------------------------------------------------------------
def _cp_worker(rank: int, world: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = []
    try:
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(2, 8, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
        for comm in ("p2p", "all_gather", "a2a"):
            for dropout in (0.0, 0.1):
                module = DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="causal",
                                             attention_dropout=dropout, cp_group=dist.group.WORLD,
                                             cp_comm_type=comm)
                ran = _outcome(lambda: (module(q, q, q), module.last_decision)[1])
                said = _outcome(lambda: module.explain(q, q, q))
                results.append(dict(comm=comm, dropout=dropout, ran=ran[:2], said=said[:2],
                                    same_params=ran[2] == said[2],
                                    cp_size=None if said[2] is None else said[2]["cp_size"]))
    finally:
        write_gathered(results, world, rank, out_path)
        teardown()


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cp") / "question.json")
    return spawn_ranks(_cp_worker, (2, free_port(), out), 2, out, "explain-under-CP", 120)


def test_explain_under_context_parallelism_answers_for_the_cp_call(cp_results):
    """explain() under CP describes the CP call forward makes: its cp_size, and the same refusal where forward
    refuses (dropout under CP is not supported)."""
    assert not isinstance(cp_results, str), cp_results
    for rank_results in cp_results:
        for case in rank_results:
            assert case["said"] == case["ran"], case
            if case["ran"][0] == "ok":
                assert case["same_params"] and case["cp_size"] == 2, case
        refused = [c for c in rank_results if c["dropout"] > 0]
        assert refused and all(c["ran"][0] == "refused" for c in refused), refused
        assert any(c["ran"][0] == "ok" for c in rank_results)


# --- the property: any sequence of calls and environment changes -----------------------------------------------
def _dense(fmt, b, s):
    shape = (lambda n: (b, s, n, D)) if fmt == "bshd" else (lambda n: (s, b, n, D))
    return torch.randn(shape(H)), torch.randn(shape(HKV)), torch.randn(shape(HKV))


call = st.one_of(
    st.tuples(st.just("dense"), st.sampled_from(["bshd", "sbhd"]), st.integers(1, 3), st.integers(1, 9),
              st.sampled_from(["causal", "no_mask", "causal_bottom_right"])),
    st.tuples(st.just("padded"), st.integers(1, 3), st.integers(2, 9)),
    st.tuples(st.just("packed"), st.integers(1, 40), st.integers(1, 12)),
    st.tuples(st.just("fp8"), st.sampled_from(["bshd", "sbhd"]), st.integers(1, 3), st.integers(1, 9)),
    st.tuples(st.just("kv"), st.integers(1, 3)),
    st.tuples(st.just("documents"), st.integers(1, 2), st.integers(4, 12)),
)
env_change = st.one_of(st.none(), st.tuples(st.sampled_from(ENV_NAMES), st.sampled_from([None, "0", "1"])),
                       st.tuples(st.just("ATTN_DISPATCH_BACKEND"), st.sampled_from(["unfused", "flash_attn_2"])),
                       st.tuples(st.just("ATTN_DISPATCH_POLICY"), st.sampled_from(["order", "auto"])))


def _one_call(kind, shape, dense, packed, cached, ip, cache_len):
    """A function making one drawn call (forward, then explain) on fresh inputs of the drawn shape."""
    if kind == "dense":
        fmt, b, s, mask = shape
        return lambda: assert_explain_agrees(dense, *_dense(fmt, b, s), qkv_format=fmt, attn_mask_type=mask)
    if kind == "padded":
        b, s = shape

        def padded():
            lengths = torch.randint(1, s + 1, (b,))
            mask = (torch.arange(s)[None, :] >= lengths[:, None])[:, None, None, :]
            assert_explain_agrees(dense, *_dense("bshd", b, s), attention_mask=mask, attn_mask_type="padding_causal")
        return padded
    if kind == "documents":  # a bool mask of causal documents: read as the thd call it is, unless a backend is forced
        b, s = shape

        def documents():
            split = int(torch.randint(1, s, ()))
            same = (torch.arange(s) < split)[:, None] == (torch.arange(s) < split)[None, :]
            keep = same & torch.ones(s, s, dtype=torch.bool).tril()
            assert_explain_agrees(dense, *_dense("bshd", b, s), attention_mask=~keep.expand(b, 1, s, s),
                                  attn_mask_type="arbitrary")
        return documents
    if kind == "packed":  # tensors of one shape: only the sequence count and lengths change
        def packed_call():
            q, k, v, cu = _packed(shape, rows=40 * 12)
            assert_explain_agrees(packed, q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        return packed_call
    if kind == "fp8":
        fmt, b, s = shape

        def fp8_call():
            with fp8_autocast(recipe=DelayedScaling(fp8_dpa=True)):
                assert_explain_agrees(dense, *_dense(fmt, b, s), qkv_format=fmt)
        return fp8_call
    (n_new,) = shape

    def kv_step():
        names = ("s0", "s1")
        if any(cache_len.get(n, 0) + n_new > 64 for n in names):
            return
        ip.pre_step(OrderedDict((n, n_new) for n in names))
        q, k, v = (torch.randn(2, n_new, heads, D) for heads in (H, HKV, HKV))
        with torch.no_grad():
            ran = assert_explain_agrees(cached, q, k, v, inference_params=ip)
        if ran[0] == "ok":
            for n in names:
                cache_len[n] = cache_len.get(n, 0) + n_new
    return kv_step


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(call, env_change, st.booleans()), min_size=1, max_size=6))
def test_explain_after_forward_agrees_in_every_mode(steps, monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    dense = DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="bshd", attn_mask_type="causal")
    packed = DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="thd", attn_mask_type="padding_causal")
    cached = DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="bshd", attn_mask_type="causal",
                                 layer_number=1).eval()
    ip = ad.InferenceParams(3, 64, HKV, D, torch.float32, device="cpu")
    cache_len = {}
    try:
        for (kind, *shape), change, training in steps:
            dense.train(training)
            packed.train(training)
            run = _one_call(kind, shape, dense, packed, cached, ip, cache_len)
            run()
            if change is not None:  # the same call again, after an environment change
                name, value = change
                if value is None:
                    monkeypatch.delenv(name, raising=False)
                else:
                    monkeypatch.setenv(name, value)
                run()
    finally:
        for name in ENV_NAMES:
            monkeypatch.delenv(name, raising=False)


def test_a_decode_step_is_decided_per_128_keys_and_runs_its_own_length():
    """A one-query inference step over a growing cache: steps within 128 keys share one decision (the selection
    cache answers), explain says so, and the output is the call's own (keys past its length are not attended)."""
    import torch

    from attn_dispatch import DotProductAttention
    from attn_dispatch.inputs import DECODE_KV_STEP

    module = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="no_mask").eval()
    q = torch.randn(2, 1, 4, 16, dtype=torch.float64)
    decided = []
    for kv in (DECODE_KV_STEP + 1, 2 * DECODE_KV_STEP, 2 * DECODE_KV_STEP + 1):
        k, v = (torch.randn(2, kv, 2, 16, dtype=torch.float64) for _ in range(2))
        with torch.no_grad():
            decision = module.explain(q, k, v)
            out = module(q, k, v)
        decided.append(decision.params["max_seqlen_kv"])
        assert any("decided per 128 keys" in n for n in decision.notes)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) / 4.0
        want = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.repeat_interleave(2, 2)).flatten(-2)
        torch.testing.assert_close(out, want)
    assert decided == [2 * DECODE_KV_STEP, 2 * DECODE_KV_STEP, 3 * DECODE_KV_STEP]
    short = module.explain(q, *(torch.randn(2, 100, 2, 16, dtype=torch.float64) for _ in range(2)))
    assert short.params["max_seqlen_kv"] == 100  # few keys: the exact length
    module.train()
    trained = module.explain(q.requires_grad_(), *(torch.randn(2, 129, 2, 16, dtype=torch.float64) for _ in range(2)))
    assert trained.params["max_seqlen_kv"] == 129  # training calls are decided for their own length
