"""KV-cache inference on a GPU, per engine forced: the generation loop of benchmarking/kv_loop.py (prompts join,
decode, chunked prefill, reorder, leave; two layers) in bf16 against float64 attention recomputed over each
sequence's whole prefix, contiguous and paged caches, bshd and thd, GQA, with and without a sliding window.

A combination the engine's table declares supported must match (max |err| <= 2e-2, the bf16 tolerance of the
other GPU tests, on outputs of magnitude ~1); one it refuses must be refused by selection (forced backend ->
NoBackendAvailableError naming the reason), never answered wrongly. An engine not installed is skipped with its
table's reason. Page sizes: each engine's own (flash-attn-4: its key tile 128 and a row-loaded 64; torch FA2: 256;
cuDNN and unfused: 64).
"""
from __future__ import annotations

import pytest
import torch

from attn_dispatch import EnvFlags, NoBackendAvailableError, Platform
from attn_dispatch.benchmarking.kv_loop import run_generation
from attn_dispatch.constraints import TABLES

pytestmark = pytest.mark.gpu
TOL = 2e-2
ENGINES = ("flash_attn_2:torch", "flash_attn_4:cute", "cudnn_fused:frontend", "unfused:pytorch")
PAGES = {"flash_attn_2:torch": (256,), "flash_attn_4:cute": (128, 64), "cudnn_fused:frontend": (64,),
         "unfused:pytorch": (64,)}
INSTALL_TOPICS = ("environment", "platform", "package")


def cases():
    for engine in ENGINES:
        for fmt in ("thd", "bshd"):
            for window in (-1, 24):
                yield engine, fmt, None, window
                for page in PAGES[engine]:
                    yield engine, fmt, page, window


def _installed_or_skip(engine: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    verdict = TABLES[engine].evaluate(_probe_params(), Platform.detect(), EnvFlags.from_environ({}))
    missing = [r for r in verdict.reasons if any(r.code.endswith(t) or t in r.code for t in INSTALL_TOPICS)]
    if missing:
        pytest.skip(f"{engine}: {missing[0].message}")


def _probe_params():
    from attn_dispatch import AttentionParams

    return AttentionParams(dtype="bfloat16", qkv_format="thd", batch_size=2, num_heads=8, num_gqa_groups=2,
                           head_dim_qk=64, max_seqlen_q=1, max_seqlen_kv=256,
                           attn_mask_type="padding_causal_bottom_right", is_training=False)


def generation(engine: str, fmt: str, page: int | None, window: int) -> dict:
    paged = page is not None
    max_len = 256 if paged and page == 256 else 128
    return run_generation(fmt, paged, window, dtype=torch.bfloat16, device="cuda", heads=8, kv_heads=2, head_dim=64,
                          max_len=max_len, page_size=page or 4, total_pages=6 * (max_len // page) if paged else None,
                          backend=engine)


@pytest.mark.parametrize("engine, fmt, page, window", list(cases()))
def test_generation_matches_full_attention(engine, fmt, page, window):
    _installed_or_skip(engine)
    try:
        result = generation(engine, fmt, page, window)
    except NoBackendAvailableError as exc:  # the table refuses this cache: it must say why
        verdict = exc.decision.verdict(*engine.split(":"))
        assert not verdict.eligible and verdict.reasons, exc
        return
    assert result["chosen"] == [engine]
    assert result["worst_abs_err"] <= TOL, result["worst_abs_err"]
    assert result["padding_zero"]
