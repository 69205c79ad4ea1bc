"""The CPU training example runs end to end through DotProductAttention and its loss goes down."""
from __future__ import annotations

import importlib.util
import pathlib

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_gpt_cpu.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_gpt_cpu", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_small_gpt_learns_on_cpu():
    lines = []
    losses = load_example().train(steps=40, seed=0, log=lines.append)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, f"loss did not go down enough: {first:.3f} -> {last:.3f}"
    assert lines[-1] == "engine: unfused:pytorch"


def test_llama_fine_tunes_through_the_transformers_integration():
    import pytest

    pytest.importorskip("transformers")
    path = EXAMPLE.parent / "finetune_llama_hf.py"
    spec = importlib.util.spec_from_file_location("finetune_llama_hf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses = module.train(steps=30, seed=0, log=lambda line: None)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.7 * first, f"loss did not go down enough: {first:.3f} -> {last:.3f}"
