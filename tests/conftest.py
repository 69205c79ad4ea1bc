"""Shared test setup: GPU tests skip cleanly without CUDA; decisions start from a clean cache."""
from __future__ import annotations

import os

# One intra-op thread per test process: the tests' tensors are small and CI runs one pytest worker per core
# (pytest -n), where a second thread per process only busy-waits on a core another worker needs. Set before torch
# starts its pool, and in the environment so that spawned ranks and subprocesses start with it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    from attn_dispatch.env import PRIVATE_TORCH

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine: see benchmarks/README.md)")
    no_private = pytest.mark.skip(reason="asserts a private-torch shortcut, which ATTN_DISPATCH_PRIVATE_TORCH=0 "
                                         "turns off (tests/test_plans.py checks that it does)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "private_torch" in item.keywords and not PRIVATE_TORCH:
            item.add_marker(no_private)


@pytest.fixture(autouse=True)
def _clean_decision_cache(monkeypatch):
    from attn_dispatch import selection

    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "NVTE_FUSED_ATTN_BACKEND",
                 "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "NVTE_FP8_DPA_BWD", "NVTE_DEBUG", "NVTE_DEBUG_LEVEL",
                 "ATTN_DISPATCH_BACKEND", "ATTN_DISPATCH_POLICY", "ATTN_DISPATCH_ALLOW_UNTESTED_VERSIONS"):
        monkeypatch.delenv(name, raising=False)
    selection.clear_cache()
    yield
    selection.clear_cache()
