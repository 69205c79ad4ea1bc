"""Property-based: over random calls, platforms and environments, selection behaves."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attn_dispatch import AttentionParams, EnvFlags, NoBackendAvailableError, Platform, explain, select
from attn_dispatch.params import BIAS_SHAPES, CP_COMM_TYPES, MASK_TYPES, QKV_FORMATS, SOFTMAX_TYPES
from attn_dispatch.platform import PROFILES

versions = st.sampled_from(["8.9.0", "8.9.7", "9.0.0", "9.1.0", "9.3.0", "9.5.1", "9.10.2", "9.19.0"])


@st.composite
def platforms(draw):
    if draw(st.booleans()):
        return PROFILES[draw(st.sampled_from(sorted(PROFILES)))]
    tokens = [draw(st.sampled_from(["sm70", "sm75", "sm80", "sm86", "sm89", "sm90", "sm100", "sm120", "cpu"]))]
    if draw(st.booleans()):
        tokens.append("cudnn=" + draw(versions))
    if draw(st.booleans()):
        tokens.append("flash-attn=" + draw(st.sampled_from(["2.0.9", "2.1.1", "2.3.6", "2.4.2", "2.6.3", "2.8.3"])))
    if draw(st.booleans()):
        tokens.append("flash-attn-4=4.0.0b36")
    if draw(st.booleans()):
        tokens.append("flash-attn-3=3.0.0b1")
    if draw(st.booleans()):
        tokens.append("cudnn-frontend=1.32.0")
    if draw(st.booleans()):
        tokens.append("torch=" + draw(st.sampled_from(["2.1.2", "2.5.1", "2.11.0"])))
    return Platform.parse(",".join(tokens))


@st.composite
def params(draw):
    heads = draw(st.sampled_from([1, 2, 8, 12, 16, 32]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4, 8, 16, 32) if heads % g == 0]))
    mask = draw(st.sampled_from(MASK_TYPES))
    bias = draw(st.sampled_from(["no_bias", "pre_scale_bias", "post_scale_bias", "alibi"]))
    window = draw(st.sampled_from([None, (-1, -1), (128, 0), (64, 64), (0, 0)]))
    if "causal" in mask and window is not None and window[1] not in (0, -1):
        window = (window[0], 0)
    return AttentionParams(
        dtype=draw(st.sampled_from(["fp16", "bf16", "fp32", "fp64"])),
        qkv_format=draw(st.sampled_from(QKV_FORMATS)),
        batch_size=draw(st.integers(1, 64)), num_heads=heads, num_gqa_groups=groups,
        head_dim_qk=draw(st.sampled_from([32, 40, 64, 72, 96, 128, 160, 192, 256, 320])),
        head_dim_v=draw(st.sampled_from([None, 64, 128, 256])),
        max_seqlen_q=draw(st.integers(1, 40000)), max_seqlen_kv=draw(st.one_of(st.none(), st.integers(1, 40000))),
        attn_mask_type=mask, window_size=window, bias_type=bias,
        bias_shape=draw(st.sampled_from(BIAS_SHAPES)) if bias in ("pre_scale_bias", "post_scale_bias") else None,
        dropout=draw(st.sampled_from([0.0, 0.1])), softmax_type=draw(st.sampled_from(SOFTMAX_TYPES)),
        is_training=draw(st.booleans()), deterministic=draw(st.booleans()), fp8=draw(st.booleans()),
        cp_size=draw(st.sampled_from([1, 2, 4])), cp_comm_type=draw(st.sampled_from(CP_COMM_TYPES)),
        device_type=draw(st.sampled_from(["cuda", "cpu"])),
    )


envs = st.fixed_dictionaries({}, optional={
    "NVTE_FLASH_ATTN": st.sampled_from(["0", "1"]), "NVTE_FUSED_ATTN": st.sampled_from(["0", "1"]),
    "NVTE_UNFUSED_ATTN": st.sampled_from(["0", "1"]), "NVTE_FUSED_ATTN_BACKEND": st.sampled_from(["0", "1", "2"]),
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": st.sampled_from(["0", "1"]),
    "ATTN_DISPATCH_BACKEND": st.sampled_from(["auto", "unfused", "cudnn_fused", "flash_attn_2", "flash_attn_4"]),
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params(), platforms(), envs)
def test_select_raises_only_documented_errors_and_always_explains(p, plat, environ):
    env = EnvFlags.from_environ(environ)
    try:
        decision = select(p, plat, env, use_cache=False)
    except NoBackendAvailableError as exc:
        decision = exc.decision
        assert decision.chosen is None
        assert str(exc).count(":") >= len(decision.verdicts)  # every backend appears with its reasons
    for v in decision.verdicts:
        assert v.eligible or v.reasons, f"{v.id} rejected without a reason"
        for r in v.reasons:
            assert r.code and r.message and r.source
    if decision.chosen is not None:
        assert decision.verdict(decision.backend, decision.provider).eligible
        if env.forced_backend:
            assert decision.backend == env.forced_family
    assert explain(p, plat, env) == explain(p, plat, env, use_cache=False) == decision


def test_odd_local_length_under_causal_cp_is_refused_with_the_reason():
    """A causal call under p2p context parallelism with an odd local length (hypothesis found sq=skv=1, cp_size=2)
    is refused by the CP check, with the lengths and the fix, instead of building per-block calls of length 0."""
    from attn_dispatch import AttentionParams, Platform, explain

    p = AttentionParams(batch_size=1, num_heads=1, head_dim_qk=32, max_seqlen_q=1, max_seqlen_kv=1,
                        attn_mask_type="causal", cp_size=2, cp_comm_type="p2p", device_type="cuda")
    decision = explain(p, Platform.parse("h100-cudnn9"))
    reasons = [r for v in decision.verdicts for r in v.reasons if "local max_seqlen_q=1" in r.message]
    assert len(reasons) == len(decision.verdicts)  # every engine's CP check says it
    assert all("must be even" in r.message and "2*cp_size=4" in (r.fix or "") for r in reasons)
    assert decision.chosen is None
